"""The benchmarks' own logic, on the CPU: what bench/bench_layer.py's mok implementations hand to
mok (no layer runs here; mok.functional's entry points are replaced by recorders)."""
import os
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_layer as bl  # noqa: E402


@pytest.mark.parametrize("path", ["unfused", "fused"])
def test_mok_impl_makes_every_call_under_its_forward_path(monkeypatch, path):
    # The C++ layer reads MOK_FORWARD when mok.functional makes it, at the workspace's first
    # forward or backward call, so every call must see the implementation's path (until session
    # 11 only get_workspace did, and bench_layer's "fused" rows ran the launches).
    import mok.functional as mf

    seen = []

    def record(name, result=None):
        def call(*args, **kwargs):
            seen.append((name, os.environ.get("MOK_FORWARD")))
            return result
        return call

    monkeypatch.setattr(mf, "get_workspace", record("get_workspace", "workspace"))
    monkeypatch.setattr(mf, "build_schedule", record("build_schedule", "schedule"))
    monkeypatch.setattr(mf, "forward", record("forward", ("out", "ctx")))
    monkeypatch.setattr(mf, "backward", record("backward"))
    monkeypatch.setenv("MOK_FORWARD", "something else")
    T, H, I, E, k = 4, 8, 16, 3, 2
    inp = {"x": torch.zeros(T, H), "ids": torch.zeros(T, k, dtype=torch.int64),
           "w": torch.zeros(T, k), "w_gate": torch.zeros(E, I, H), "w_up": torch.zeros(E, I, H),
           "w_down": torch.zeros(E, H, I), "shared": None, "d_out": torch.zeros(T, H)}
    impl = bl.MokImpl(path=path)
    impl.setup(inp)
    assert impl.forward() == "out"
    impl.backward("out")
    calls = [name for name, _ in seen]
    assert calls == ["get_workspace", "build_schedule", "forward", "backward"]
    for name, value in seen[1:]:
        assert value == path, f"{name} ran under MOK_FORWARD={value!r}"
    assert os.environ["MOK_FORWARD"] == "something else", "the caller's MOK_FORWARD is restored"
