import os
import random
import sys

import pytest
import torch

# JIT-built C++ ops (ours, DeepSpeed's CPU shm comm) are cached per environment: two environments sharing
# ~/.cache/torch_extensions rebuild each other's ops, and a build killed half-way leaves a lock on which every
# later build of that op waits forever (seen: all DeepSpeed tests hung). Spawned workers inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A fresh seed per test, printed so a failure can be replayed with MOE_TEST_SEED=<seed>."""
    seed = int(os.environ.get("MOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    print(f"{request.node.nodeid}: MOE_TEST_SEED={seed}")
    return seed
