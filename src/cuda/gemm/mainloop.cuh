// The warp-specialized mainloop: one Producer warpgroup (one elected thread issues TMA into a
// F::kStages-deep shared-memory ring) and two Consumer warpgroups (each issues wgmma m64n256k16 on
// its 64-row half of a 128 x 256 tile; e4m3 forms m64n128k32 on a 128 x 128 tile). Full barriers:
// one arrival from the Producer + the stage's bulk bytes (the M-grouped e4m3 forms: and one from
// their weight scales' cp.async; pairs: and one from the peer's Producer). Empty barriers: one
// arrival per reading consumer warp (F::kReaders; pairs: of both CTAs) once its wgmma have read
// the stage (the e4m3 forms: per consumer thread, which also reads the stage's scales;
// release_stage_fp8). The tile queue (K-grouped forms):
// the Producer draws a ticket, publishes it in a slot and arrives on the slot's full barrier; every
// consumer thread reads it, and each consumer warp then arrives on the slot's empty barrier.
//
// Giving up (every wait bounded, and no trap: a trap kills the CUDA context and the job with it). A
// wait that passes its deadline marks the CTA aborted (CtaAbort, in shared memory) and describes
// itself there; from then on every wait of the CTA gives up at once. The Producer stops issuing
// loads, waits for the loads it issued to land (drain_loads) and leaves; the Consumers leave the
// tile queue at the next position (which they all see closed, take_queued_ticket) or, in the static
// order, finish their remaining tiles without waiting (their outputs are void). Every role reaches
// the kernel's end, where one thread reports the CTA's first timed-out wait to the host.
// NOTES: the Consumers never leave a loop on their own reading of the abort flag: their warps read
// it at different times, and a warpgroup whose warps disagreed would split around wgmma (which all
// four warps issue together) or a named barrier, and hang. What they act on is the same for all of
// them: the static tile order, or the queue position's value, which the Producer's publication and
// the Consumers' closing race for with one compare-and-swap (so no Consumer can see a ticket that
// another one missed).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemm/descriptor.cuh"
#include "cuda/gemm/forms.cuh"
#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace mok::gemm {

// Stage index and phase parity of the ring, advanced identically by producer and consumers.
template <int kStages>
struct PipelineState {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// The tile queue's position as one counter (slot = count mod depth, parity = (count / depth) mod
// 2): the Consumers carry it across a tile's K loop and epilogue, where registers are scarce.
struct TileQueueState {
  static_assert((kTileQueueDepth & (kTileQueueDepth - 1)) == 0, "depth a power of two");
  unsigned count = 0;
  __device__ int slot() const { return static_cast<int>(count % kTileQueueDepth); }
  __device__ std::uint32_t phase() const { return (count / kTileQueueDepth) & 1u; }
  // The position's tag in its slot (slots start at tag 0: never published).
  __device__ unsigned tag() const { return count + 1; }
  __device__ void advance() { ++count; }
};
inline constexpr int kNoTile = -1;  // the ticket of the position after the last tile

// A queue slot: the 64-bit word {tag of the position it holds, ticket}.
__device__ __forceinline__ unsigned long long queue_entry(unsigned tag, int ticket) {
  return static_cast<unsigned long long>(tag) << 32 | static_cast<unsigned>(ticket);
}
__device__ __forceinline__ unsigned entry_tag(unsigned long long entry) {
  return static_cast<unsigned>(entry >> 32);
}
__device__ __forceinline__ int entry_ticket(unsigned long long entry) {
  return static_cast<int>(static_cast<unsigned>(entry));
}

// Ids of the barriers in timeout reports (their names: launch.cu, report_text).
enum : int {
  kBarrierFull = 0,
  kBarrierEmpty = 1,
  kBarrierTileFull = 2,
  kBarrierTileEmpty = 3,
};

// The CTA's give-up state (shared memory, zero at start): `aborted` turns 1 once one of its waits
// timed out, and that first wait describes itself in the other fields for the report.
struct CtaAbort {
  int aborted;
  int barrier_id;
  unsigned parity;
  unsigned smem_address;
  int thread;
  int unused[3];

