import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def deepspeed_comm_op_built():
    """DeepSpeed builds its CPU shm comm op (JIT) in every process that starts its comm. Built here once, in a
    process of its own that no test's timeout stops, so a worker killed by a timeout never dies in the build."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    from torch.utils.cpp_extension import _get_build_directory
    from moe_plugin.ops.native import _clear_stale_lock
    _clear_stale_lock(Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock")
    subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                   check=True, timeout=1200, capture_output=True)
