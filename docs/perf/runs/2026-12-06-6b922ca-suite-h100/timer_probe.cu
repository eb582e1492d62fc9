// globaltimer step, and how long try_wait suspends on a phase that never completes (plain, hinted)
#include <cstdio>
#include <cstdint>
__device__ uint64_t gt() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ uint32_t sa(void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ bool tw(uint64_t* b, uint32_t par) {
  uint32_t d; asm volatile("{.reg .pred p; mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2; selp.u32 %0,1,0,p;}" : "=r"(d) : "r"(sa(b)), "r"(par) : "memory"); return d; }
__device__ bool twh(uint64_t* b, uint32_t par, uint32_t h) {
  uint32_t d; asm volatile("{.reg .pred p; mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2, %3; selp.u32 %0,1,0,p;}" : "=r"(d) : "r"(sa(b)), "r"(par), "r"(h) : "memory"); return d; }
__global__ void k(uint64_t* out) {
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar))); }
  __syncthreads();
  // timer steps
  uint64_t prev = gt(), minstep = ~0ull; int steps = 0;
  while (steps < 50) { uint64_t t = gt(); if (t != prev) { if (t - prev < minstep) minstep = t - prev; prev = t; ++steps; } }
  out[0] = minstep;
  uint32_t hints[] = {0, 1, 100, 1000, 10000, 100000};
  for (int r = 0; r < 3; ++r) { uint64_t a = gt(); bool d = tw(&bar, 0); out[1 + r] = gt() - a + (d ? 1ull << 60 : 0); }
  for (int i = 0; i < 6; ++i) { uint64_t a = gt(); bool d = twh(&bar, 0, hints[i]); out[4 + i] = gt() - a + (d ? 1ull << 60 : 0); }
}
// owed bytes completed after delay_ns by warp 1: how long thread 0's plain try_wait sleeps
__global__ void k2(uint64_t* out, uint64_t delay_ns) {
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar)));
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], 16;" :: "r"(sa(&bar)) : "memory");
  }
  __syncthreads();
  if (threadIdx.x == 32) { uint64_t s = gt(); while (gt() - s < delay_ns) {} asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], 16;" :: "r"(sa(&bar)) : "memory"); }
  if (threadIdx.x == 0) { for (int r = 0; r < 4; ++r) { uint64_t a = gt(); bool d = tw(&bar, 0); out[r] = gt() - a + (d ? 1ull << 60 : 0); } }
}
int main() {
  uint64_t* d; cudaMalloc(&d, 16 * 8); k<<<1, 32>>>(d); uint64_t h[16]; cudaMemcpy(h, d, 16 * 8, cudaMemcpyDeviceToHost);
  printf("globaltimer min step %llu ns\n", (unsigned long long)h[0]);
  for (int r = 0; r < 3; ++r) printf("try_wait plain: %llu ns\n", (unsigned long long)h[1 + r]);
  uint32_t hints[] = {0, 1, 100, 1000, 10000, 100000};
  for (int i = 0; i < 6; ++i) printf("try_wait hint %u ns: %llu ns\n", hints[i], (unsigned long long)h[4 + i]);
  for (uint64_t delay : {2000ull, 50000ull, 1000000ull, 20000000ull}) {
    k2<<<1, 64>>>(d, delay); cudaMemcpy(h, d, 4 * 8, cudaMemcpyDeviceToHost);
    printf("owed bytes landing after %llu ns: plain try_wait probes %llx %llx %llx %llx (bit 60: done)\n", (unsigned long long)delay,
      (unsigned long long)h[0], (unsigned long long)h[1], (unsigned long long)h[2], (unsigned long long)h[3]);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
