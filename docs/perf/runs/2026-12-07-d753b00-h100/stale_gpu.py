# The GPU FSDP2 suite with the aliasing check turned off: the FP8 cases must fail (stale weights).
import sys, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4, "tests", "python"))
import mok._fp8_layer as f
f.storage_shared = lambda t: False
import fsdp_worker
fsdp_worker.main()