  __device__ void give_up(const std::uint64_t* bar, std::uint32_t wait_parity, int id) {
    if (atomicCAS(&aborted, 0, 1) != 0) return;  // not the first: the report is another wait's
    barrier_id = id;
    parity = wait_parity;
    // The low 24 bits: the offset in the CTA's own shared memory (under 228 KiB). In a cluster
    // launch the address carries the CTA's rank above them (rank 1 reported 0x1000000 plus the
    // offset rank 0 reports, NOTES 2026-12-06, 6b922ca).
    smem_address = ptx::smem_addr(bar) & 0xFFFFFFu;
    thread = static_cast<int>(threadIdx.x);
  }
};
static_assert(sizeof(CtaAbort) == 32, "config.hpp, kBarrierBytes");

// Dynamic shared memory: F::kStages x {A tile, B tile} within kRingBytes, then the barriers, the
// queue's slots and the give-up state (config.hpp, kBarrierBytes; the same offsets for every form).
template <class F>
struct SharedRing {
  std::uint8_t* base;  // 1024-byte aligned
  __device__ std::uint8_t* a(int s) const { return base + s * F::kStageBytes; }
  __device__ std::uint8_t* b(int s) const { return base + s * F::kStageBytes + kTileABytes; }
  // An e4m3 stage's block scales (F::kScaleBytes): A's 128 rows', then the K-grouped form's B
  // columns' or the M-grouped forms' weight block's.
  __device__ std::uint8_t* scales(int s) const {
    return base + s * F::kStageBytes + kTileABytes + F::kTileBBytes;
  }
  // The TMA-store epilogue's staging tile (F::kStagingBytes, 1024-byte aligned), after the stages.
  __device__ std::uint8_t* staging() const { return base + F::kStages * F::kStageBytes; }
  __device__ std::uint64_t* barriers() const {
    return reinterpret_cast<std::uint64_t*>(base + kRingBytes);
  }
  __device__ std::uint64_t* full(int s) const { return barriers() + s; }
  __device__ std::uint64_t* empty(int s) const { return barriers() + kMaxStages + s; }
  __device__ std::uint64_t* tile_full(int q) const { return barriers() + 2 * kMaxStages + q; }
  __device__ std::uint64_t* tile_empty(int q) const {
    return barriers() + 2 * kMaxStages + kTileQueueDepth + q;
  }
  // Two slots no wait uses (the removed ping-pong schedule's turns; config.hpp, kBarrierBytes).
  __device__ std::uint64_t* turn(int wg) const {
    return barriers() + 2 * kMaxStages + 2 * kTileQueueDepth + wg;
  }
  __device__ unsigned long long* tile_slot(int q) const {
    return reinterpret_cast<unsigned long long*>(barriers() + 2 * kMaxStages + 2 * kTileQueueDepth +
                                                 2) +
           q;
  }
  __device__ CtaAbort* abort() const {
    return reinterpret_cast<CtaAbort*>(tile_slot(kTileQueueDepth));
  }
  // One thread, before the CTA barrier that precedes every other use.
  __device__ void init_barriers() const {
    for (int s = 0; s < F::kStages; ++s) {
      ptx::mbarrier_init(full(s), F::kFullArrivals);
      ptx::mbarrier_init(empty(s), F::kEmptyArrivals);
    }
    for (int q = 0; q < kTileQueueDepth; ++q) {
      ptx::mbarrier_init(tile_full(q), 1);
      ptx::mbarrier_init(tile_empty(q), kConsumerThreads / 32);  // every consumer warp reads it
      *tile_slot(q) = 0;
    }
    for (int w = 0; w < 2; ++w) ptx::mbarrier_init(turn(w), 4);  // unused (see turn)
    *abort() = CtaAbort{};
  }
};
static_assert((2 * kMaxStages + 2 * kTileQueueDepth + 2) * 8 + kTileQueueDepth * 8 +
                      sizeof(CtaAbort) <=
                  kBarrierBytes,
              "barrier region overflow");

// An engine wait: true once the phase with `parity` of `bar` (a kBarrier* `id`) completed; false
// when the CTA gives up (this wait passed p.wait_timeout_ns, or the CTA had already aborted), and
// the caller goes on without the data. `heed_abort` false: only the deadline ends it, and it is
// at least ptx::kShortWaitNs (the Producer's drain, which must outlast an abort and let the copies
// in flight land even when the launch's deadline is a test's few nanoseconds).
template <class F>
__device__ __forceinline__ bool wait_barrier(const SharedRing<F>& ring, std::uint64_t* bar,
                                             std::uint32_t parity, int id, const GemmParams& p,
                                             bool heed_abort = true) {
  CtaAbort* abort = ring.abort();
  const unsigned long long timeout_ns =
      heed_abort || p.wait_timeout_ns >= ptx::kShortWaitNs ? p.wait_timeout_ns : ptx::kShortWaitNs;
  const ptx::WaitStatus s =
      ptx::mbarrier_wait(bar, parity, timeout_ns, heed_abort ? &abort->aborted : nullptr);
  if (s == ptx::WaitStatus::complete) return true;
  if (s == ptx::WaitStatus::timed_out) abort->give_up(bar, parity, id);
  return false;
}

// After every role of the CTA has left its loops (a CTA barrier between), by one thread: a CTA
// that gave up reports its first timed-out wait in `report` (the launch's, in mapped host
// memory), unless a report is there already, which the host has not taken yet. `lock`: the
// report's word of device memory, zero unless a CTA is writing it (so the first one wins whole).
__device__ __forceinline__ void report_wait_timeout(const CtaAbort& a, WaitTimeoutReport* report,
                                                    unsigned* lock, unsigned long long timeout_ns) {
  if (report == nullptr || lock == nullptr || atomicCAS(lock, 0u, 1u) != 0u) return;
  volatile WaitTimeoutReport* r = report;
  if (r->timed_out == 0) {
    r->barrier_id = a.barrier_id;
    r->parity = a.parity;
    r->block = static_cast<int>(blockIdx.x);
    r->thread = a.thread;
    r->smem_address = a.smem_address;
    r->timeout_ns = timeout_ns;
    __threadfence_system();
    r->timed_out = 1;
    __threadfence_system();
  }
  atomicExch(lock, 0u);
}

struct TensorMaps {
  const CUtensorMap* a;
  const CUtensorMap* b;
  const CUtensorMap* a2;  // RowsW with a second product: its A
  const CUtensorMap* b2;  // gate/up: W_up; RowsW with a second product: its W
};

// Pairs (F::kCluster 2): this CTA's rank in its cluster, and whether the cluster's two tiles of
// this step use the same weight tile (then each CTA loads half `rank` of it and multicasts it).
// NOTES (pairs): both CTAs walk the same K blocks in the same stages, so stage s is in the same
// round in both. A Producer may write its peer's stage, so it waits until the consumers of both
// CTAs released the stage (empty), and then arrives on its peer's full barrier, even when it sends
// the peer no bytes: a consumer reaches round r + 1 of a stage only after both Producers saw round
// r released everywhere, so no arrival for round r + 1 lands on a barrier whose round r is still
// open.
struct PairLoad {
  bool shared_b = false;
  int rank = 0;
};

// A B tile box into this CTA's stage, or (pairs, `multicast`) into the same offsets of both CTAs.
template <class F>
__device__ __forceinline__ void tma_load_b(void* dst, const CUtensorMap* map, std::uint64_t* bar,
                                           int c0, int c1, bool multicast) {
  if constexpr (F::kCluster > 1) {
    if (multicast) {
      ptx::tma_load_2d_multicast(dst, map, bar, c0, c1, 0x3);
      return;
    }
  }
  ptx::tma_load_2d(dst, map, bar, c0, c1);
}

// Producer, M-grouped forms: half `h` of the kTileN x 64 B tile of K block `kb` (B rows or N
// chunks [h kTileN / 2, (h + 1) kTileN / 2)); the halves together give the same bytes as one box.
// `multicast` (pairs): into both CTAs of the cluster.
template <class F>
__device__ __forceinline__ void load_b_half(const TensorMaps& maps, const SharedRing<F>& ring,
                                            int s, const TileInfo& tile, int kb,
                                            const GemmParams& p, int h, bool multicast = false) {
  constexpr int kHalfChunks = F::kTileN / 2 / kSwizzleChunk;
  std::uint64_t* bar = ring.full(s);
  std::uint8_t* dst = ring.b(s) + h * (F::kTileBBytes / 2);
  const int k0 = kb * F::kBlockK;
  const int n0 = tile.n0 * F::kOutTileN;
  const int w_row = tile.group * p.b_rows_per_group;
  if constexpr (F::kind == FormKind::kGateUp) {
    // Half 0: W_gate's kTileN / 2 rows, half 1: W_up's, for the same output columns.
    tma_load_b<F>(dst, h == 0 ? maps.b : maps.b2, bar, k0, w_row + n0, multicast);
  } else if constexpr (F::kTransB) {
    // Two products share the accumulators: K blocks [0, k_blocks_first) of (a, W), then those of
    // (a2, W2).
    const bool second = p.k_blocks_first > 0 && kb >= p.k_blocks_first;
    const int kk0 = second ? k0 - p.k_blocks_first * F::kBlockK : k0;
    const CUtensorMap* map_b = second ? maps.b2 : maps.b;
#pragma unroll
    for (int c = 0; c < kHalfChunks; ++c) {
      ptx::tma_load_2d(dst + c * kChunkBytes, map_b, bar,
                       n0 + (kHalfChunks * h + c) * kSwizzleChunk, w_row + kk0);
    }
  } else if constexpr (F::kInputGradient) {  // e4m3 input gradients: W^T copies, K-major
    const bool second = p.k_blocks_first > 0 && kb >= p.k_blocks_first;
    const int kk0 = second ? k0 - p.k_blocks_first * F::kBlockK : k0;
    tma_load_b<F>(dst, second ? maps.b2 : maps.b, bar, kk0, w_row + n0 + h * (F::kTileN / 2),
                  multicast);
  } else {
    tma_load_b<F>(dst, maps.b, bar, k0, w_row + n0 + h * (F::kTileN / 2), multicast);
  }
}

// Consumer, tile queue: the ticket at queue position `tag` (kNoTile past the last tile); frees the
// slot (one arrival per warp, once all its lanes have read it). When the wait gives up (the CTA is
// aborting), the position is closed unless the Producer published it meanwhile; either way every
// consumer thread gets the same value (mainloop's header). NOTES: not inlined: inlined, its
// bounded wait loop made ptxas spill registers in the Consumers' epilogue (the consumer code is
// allocated within the 168-register entry cap). Called between tiles, with no wgmma in flight;
// the HGMMA pipelining (DEPBAR.LE gsb0, 0x1) is unchanged.
__device__ __noinline__ inline int take_queued_ticket(std::uint64_t* full, std::uint32_t parity,
                                                      unsigned long long* slot,
                                                      std::uint64_t* empty, int lane, unsigned tag,
                                                      CtaAbort* abort,
                                                      unsigned long long timeout_ns) {
  const ptx::WaitStatus s = ptx::mbarrier_wait(full, parity, timeout_ns, &abort->aborted);
  unsigned long long entry = *reinterpret_cast<volatile unsigned long long*>(slot);
  if (s != ptx::WaitStatus::complete) {
    if (s == ptx::WaitStatus::timed_out) abort->give_up(full, parity, kBarrierTileFull);
    const unsigned long long closed = queue_entry(tag, kNoTile);
    while (entry_tag(entry) != tag) {
      const unsigned long long was = atomicCAS(slot, entry, closed);
      entry = was == entry ? closed : was;
    }
  }
  __syncwarp();
  if (lane == 0) ptx::mbarrier_arrive(empty);
  return entry_ticket(entry);
}

// What mma_tile tells a probe (a megakernel's trace stamps): nothing, at no cost.
struct NoProbe {
  __device__ __forceinline__ void landed() const {}
  __device__ __forceinline__ void multiplied() const {}
};

// What mma_tile runs kEpilogueLeadBlocks K blocks before the end of the tile (the epilogue's
// early loads, engine.cuh), or after K block 0 (`first`: held rows): nothing, at no cost.
struct NoLead {
  __device__ __forceinline__ void operator()() const {}
};

// Producer: publishes `ticket` at queue position `tag`. False when the Consumers closed the
// position first (their wait for it gave up): the CTA is aborting.
__device__ __forceinline__ bool publish_ticket(unsigned long long* slot, unsigned tag, int ticket) {
  const unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(slot);
  return entry_tag(seen) != tag && atomicCAS(slot, seen, queue_entry(tag, ticket)) == seen;
}

// Producer: the TMA loads of one K block of one tile into stage `s`, with an e4m3 block's scales
// (`fp8`) after its tiles.
template <class F>
__device__ __forceinline__ void load_k_block(const TensorMaps& maps, const SharedRing<F>& ring,
                                             int s, const TileInfo& tile, int kb,
                                             const GemmParams& p, const Fp8Params* fp8,
                                             const PairLoad& pair = PairLoad{}) {
  std::uint64_t* bar = ring.full(s);
  const int k0 = kb * F::kBlockK;
  if constexpr (F::kKGrouped && F::kFp8) {
    ptx::mbarrier_arrive_expect_tx(bar, F::kStageBytes);
    // The token-axis copies: A [m, tokens] (rows m0..m0+127), B [n, tokens] in two halves of 64
    // rows, each box 128 tokens (one swizzled row) from the K block's first token; then the
    // block's scales (token block (row_base + k0) / 128, a multiple of 128: segments are aligned).
    const int token = tile.row_base + k0;
    const int n0 = tile.n0 * F::kOutTileN;
    ptx::tma_load_2d(ring.a(s), maps.a, bar, token, tile.m0);
    ptx::tma_load_2d(ring.b(s), maps.b, bar, token, n0);
    ptx::tma_load_2d(ring.b(s) + F::kTileBBytes / 2, maps.b, bar, token, n0 + F::kTileN / 2);
    const long long block = token / kTileM;
    ptx::bulk_load(ring.scales(s), fp8->a + block * fp8->a_ld + tile.m0, kTileM * 4, bar);
    ptx::bulk_load(ring.scales(s) + kTileM * 4, fp8->b + block * fp8->b_ld + n0, F::kTileN * 4,
                   bar);
  } else if constexpr (F::kKGrouped) {
    ptx::mbarrier_arrive_expect_tx(bar, F::kStageBytes);
    const int row = tile.row_base + k0;
    const int n0 = tile.n0 * F::kOutTileN;
#pragma unroll
    for (int c = 0; c < kTileM / kSwizzleChunk; ++c) {
      ptx::tma_load_2d(ring.a(s) + c * kChunkBytes, maps.a, bar, tile.m0 + c * kSwizzleChunk, row);
    }
#pragma unroll
    for (int c = 0; c < F::kTileN / kSwizzleChunk; ++c) {
      ptx::tma_load_2d(ring.b(s) + c * kChunkBytes, maps.b, bar, n0 + c * kSwizzleChunk, row);
    }
  } else {
    const bool second = F::kInputGradient && p.k_blocks_first > 0 && kb >= p.k_blocks_first;
    const int kk0 = second ? k0 - p.k_blocks_first * F::kBlockK : k0;
    if constexpr (F::kFp8) {
      // The block's scales: its rows' (1 x 128 along K; the rows of a tile's K block are
      // contiguous and start 16-byte aligned: launch.cu checks the scales' alignment and
      // scale_ld, and segments start on multiples of 128) by a bulk copy of the tile's rows
      // rounded up to 4, the rows past them left as they are (no epilogue stores such rows);
      // then the weight block's (gate/up: W_gate's and W_up's), 4 bytes each, by cp.async, which
      // arrives on the barrier once they landed.
      const int rows = min(kTileM, tile.row_count - tile.m0);
      const std::uint32_t row_bytes = static_cast<std::uint32_t>((rows + 3) / 4 * 16);
      ptx::mbarrier_arrive_expect_tx(bar, kTileABytes + F::kTileBBytes + row_bytes);
      const int kbb = second ? kb - p.k_blocks_first : kb;
      ptx::bulk_load(ring.scales(s),
                     (second ? fp8->a2 : fp8->a) + static_cast<long long>(kbb) * fp8->a_ld +
                         tile.row_base + tile.m0,
                     row_bytes, bar);
      // The tile's B rows lie in one 128-row block: gate/up tiles cover 64 output columns
      // (F::kOutTileN), the others 128; wide tiles (kWideTile) 128 of gate/up, else two blocks.
      const int n_block = tile.n0 * F::kOutTileN / 128;
      const long long w =
          (static_cast<long long>(tile.group) * fp8->b_n_blocks + n_block) * fp8->b_k_blocks + kbb;
      float* weight = reinterpret_cast<float*>(ring.scales(s) + kTileM * 4);
      const float* w_scales = second ? fp8->b2 : fp8->b;
      ptx::cp_async_4(weight, w_scales + w);
      if constexpr (F::kind == FormKind::kGateUp) {
        ptx::cp_async_4(weight + 1, fp8->b2 + w);
      } else if constexpr (F::kWideTile) {  // the next 128-column block, for the second half
        ptx::cp_async_4(weight + 1, w_scales + w + fp8->b_k_blocks);
      }
      ptx::cp_async_arrive_noinc(bar);
    } else {
      ptx::mbarrier_arrive_expect_tx(bar, F::kStageBytes);
    }
    ptx::tma_load_2d(ring.a(s), second ? maps.a2 : maps.a, bar, kk0, tile.row_base + tile.m0);
    if constexpr (F::kCluster > 1) {
      if (pair.shared_b) {  // the peer multicasts the other half
        load_b_half<F>(maps, ring, s, tile, kb, p, pair.rank, true);
        return;
      }
    }
    load_b_half<F>(maps, ring, s, tile, kb, p, 0);
    load_b_half<F>(maps, ring, s, tile, kb, p, 1);
  }
}

// What the Producer needs to know about its own loads at the end, in a kernel built with the
// stall hook (kStallHook: the test kernels of tests/cpp, never the library's): the stages whose
// latest arming the hook skipped (no loads in flight there), and whether the hook is still to
// fire.
struct ProducerLoads {
  std::uint32_t skipped = 0;
  bool stall = false;
};

// What load_tile tells a hook before each K block (a megakernel's Producer draws its next ticket
// there): nothing, at no cost.
struct NoLoadHook {
  __device__ __forceinline__ void operator()(int /*kb*/) const {}
};

// Producer: every K block of one tile, each into the next free stage of the ring; hook(kb) before
// each. False when the CTA gives up (then the caller stops issuing). kStallHook (tests only): the
// first K block of a CTA whose loads.stall is set is never loaded, so its Consumers wait until
// they give up.
template <class F, bool kStallHook, class Hook>
__device__ __forceinline__ bool load_tile(const TensorMaps& maps, const SharedRing<F>& ring,
                                          PipelineState<F::kStages>& state, const TileInfo& tile,
                                          const GemmParams& p, const Fp8Params* fp8,
                                          ProducerLoads& loads, Hook&& hook,
                                          const PairLoad& pair = PairLoad{}) {
  static_assert(!kStallHook || F::kCluster == 1, "the stall hook: unpaired kernels");
  for (int kb = 0; kb < tile.k_blocks; ++kb) {
    hook(kb);
    // NOTES: the flag too, after the wait: once the CTA aborted, the Consumers pass stages without
    // waiting for their data and still release them, so an empty phase they completed says
    // nothing of the stage's last loads, and arming it again could add a second arrival to a
    // full phase still in flight. Every such release comes after its thread saw the flag set (or
    // set it), so the flag read after acquiring the phase sees it too.
    if (!wait_barrier(ring, ring.empty(state.stage), state.phase ^ 1u, kBarrierEmpty, p) ||
        *static_cast<volatile int*>(&ring.abort()->aborted) != 0) {
      return false;
    }
    if constexpr (kStallHook) {
      const std::uint32_t bit = 1u << state.stage;
      if (loads.stall) {  // this stage's phase never completes
        loads.stall = false;
        loads.skipped |= bit;
        state.advance();
        continue;
      }
      loads.skipped &= ~bit;
    }
    if constexpr (F::kCluster > 1)
      ptx::mbarrier_arrive_cluster(ring.full(state.stage), pair.rank ^ 1);
    load_k_block<F>(maps, ring, state.stage, tile, kb, p, fp8, pair);
    state.advance();
  }
  return true;
}

// Producer, last: the latest loads into every stage have landed before the CTA may exit. NOTES:
// the Consumers normally wait for all of them anyway (then this costs a probe per stage); after
// an abort they stop waiting, and a CTA must not exit while the copy engine still writes its
// shared memory and completes transactions on its barriers. Stage s was last armed in the
// current round if s < state.stage, else in the round before (a fresh barrier passes that wait).
template <class F, bool kStallHook>
__device__ __forceinline__ void drain_loads(const SharedRing<F>& ring,
                                            const PipelineState<F::kStages>& state,
                                            const ProducerLoads& loads, const GemmParams& p) {
  for (int s = 0; s < F::kStages; ++s) {
    if (kStallHook && ((loads.skipped >> s) & 1u)) continue;
    const std::uint32_t parity = s < state.stage ? state.phase : state.phase ^ 1u;
    (void)wait_barrier(ring, ring.full(s), parity, kBarrierFull, p, false);
  }
}

// K-grouped forms: rows of the last K block past the group's end may hold anything (padding,
// the next group); zero them in both operands so they contribute exactly nothing. Every consumer
// thread (both warpgroups read the stage) takes part; ends with their named barrier.
template <class F>
__device__ __forceinline__ void zero_tail_rows(const SharedRing<F>& ring, int s, int valid_rows,
                                               int reader_thread, int barrier_id) {
  constexpr int kThreadsReading = F::kReaders * 32;
  const int rows = kTileK - valid_rows;
  const int per_chunk = rows * 8;  // 16-byte pieces
  constexpr int kChunks = (kTileM + F::kTileN) / kSwizzleChunk;
  for (int i = reader_thread; i < kChunks * per_chunk; i += kThreadsReading) {
    const int chunk = i / per_chunk;
    const int rem = i - chunk * per_chunk;
    std::uint8_t* base = chunk < kTileM / kSwizzleChunk
                             ? ring.a(s) + chunk * kChunkBytes
                             : ring.b(s) + (chunk - kTileM / kSwizzleChunk) * kChunkBytes;
    // NOTES: the 128-byte swizzle permutes 16-byte pieces within a 128-byte row, so clearing
    // whole rows clears exactly the logical rows k >= valid_rows.
    *reinterpret_cast<uint4*>(base + (valid_rows + rem / 8) * 128 + (rem % 8) * 16) =
        make_uint4(0, 0, 0, 0);
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(barrier_id, kThreadsReading);
}

// Consumer: the 4 wgmma k16 steps of one K block, this warpgroup's 64 rows x 256.
template <class F>
__device__ __forceinline__ void mma_k_block(float (&acc)[F::kAcc], const SharedRing<F>& ring, int s,
                                            int consumer_wg) {
  const std::uint32_t a_base = ptx::smem_addr(ring.a(s)) + consumer_wg * (kTileABytes / 2);
  const std::uint32_t b_base = ptx::smem_addr(ring.b(s));
  // K-major operands step 16 elements (32 bytes) along a swizzled row; M/N-major operands step 16
  // rows of 128 bytes. The warpgroups' 64-row halves of A are 8 KiB apart either way (64 rows of
  // 128 bytes, or one 64-wide M chunk).
  constexpr std::uint32_t kStepA = F::kTransA ? 16 * 128 : 32;
  constexpr std::uint32_t kStepB = F::kTransB ? 16 * 128 : 32;
  constexpr std::uint32_t kLboA = F::kTransA ? kChunkBytes : 16;
  constexpr std::uint32_t kLboB = F::kTransB ? kChunkBytes : 16;
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTileK / 16; ++kk) {
    const std::uint64_t db = ptx::make_smem_desc_sw128(b_base + kk * kStepB, kLboB, 1024);
    const std::uint64_t da = ptx::make_smem_desc_sw128(a_base + kk * kStepA, kLboA, 1024);
    ptx::wgmma_m64n256k16_bf16<F::kTransA, F::kTransB>(acc, da, db, 1);
  }
  ptx::wgmma_commit_group();
}

// Consumer: the whole K loop of one tile into `acc` (already zeroed or seeded). NOTES: one wgmma
// group stays in flight: block kb is issued before block kb-1 is waited for, and stage kb-1 is
// released only then, so the tensor cores never wait for the issue. A wait that gives up is passed
// (the data is void once the CTA aborts): every thread of the warpgroup goes through the same wgmma
// and named barriers whatever its waits returned. `probe` (NoProbe but in a megakernel's trace):
// landed() once the first K block is in shared memory, multiplied() once the last wgmma is done.
// `lead` (NoLead unless the epilogue reads rows) runs once, after the wgmma of K block max(0,
// k_blocks - kEpilogueLeadBlocks) is issued. `first` (NoLead unless the consumer holds the previous
// tile's rows: HeldRows, epilogue.cuh) runs once, after the wgmma of K block 0 is issued (before
// the loop when there is none), while the tensor cores work. NOTES: K block 0 is then peeled off
// the loop, so that what `first` reads is dead in the loop's registers.
template <class F, class Probe, class Lead = NoLead, class First = NoLead>
__device__ __forceinline__ void mma_tile(float (&acc)[F::kAcc], const SharedRing<F>& ring,
                                         PipelineState<F::kStages>& state, const TileInfo& tile,
                                         const GemmParams& p, int consumer_wg, int lane,
                                         int reader_thread, const Probe& probe,
                                         const Lead& lead = Lead{}, const First& first = First{}) {
  const int lead_block =
      tile.k_blocks > kEpilogueLeadBlocks ? tile.k_blocks - kEpilogueLeadBlocks : 0;
  int previous_stage = -1;
  constexpr bool kFirst = !std::is_same_v<First, NoLead>;
  if constexpr (kFirst) {
    static_assert(!F::kKGrouped, "held rows: M-grouped tiles");
    if (tile.k_blocks > 0) {
      (void)wait_barrier(ring, ring.full(state.stage), state.phase, kBarrierFull, p);
      probe.landed();
      mma_k_block<F>(acc, ring, state.stage, consumer_wg);
      if (lead_block == 0) lead();
      previous_stage = state.stage;
      state.advance();
    }
    first();
  }
  for (int kb = kFirst ? 1 : 0; kb < tile.k_blocks; ++kb) {
    (void)wait_barrier(ring, ring.full(state.stage), state.phase, kBarrierFull, p);
    if (kb == 0) probe.landed();
    if constexpr (F::kKGrouped) {
      const int valid = tile.row_count - kb * kTileK;
      if (valid < kTileK) {
        zero_tail_rows(ring, state.stage, valid, reader_thread, kConsumerBarrierId);
      }
    }
    mma_k_block<F>(acc, ring, state.stage, consumer_wg);
    if (kb == lead_block) lead();
    ptx::wgmma_wait_group<1>();
    if (previous_stage >= 0 && lane == 0) ptx::mbarrier_arrive(ring.empty(previous_stage));
    previous_stage = state.stage;
    state.advance();
  }
  ptx::wgmma_wait_group<0>();
  ptx::fence_registers(acc);
  probe.multiplied();
  if (previous_stage >= 0 && lane == 0) ptx::mbarrier_arrive(ring.empty(previous_stage));
}

// Consumer, e4m3 forms: the 4 wgmma k32 steps of one K block (128 elements, one scale block) into
// `partial`, which the first step overwrites (scale-d 0) and the others add to: m64n128 over the
// B tile's first 128 rows, or (b_half 1, wide tiles only) its second 128.
template <class F>
__device__ __forceinline__ void mma_k_block_fp8(float (&partial)[64], const SharedRing<F>& ring,
                                                int s, int consumer_wg, int b_half = 0) {
  static_assert(F::kFp8 && !F::kTransA && !F::kTransB, "e4m3: both operands K-major");
  const std::uint32_t a_base = ptx::smem_addr(ring.a(s)) + consumer_wg * (kTileABytes / 2);
  const std::uint32_t b_base = ptx::smem_addr(ring.b(s)) + b_half * (F::kTileBBytes / 2);
  // A k32 step is 32 bytes along the 128-byte swizzled rows of both operands.
  const std::uint64_t da = ptx::make_smem_desc_sw128(a_base, 16, 1024);
  const std::uint64_t db = ptx::make_smem_desc_sw128(b_base, 16, 1024);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < F::kBlockK / 32; ++kk) {
    ptx::wgmma_m64n128k32_e4m3(partial, ptx::smem_desc_advance(da, kk * 32),
                               ptx::smem_desc_advance(db, kk * 32), kk == 0 ? 0 : 1);
  }
  ptx::wgmma_commit_group();
}

