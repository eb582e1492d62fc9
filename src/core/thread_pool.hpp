// A small persistent pool for the CPU backend. Work is split into tasks whose boundaries do not
// depend on the thread count, and every task writes disjoint outputs in a fixed order, so results
// are bitwise independent of how many threads run them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mok {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);  // 0: std::thread::hardware_concurrency()
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls task(i) once for every i in [0, num_tasks), on the pool and the calling thread; returns
  // when all are done. An exception thrown by a task is rethrown here (the first one).
  void run(std::int64_t num_tasks, const std::function<void(std::int64_t)>& task);

 private:
  void worker_loop();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(std::int64_t)>* task_ = nullptr;
  std::int64_t num_tasks_ = 0;
  std::int64_t next_ = 0;
  std::int64_t finished_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace mok
