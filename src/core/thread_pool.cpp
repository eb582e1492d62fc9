#include "core/thread_pool.hpp"

#include <algorithm>
#include <exception>

namespace mok {

ThreadPool::ThreadPool(int num_threads) {
  int n = num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
  n = std::max(n, 1);
  workers_.reserve(n - 1);
  for (int i = 1; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

// Takes tasks until none are left. Called with the mutex NOT held.
void ThreadPool::drain() {
  for (;;) {
    std::int64_t i;
    const std::function<void(std::int64_t)>* task;
    {
      std::lock_guard lock(mutex_);
      if (next_ >= num_tasks_) return;
      i = next_++;
      task = task_;
    }
    try {
      (*task)(i);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    bool all_done;
    {
      std::lock_guard lock(mutex_);
      all_done = ++finished_ == num_tasks_;
    }
    if (all_done) done_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
  }
}

void ThreadPool::run(std::int64_t num_tasks, const std::function<void(std::int64_t)>& task) {
  if (num_tasks <= 0) return;
  if (workers_.empty() || num_tasks == 1) {
    for (std::int64_t i = 0; i < num_tasks; ++i) task(i);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    task_ = &task;
    num_tasks_ = num_tasks;
    next_ = 0;
    finished_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  drain();
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return finished_ == num_tasks_; });
    error = error_;
    task_ = nullptr;
    num_tasks_ = 0;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace mok