// An e4m3 K block's scales as a consumer thread uses them: its two rows' (1 x 128 along K) and
// the weight block's (gate/up: W_gate's, W_up's), read from the block's stage (load_k_block).
struct Fp8BlockScales {
  float row[2];
  float2 weight;
};

template <class F>
__device__ __forceinline__ Fp8BlockScales read_block_scales(const SharedRing<F>& ring, int s,
                                                            int row) {
  const float* scales = reinterpret_cast<const float*>(ring.scales(s));
  return {{scales[row], scales[row + 8]}, *reinterpret_cast<const float2*>(scales + kTileM)};
}

// Consumer: stage `s` released once its wgmma are done and its scales are read (pairs: in both
// CTAs of the cluster, whose Producers may both write it). Every consumer thread arrives, so that
// each thread's arrival releases its own reads of the stage. NOTES (2026-12-06, 31e4b5f):
// racecheck orders neither another lane's arrival after __syncwarp nor one after a warpgroup
// named barrier (it reported the other lanes' reads against the stage's next bulk copy).
template <class F>
__device__ __forceinline__ void release_stage_fp8(const SharedRing<F>& ring, int s,
                                                  std::uint32_t peer) {
  ptx::mbarrier_arrive(ring.empty(s));
  if constexpr (F::kCluster > 1) ptx::mbarrier_arrive_cluster(ring.empty(s), peer);
}

