"""DeepSpeed's CPU comm op is built once before these tests start DeepSpeed (helpers.plugin)."""
import pytest


@pytest.fixture(scope="session", autouse=True)
def _deepspeed_comm_op(deepspeed_comm_op_built):
    pass
