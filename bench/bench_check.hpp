// What the standalone GEMM benchmarks (bench_gemm.cu, bench_supply.cu, bench_kloop.cu) share: the
// CUDA error check (a failing call ends the benchmark with its name and CUDA's message, before any
// number is written for it), and the ceiling benchmarks' arguments.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#define CHECK_CUDA(expr)                                                      \
  do {                                                                        \
    cudaError_t e_ = (expr);                                                  \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

// `program OUT.jsonl [COMMIT]`: the results file opened for writing and the commit (default
// "unknown"); the usage or the file's name on stderr and exit status 2 otherwise.
inline std::FILE* open_results(int argc, char** argv, std::string& commit) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.jsonl [COMMIT]\n", argv[0]);
    std::exit(2);
  }
  commit = argc > 2 ? argv[2] : "unknown";
  std::FILE* json = std::fopen(argv[1], "w");
  if (json == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", argv[1]);
    std::exit(2);
  }
  return json;
}