// The CTA's peer in its cluster (pairs; 0, unused, otherwise).
template <class F>
__device__ __forceinline__ std::uint32_t pair_peer() {
  return F::kCluster > 1 ? ptx::cluster_ctarank() ^ 1u : 0u;
}

// Consumer: the promotion of one K block, acc = fma(partial, row scale x weight scale, acc).
template <class F>
__device__ __forceinline__ void promote_fp8(float (&acc)[F::kAcc], const float (&partial)[F::kAcc],
                                            const Fp8BlockScales& s) {
  constexpr bool kTwoWeights = F::kind == FormKind::kGateUp;
  const float factor[2][2] = {
      {__fmul_rn(s.row[0], s.weight.x), __fmul_rn(s.row[0], kTwoWeights ? s.weight.y : s.weight.x)},
      {__fmul_rn(s.row[1], s.weight.x),
       __fmul_rn(s.row[1], kTwoWeights ? s.weight.y : s.weight.x)}};
#pragma unroll
  for (int i = 0; i < F::kAcc; ++i) {
    // Accumulator i: row half (i / 2) % 2, column 8 (i / 4) + ..., in the second half of the
    // tile's columns from i = kAcc / 2 on.
    acc[i] = __fmaf_rn(partial[i], factor[(i / 2) % 2][i >= F::kAcc / 2 ? 1 : 0], acc[i]);
  }
}

