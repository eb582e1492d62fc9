"""mok's schedule table in MoK's terms: peer_rank, peer_token_idx, num_tokens, tokens_per_expert.

MoK's schedule (`mok.functional.MoKSchedule`, the `mok::schedule` op) describes, for each row a
rank computes, the rank the row came from (`peer_rank`) and its slot there (`peer_token_idx` =
t * k + j), expert-major, each expert's segment padded at its end (`tokens_per_expert` = padded
segment lengths, `num_tokens` = their sum). mok's table (include/mok/schedule.hpp, src/core/
schedule_layout.hpp) holds the same rows; where it differs from MoK:

  order    within an expert: source rank, then t, then j (MoK interleaves the source ranks: the
           first row of each rank, then the second of each, ...); at one rank the two agree
  padding  every segment is padded to mok's GEMM tile, 128 rows (MoK: 256)
  length   at least the worst case, W * T * k + E_local * 127 rows, so no routing can overflow it
           (MoK: the given schedule_capacity, and a device trap when the rows do not fit)
  padding rows  peer_rank = peer_token_idx = -1 (MoK leaves peer_token_idx unspecified there)

Built with fixed-size tensor operations on the ids' device (a stable sort, scatters): no host
synchronization, deterministic. The host twin (`mok.ops.schedule_table`) is its oracle in the tests.
"""

import torch

SEGMENT_ALIGNMENT = 128  # src/core/schedule_layout.hpp: kExpertSegmentAlignment


def capacity_rows(ep_size, num_local_tokens, topk, num_local_experts):
    """Rows of mok's table: every routed row of every rank, plus a partial tile per expert."""
    return ep_size * num_local_tokens * topk + num_local_experts * (SEGMENT_ALIGNMENT - 1)


def terms(topk_all, num_local_experts, rank, rows):
    """(peer_rank [rows], peer_token_idx [rows], num_tokens [1], tokens_per_expert [E_local],
    rows_per_expert [E_local]), all int32, for rank `rank` from every rank's ids `topk_all`
    [W, T, k] (int32 or int64). `rows` >= capacity_rows(...). Ids outside this rank's experts
    (other ranks' experts, -1) are not scheduled here; ids outside [-1, E) are the caller's to
    reject (build_schedule does)."""
    W, T, k = topk_all.shape
    device = topk_all.device
    slots = T * k
    flat = topk_all.reshape(-1).to(torch.int64)  # position = src * T * k + t * k + j
    local = flat - rank * num_local_experts
    mine = (flat >= 0) & (local >= 0) & (local < num_local_experts)
    key = torch.where(mine, local, torch.full_like(local, num_local_experts))
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + SEGMENT_ALIGNMENT - 1) // SEGMENT_ALIGNMENT * SEGMENT_ALIGNMENT
    padded[num_local_experts:].zero_()  # the unscheduled key holds no rows (a kernel, no sync)
    segment_start = torch.cumsum(padded, 0) - padded  # exclusive
    first_of_key = torch.cumsum(counts, 0) - counts  # where each key starts in the sorted order
    # NOTES: a stable sort keeps the positions of one expert in increasing src, t, j: mok's order.
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    within = torch.arange(order.numel(), device=device) - first_of_key[sorted_key]
    dump = rows  # one extra row that takes every slot not scheduled here, then is cut off
    dest = torch.where(sorted_key < num_local_experts, segment_start[sorted_key] + within,
                       torch.full_like(within, dump))
    peer_rank = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
    peer_token_idx = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
    peer_rank.scatter_(0, dest, (order // slots).to(torch.int32))
    peer_token_idx.scatter_(0, dest, (order % slots).to(torch.int32))
    tokens_per_expert = padded[:num_local_experts].to(torch.int32)
    num_tokens = tokens_per_expert.sum().reshape(1).to(torch.int32)
    return (peer_rank[:rows], peer_token_idx[:rows], num_tokens, tokens_per_expert,
            counts[:num_local_experts].to(torch.int32))
