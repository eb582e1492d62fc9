"""The oldest PyTorch and Transformers mok runs on, and the check of a package's version: the
first module mok imports (it imports nothing of mok and not the extension), so that an old torch
is refused by name before anything fails on it."""

import re

# The oldest PyTorch mok runs on: the Python suite passes on the CPU with torch 2.9, 2.10, 2.11
# and 2.15 (2026-12-07). Older ones fail at import (2.4, 2.6: torch.library cannot read the ops'
# annotations) or in parts (2.8: torch.compile hides mok's refusal of an unchecked module).
TORCH_MINIMUM = (2, 9)
# The oldest Transformers mok.integrations.transformers runs on (checked when that module is
# imported). Before 5.7.0 from_pretrained and set_experts_implementation accept only Transformers'
# own names ("eager", "grouped_mm", "batched_mm", "deepgemm"), not one registered in the
# ExpertsInterface: refused with 5.0.0, 5.5.4, 5.6.0 and 5.6.2 on the CPU (2026-12-07); before 5.0
# there is no ExpertsInterface.
TRANSFORMERS_MINIMUM = (5, 7)


def check_version(package, version, minimum):
    """ImportError naming `version` (`package`'s __version__) when it is older than `minimum`, a
    (major, minor) pair."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(int(n) for n in found.groups()) < minimum:
        raise ImportError(f"mok: invalid {package} version: expected {minimum[0]}.{minimum[1]} "
                          f"or newer, got {version}")