// Consumer, e4m3 M-grouped forms: the whole K loop of one tile. Per K block: its product into
// `partial` (4 wgmma k32 steps), then acc = fma(partial, row scale x weight scale, acc) in a fixed
// order (the promotion, once every 128 of K: DeepGEMM's two-level accumulation). The block's
// scales come with it in its stage (load_k_block) and are read while its wgmma run; the stage is
// released once they are done, before the promotion. NOTES: the loop is what keeps the tensor
// pipe fed, two warps per SM sub-partition issuing it: with 128-wide tiles a K block's wgmma take
// half the time of the bf16 forms', so every instruction here counts (ncu, 2026-12-05: the scales
// loaded by each thread, with their address arithmetic, made 240 instructions a block and kept
// the pipe 44% busy). A wait that gives up is passed, as in mma_tile (the outputs are then void).
// `lead` as in mma_tile: once, after the wgmma of K block max(0, k_blocks - kEpilogueLeadBlocks)
// is issued.
template <class F, class Probe, class Lead = NoLead>
__device__ __forceinline__ void mma_tile_fp8(float (&acc)[F::kAcc], const SharedRing<F>& ring,
                                             PipelineState<F::kStages>& state, const TileInfo& tile,
                                             const GemmParams& p, int consumer_wg, int warp,
                                             int lane, const Probe& probe,
                                             const Lead& lead = Lead{}) {
  static_assert(F::kFp8 && !F::kKGrouped, "the M-grouped e4m3 forms");
  const std::uint32_t peer = pair_peer<F>();
  const int row = consumer_wg * 64 + warp * 16 + lane / 4;  // this thread's rows: row, row + 8
  const int lead_block =
      tile.k_blocks > kEpilogueLeadBlocks ? tile.k_blocks - kEpilogueLeadBlocks : 0;
  float partial[F::kAcc];
  for (int kb = 0; kb < tile.k_blocks; ++kb) {
    (void)wait_barrier(ring, ring.full(state.stage), state.phase, kBarrierFull, p);
    if (kb == 0) probe.landed();
    mma_k_block_fp8<F>(partial, ring, state.stage, consumer_wg);
    if (kb == lead_block) lead();
    const Fp8BlockScales scales = read_block_scales<F>(ring, state.stage, row);
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(partial);
    release_stage_fp8<F>(ring, state.stage, peer);
    state.advance();
    promote_fp8<F>(acc, partial, scales);
  }
  ptx::fence_registers(acc);
  probe.multiplied();
}

