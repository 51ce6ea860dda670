import os
import random

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A fresh seed per test, printed so a failure can be replayed with MOE_TEST_SEED=<seed>."""
    seed = int(os.environ.get("MOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    print(f"{request.node.nodeid}: MOE_TEST_SEED={seed}")
    return seed
