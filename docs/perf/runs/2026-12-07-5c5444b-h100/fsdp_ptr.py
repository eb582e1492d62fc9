# FSDP2 on one GPU: does the unsharded parameter keep its data pointer and version across steps?
import torch, torch.distributed as dist, mok, mok._fp8_layer as f
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
torch.cuda.set_device(0); dist.init_process_group("nccl")
torch.manual_seed(0)
for reshard in (True, False):
    m = mok.nn.MoE(128, 128, 8, 2, dtype=torch.float32, precision="fp8", device="cuda")
    fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                reshard_after_forward=reshard)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    orig = f._state; seen = []
    f._state = lambda w: (seen.append((w._version, w.data_ptr())), orig(w))[1]
    for step in range(4):
        out, st = m(torch.randn(37, 128, dtype=torch.bfloat16, device="cuda"))
        out.float().square().mean().backward(); opt.step(); opt.zero_grad()
        print("reshard", reshard, "step", step, seen[-3:], flush=True)
    f._state = orig
dist.destroy_process_group()