// Consumer, wide e4m3 tiles (kWideTile): the promotion of half kHalf of a K block, the tile's
// columns [128 kHalf, 128 kHalf + 128) (accumulators [64 kHalf, 64 kHalf + 64)), whose weight
// block scale is weight.x (half 0) or weight.y (half 1). The same products and the same fma as
// promote_fp8 gives each element in a 128-wide tile.
template <class F, int kHalf>
__device__ __forceinline__ void promote_fp8_half(float (&acc)[F::kAcc], const float (&partial)[64],
                                                 const Fp8BlockScales& s) {
  static_assert(F::kWideTile && F::kAcc == 128, "wide e4m3 tiles");
  const float weight = kHalf == 0 ? s.weight.x : s.weight.y;
  const float factor[2] = {__fmul_rn(s.row[0], weight), __fmul_rn(s.row[1], weight)};
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    acc[64 * kHalf + i] = __fmaf_rn(partial[i], factor[(i / 2) % 2], acc[64 * kHalf + i]);
  }
}

// Consumer, wide e4m3 tiles (kWideTile): mma_tile_fp8 over a 128 x 256 tile. Per K block, each half
// of the B tile in turn: its 4 wgmma k32 steps into `partial`, waited for, promoted into its half
// of the accumulators; the stage is released once the second half's wgmma are done. One partial
// set (64 fp32) for both halves: 192 accumulators a thread with the tile's 128.
template <class F, class Probe, class Lead = NoLead>
__device__ __forceinline__ void mma_tile_fp8_wide(float (&acc)[F::kAcc], const SharedRing<F>& ring,
                                                  PipelineState<F::kStages>& state,
                                                  const TileInfo& tile, const GemmParams& p,
                                                  int consumer_wg, int warp, int lane,
                                                  const Probe& probe, const Lead& lead = Lead{}) {
  static_assert(F::kWideTile && !F::kKGrouped && F::kCluster == 1, "wide e4m3 tiles");
  const int row = consumer_wg * 64 + warp * 16 + lane / 4;  // this thread's rows: row, row + 8
  const int lead_block =
      tile.k_blocks > kEpilogueLeadBlocks ? tile.k_blocks - kEpilogueLeadBlocks : 0;
  float partial[64];
  for (int kb = 0; kb < tile.k_blocks; ++kb) {
    (void)wait_barrier(ring, ring.full(state.stage), state.phase, kBarrierFull, p);
    if (kb == 0) probe.landed();
    mma_k_block_fp8<F>(partial, ring, state.stage, consumer_wg, 0);
    if (kb == lead_block) lead();
    const Fp8BlockScales scales = read_block_scales<F>(ring, state.stage, row);
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(partial);
    promote_fp8_half<F, 0>(acc, partial, scales);
    mma_k_block_fp8<F>(partial, ring, state.stage, consumer_wg, 1);
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(partial);
    release_stage_fp8<F>(ring, state.stage, 0u);
    state.advance();
    promote_fp8_half<F, 1>(acc, partial, scales);
  }
  ptx::fence_registers(acc);
  probe.multiplied();
}

