"""mok.ops.schedule_table (the schedule's host twin on CPU tensors) against a direct derivation
of DESIGN.md section 2's canonical order: expert-major, then source rank, then t, then j; every
expert segment padded with -1 rows to the 128-row tile."""

import pytest
import torch

import mok.ops
from conftest import SEED

ALIGN = 128


def derive(ids_per_rank, num_experts, rank):
    W = len(ids_per_rank)
    T, k = ids_per_rank[0].shape
    E_local = num_experts // W
    table, counts, src_counts, starts = [], [], [], [0]
    for e in range(rank * E_local, (rank + 1) * E_local):
        rows = []
        per_src = []
        for src in range(W):
            ids = ids_per_rank[src].tolist()
            before = len(rows)
            for t in range(T):
                for j in range(k):
                    if ids[t][j] == e:
                        rows.append(src * T * k + t * k + j)
            per_src.append(len(rows) - before)
        counts.append(len(rows))
        src_counts.append(per_src)
        rows += [-1] * (-len(rows) % ALIGN)
        table += rows
        starts.append(starts[-1] + len(rows))
    return table, counts, src_counts, starts


def routing(gen, T, k, E, kind):
    if kind == "one_expert":
        return torch.zeros(T, k, dtype=torch.int64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if kind == "unused":
        ids[torch.rand(T, k, generator=gen) < 0.3] = -1
    if kind == "repeated":
        ids[:, 0] = ids[:, -1]
    return ids


@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("kind", ["uniform", "one_expert", "unused", "repeated"])
def test_host_twin_matches_the_canonical_order(W, kind):
    gen = torch.Generator().manual_seed(SEED + W)
    T, k, E = 37, 3, 6 * W
    ids = [routing(gen, T, k, E, kind) for _ in range(W)]
    for rank in range(W):
        table, counts, src_counts, starts, plan = mok.ops.schedule_table(ids, E, rank, 128, 256)
        want_table, want_counts, want_src, want_starts = derive(ids, E, rank)
        total = want_starts[-1]
        assert table[:total].tolist() == want_table
        assert (table[total:] == -1).all(), "rows past the total must be padding"
        assert counts.tolist() == want_counts
        assert src_counts.tolist() == want_src
        assert starts.tolist() == want_starts
        assert plan[0].item() == total  # ring_plan.total_rows
        assert plan[1].item() == (total + 255) // 256  # passes of 256 rows


def test_bad_id_names_rank_token_and_slot():
    ids = [torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int64)]
    ids[1][2, 1] = 9
    with pytest.raises(ValueError, match=r"topk_experts\[2, 1\] of rank 1.*got 9"):
        mok.ops.schedule_table(ids, 4, 0, 128, 256)