// The order of an overlapped K loop (the Form's kOverlap): issue(j, kb) puts K block kb's wgmma in
// flight into partial set j (an std::integral_constant, 0 or 1: kb % 2); finish(j), once that
// block's group is complete, releases its stage and promotes its product. Each step issues block
// kb + 1 before it finishes block kb, so that one group stays in flight while a block is promoted;
// at the top of the loop K block kb's wgmma are the one group pending. No branch between an issue
// and its wait inside the loop, so that ptxas sees which group each wgmma_wait_group<1> completes
// (NOTES: a loop that chose the wait's count per block had its wgmma serialized, C7514).
template <class Issue, class Finish>
__device__ __forceinline__ void overlapped_k_loop(int k_blocks, const Issue& issue,
                                                  const Finish& finish) {
  constexpr std::integral_constant<int, 0> kFirst;
  constexpr std::integral_constant<int, 1> kSecond;
  if (k_blocks <= 0) return;  // an empty group's weight-gradient tile: no K block to wait for
  issue(kFirst, 0);
  int kb = 0;
  for (; kb + 2 < k_blocks; kb += 2) {
    issue(kSecond, kb + 1);
    ptx::wgmma_wait_group<1>();
    finish(kFirst);
    issue(kFirst, kb + 2);
    ptx::wgmma_wait_group<1>();
    finish(kSecond);
  }
  if (kb + 1 < k_blocks) {  // two blocks left
    issue(kSecond, kb + 1);
    ptx::wgmma_wait_group<1>();
    finish(kFirst);
    ptx::wgmma_wait_group<0>();
    finish(kSecond);
  } else {
    ptx::wgmma_wait_group<0>();
    finish(kFirst);
  }
}

// Consumer, e4m3 M-grouped forms, overlapped (the Form's kOverlap, the launchers' `overlap`): the
// same arithmetic in the same order as mma_tile_fp8, with K block kb + 1's wgmma issued before K
// block kb's promotion, into a second partial set, so that a warpgroup leaves work in the tensor
// pipe while it promotes (FlashAttention-3's intra-warpgroup overlap). NOTES ("642f5ff", H200):
// 0.88-1.00x the plain loop on every M-grouped form: with the pipe fed through the promotion the
// consumers wait for their stages instead, so it stays off. Three sets of kAcc fp32 a thread: 192
// at kTileN 128 (ptxas: no spills, no serialized wgmma).
template <class F, class Probe, class Lead = NoLead>
__device__ __forceinline__ void mma_tile_fp8_overlap(
    float (&acc)[F::kAcc], const SharedRing<F>& ring, PipelineState<F::kStages>& state,
    const TileInfo& tile, const GemmParams& p, int consumer_wg, int warp, int lane,
    const Probe& probe, const Lead& lead = Lead{}) {
  static_assert(F::kFp8 && !F::kKGrouped, "the M-grouped e4m3 forms");
  const std::uint32_t peer = pair_peer<F>();
  const int row = consumer_wg * 64 + warp * 16 + lane / 4;  // this thread's rows: row, row + 8
  const int lead_block =
      tile.k_blocks > kEpilogueLeadBlocks ? tile.k_blocks - kEpilogueLeadBlocks : 0;
  float partial[2][F::kAcc];  // K block kb's product in partial[kb % 2]
  Fp8BlockScales scales[2];
  int stage[2];
  // Issues K block kb's wgmma into partial[j] and reads its scales.
  const auto issue = [&](auto j, int kb) {
    constexpr int J = decltype(j)::value;
    (void)wait_barrier(ring, ring.full(state.stage), state.phase, kBarrierFull, p);
    if (kb == 0) probe.landed();
    mma_k_block_fp8<F>(partial[J], ring, state.stage, consumer_wg);
    if (kb == lead_block) lead();
    scales[J] = read_block_scales<F>(ring, state.stage, row);
    stage[J] = state.stage;
    state.advance();
  };
  // K block kb, in partial[j] and waited for (wgmma_wait_group): its product promoted, then its
  // stage released (release_stage_fp8). NOTES (2026-12-06): the fence keeps the promotion ahead of
  // the release in the compiler's order (mma_tile_fp8_tokens_overlap).
  const auto finish = [&](auto j) {
    constexpr int J = decltype(j)::value;
    ptx::fence_registers(partial[J]);
    promote_fp8<F>(acc, partial[J], scales[J]);
    ptx::fence_registers(acc);
    release_stage_fp8<F>(ring, stage[J], peer);
  };
  overlapped_k_loop(tile.k_blocks, issue, finish);
  ptx::fence_registers(acc);
  probe.multiplied();
}

// K-grouped e4m3: tokens of the last K block past the group's end may hold anything (padding, the
// next group); zero bytes [valid, 128) of every row of both tiles, so they contribute exactly
// nothing. The tiles are K-major (a row is 128 tokens), and the 128-byte swizzle puts logical
// 16-byte piece c of row r at piece c ^ (r % 8). Every consumer thread takes part; ends with
// their named barrier.
template <class F>
__device__ __forceinline__ void zero_tail_tokens(const SharedRing<F>& ring, int s, int valid,
                                                 int reader_thread, int barrier_id) {
  constexpr int kThreadsReading = F::kReaders * 32;
  constexpr int kRows = kTileM + F::kTileN;  // A's rows, then B's (b(s) follows a(s))
  const int first = valid / 16;
  const int pieces = 8 - first;
  for (int i = reader_thread; i < kRows * pieces; i += kThreadsReading) {
    const int r = i / pieces;
    const int c = first + i % pieces;
    std::uint8_t* piece = ring.a(s) + r * 128 + ((c ^ (r % 8)) * 16);
    if (c * 16 >= valid) {
      *reinterpret_cast<uint4*>(piece) = make_uint4(0, 0, 0, 0);
    } else {
      for (int b = valid - c * 16; b < 16; ++b) piece[b] = 0;
    }
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(barrier_id, kThreadsReading);
}

// A K-grouped e4m3 token block's scales as a consumer thread uses them: its two rows' and the
// 2 x 16 columns' its accumulators hold, read from the block's stage.
template <class F>
struct TokenBlockScales {
  float row[2];
  float2 col[F::kTileN / 8];
};

template <class F>
__device__ __forceinline__ TokenBlockScales<F> read_token_block_scales(const SharedRing<F>& ring,
                                                                       int s, int consumer_wg,
                                                                       int warp, int lane) {
  const float* scales = reinterpret_cast<const float*>(ring.scales(s));
  TokenBlockScales<F> t;
#pragma unroll
  for (int h = 0; h < 2; ++h) t.row[h] = scales[consumer_wg * 64 + warp * 16 + lane / 4 + 8 * h];
#pragma unroll
  for (int j = 0; j < F::kTileN / 8; ++j) {
    t.col[j] = *reinterpret_cast<const float2*>(scales + kTileM + 8 * j + 2 * (lane % 4));
  }
  return t;
}

// The 1D1D promotion of one token block: acc += partial x (row scale x column scale).
template <class F>
__device__ __forceinline__ void promote_tokens(float (&acc)[F::kAcc],
                                               const float (&partial)[F::kAcc],
                                               const TokenBlockScales<F>& t) {
#pragma unroll
  for (int j = 0; j < F::kTileN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int a = 4 * j + 2 * h;
      acc[a] = __fmaf_rn(partial[a], __fmul_rn(t.row[h], t.col[j].x), acc[a]);
      acc[a + 1] = __fmaf_rn(partial[a + 1], __fmul_rn(t.row[h], t.col[j].y), acc[a + 1]);
    }
  }
}

// Consumer, the K-grouped e4m3 form (weight gradients): the whole K loop of one tile over the
// group's tokens. Per K block (128 tokens): its product into `partial`, then each accumulator
// adds partial times (its row's scale x its column's scale), both from the stage, in token
// order (DeepGEMM's "1D1D" promotion: one FMUL and one FFMA per accumulator). The scales are
// read while the block's wgmma run, and the stage is released once they are done, before the
// promotion (NOTES: read after the wgmma wait, their shared-memory latency added to every block).
template <class F, class Probe>
__device__ __forceinline__ void mma_tile_fp8_tokens(float (&acc)[F::kAcc],
                                                    const SharedRing<F>& ring,
                                                    PipelineState<F::kStages>& state,
                                                    const TileInfo& tile, const GemmParams& p,
                                                    int consumer_wg, int warp, int lane,
                                                    int reader_thread, const Probe& probe) {
  static_assert(F::kFp8 && F::kKGrouped, "the K-grouped e4m3 form");
  float partial[F::kAcc];
  for (int kb = 0; kb < tile.k_blocks; ++kb) {
    (void)wait_barrier(ring, ring.full(state.stage), state.phase, kBarrierFull, p);
    if (kb == 0) probe.landed();
    const int valid = tile.row_count - kb * F::kBlockK;
    if (valid < F::kBlockK) {
      zero_tail_tokens(ring, state.stage, valid, reader_thread, kConsumerBarrierId);
    }
    mma_k_block_fp8<F>(partial, ring, state.stage, consumer_wg);
    // The block's scales, read while its wgmma run.
    const TokenBlockScales<F> scales =
        read_token_block_scales<F>(ring, state.stage, consumer_wg, warp, lane);
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(partial);
    release_stage_fp8<F>(ring, state.stage, 0u);
    state.advance();
    promote_tokens<F>(acc, partial, scales);
  }
  ptx::fence_registers(acc);
  probe.multiplied();
}

// Consumer, the K-grouped e4m3 form overlapped (the Form's kOverlap): mma_tile_fp8_tokens'
// arithmetic in its order, with K block kb + 1's wgmma issued before K block kb is promoted (as
// mma_tile_fp8_overlap). Only block kb's scales are held at a time: they are read from its stage
// after the next block is issued, so the 34 scales a thread fit beside the three accumulator sets;
// the stage is released once the block is promoted. NOTES (2026-12-06): with the release by every
// thread and the promotion below it (31e4b5f's order, or the compiler's without the fence), the
// block's scales stayed live across the next block's wait and ptxas spilled 104-204 bytes in these
// kernels (31e4b5f's overlapped weight gradient ran 8-12% slower than d374d84's on an H200); with
// the fence, none.
template <class F, class Probe>
__device__ __forceinline__ void mma_tile_fp8_tokens_overlap(
    float (&acc)[F::kAcc], const SharedRing<F>& ring, PipelineState<F::kStages>& state,
    const TileInfo& tile, const GemmParams& p, int consumer_wg, int warp, int lane,
    int reader_thread, const Probe& probe) {
  static_assert(F::kFp8 && F::kKGrouped, "the K-grouped e4m3 form");
  float partial[2][F::kAcc];  // K block kb's product in partial[kb % 2]
  int stage[2];
  const auto issue = [&](auto j, int kb) {
    constexpr int J = decltype(j)::value;
    (void)wait_barrier(ring, ring.full(state.stage), state.phase, kBarrierFull, p);
    if (kb == 0) probe.landed();
    const int valid = tile.row_count - kb * F::kBlockK;
    if (valid < F::kBlockK) {
      zero_tail_tokens(ring, state.stage, valid, reader_thread, kConsumerBarrierId);
    }
    mma_k_block_fp8<F>(partial[J], ring, state.stage, consumer_wg);
    stage[J] = state.stage;
    state.advance();
  };
  const auto finish = [&](auto j) {
    constexpr int J = decltype(j)::value;
    ptx::fence_registers(partial[J]);
    const TokenBlockScales<F> scales =
        read_token_block_scales<F>(ring, stage[J], consumer_wg, warp, lane);
    promote_tokens<F>(acc, partial[J], scales);
    ptx::fence_registers(acc);
    release_stage_fp8<F>(ring, stage[J], 0u);
  };
  overlapped_k_loop(tile.k_blocks, issue, finish);
  ptx::fence_registers(acc);
  probe.multiplied();
}

}  // namespace mok::gemm
