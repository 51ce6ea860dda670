"""The C++ CPU kernels (csrc/) against the torch reference (moe_plugin/ops/torch_ops.py).

Every output of a native kernel is poisoned (NaN, or INT64_MIN for indices) before the kernel runs,
so an element it forgets to write fails the comparison.
"""

import pytest
import torch

from moe_plugin import ops
from moe_plugin.ops import torch_ops
from helpers.native import native_kernels
from helpers.routes import random_slots

CASES = [  # tokens, top_k, experts, dim, capacity
    (37, 3, 5, 11, 4),       # odd sizes, most choices dropped
    (0, 2, 4, 8, 4),         # no tokens
    (1, 1, 1, 1, 1),
    (301, 8, 16, 129, 200),  # top-8
    (257, 8, 8, 33, 1000),   # every expert chosen by everyone, nothing dropped
    (500, 2, 7, 1, 0),       # capacity 0: everything dropped
    (1030, 2, 4, 300, 400),  # large enough to run on several threads
]
DTYPES = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernels():
    module = native_kernels()
    module.poison_outputs(True)
    yield module
    module.poison_outputs(False)


def assert_close(actual, expected, tol):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "an element was never written"
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prioritized", [False, True])
def test_route_slots_match_the_reference(kernels, case, prioritized):
    T, K, E, _, capacity = case
    expert_TK, row_start_E, num_rows = random_slots(T, E, K, capacity)
    order_T = torch.randperm(T) if prioritized else None
    pos_TK, token_R = kernels.route_slots(expert_TK, order_T, row_start_E, capacity, num_rows)
    ref_pos_TK, ref_token_R = torch_ops.route_slots(expert_TK, order_T, row_start_E, capacity, num_rows)
    assert torch.equal(pos_TK, ref_pos_TK) and torch.equal(token_R, ref_token_R)
    assert (pos_TK >= 0).sum() == num_rows


def upcast(tensor):
    return None if tensor is None else tensor.double()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("with_dot", [False, True])
def test_scatter_rows_and_gather_sum_match_the_reference(kernels, case, dtype, scaled, with_dot):
    T, K, E, D, capacity = case
    expert_TK, row_start_E, R = random_slots(T, E, K, capacity)
    pos_TK, _ = torch_ops.route_slots(expert_TK, None, row_start_E, capacity, R)
    x_TD, y_RD = torch.randn(T, D).to(dtype), torch.randn(R, D).to(dtype)
    scale_TK = torch.rand(T, K).to(dtype) if scaled else None
    tol = DTYPES[dtype]

    out_RD, dot_TK = kernels.scatter_rows(x_TD, pos_TK, scale_TK, y_RD if with_dot else None, R)
    ref_RD, ref_dot_TK = torch_ops.scatter_rows(upcast(x_TD), pos_TK, upcast(scale_TK),
                                                upcast(y_RD) if with_dot else None, R)
    assert_close(out_RD, ref_RD.to(dtype), tol)
    assert_close(dot_TK, ref_dot_TK.to(dtype), tol * max(1, D ** 0.5))

    out_TD, dot_TK = kernels.gather_sum(y_RD, pos_TK, scale_TK, x_TD if with_dot else None)
    ref_TD, ref_dot_TK = torch_ops.gather_sum(upcast(y_RD), pos_TK, upcast(scale_TK),
                                              upcast(x_TD) if with_dot else None)
    assert_close(out_TD, ref_TD.to(dtype), tol)
    assert_close(dot_TK, ref_dot_TK.to(dtype), tol * max(1, D ** 0.5))


def test_kernels_reject_bad_indices_and_shapes(kernels):
    pos_TK = torch.tensor([[0, 5]])
    with pytest.raises(RuntimeError, match=r"pos_TK holds a row outside \[0, num_rows=2\)"):
        kernels.scatter_rows(torch.randn(1, 3), pos_TK, None, None, 2)
    with pytest.raises(RuntimeError, match=r"outside \[0, 2\) of src_RD"):
        kernels.gather_sum(torch.randn(2, 3), pos_TK, None, None)
    with pytest.raises(RuntimeError, match=r"scale_TK must have dtype Double"):
        kernels.gather_sum(torch.randn(2, 3, dtype=torch.float64), torch.tensor([[0, 1]]), torch.rand(1, 2), None)
    with pytest.raises(RuntimeError, match=r"other_RD must have shape \[2, 3\]"):
        kernels.scatter_rows(torch.randn(1, 3), torch.tensor([[0, 1]]), None, torch.randn(2, 4), 2)
    with pytest.raises(RuntimeError, match=r"expert index outside \[0, 2\)"):
        kernels.route_slots(torch.tensor([[0, 2]]), None, torch.tensor([0, 1]), 1, 2)


def test_pool_reuses_large_blocks_and_can_be_turned_off(kernels):
    x_TD, pos_TK = torch.randn(1024, 512), torch.arange(1024)[:, None]
    kernels.pool_clear()
    out_RD = kernels.scatter_rows(x_TD, pos_TK, None, None, 1024)[0]
    pointer = out_RD.data_ptr()
    del out_RD
    free_bytes, free_blocks, _ = kernels.pool_stats()
    assert free_blocks == 1 and free_bytes >= 1024 * 512 * 4
    again_RD = kernels.scatter_rows(x_TD, pos_TK, None, None, 1024)[0]
    assert again_RD.data_ptr() == pointer and torch.equal(again_RD, x_TD)
    assert kernels.pool_stats()[1] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_custom_ops_pass_opcheck(kernels, dtype):
    """Schemas, fake (meta) implementations and autograd registrations are consistent."""
    T, K, E, D, capacity = 23, 3, 5, 7, 5
    expert_TK, row_start_E, R = random_slots(T, E, K, capacity)
    pos_TK, _ = ops.route_slots(expert_TK, None, row_start_E, capacity, R)
    x_TD = torch.randn(T, D, dtype=dtype, requires_grad=True)
    y_RD = torch.randn(R, D, dtype=dtype, requires_grad=True)
    scale_TK = torch.rand(T, K, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_plugin.route_slots, (expert_TK, torch.randperm(T), row_start_E, capacity, R))
    torch.library.opcheck(torch.ops.moe_plugin.scatter_rows, (x_TD, pos_TK, scale_TK, None, R))
    torch.library.opcheck(torch.ops.moe_plugin.scatter_rows, (x_TD.detach(), pos_TK, scale_TK.detach(), y_RD.detach(), R))
    torch.library.opcheck(torch.ops.moe_plugin.gather_sum, (y_RD, pos_TK, scale_TK, None))
    torch.library.opcheck(torch.ops.moe_plugin.gather_sum, (y_RD.detach(), pos_TK, None, x_TD.detach()))


def test_custom_op_gradients_pass_gradcheck(kernels):
    T, K, E, D, capacity = 19, 3, 4, 5, 9
    expert_TK, row_start_E, R = random_slots(T, E, K, capacity)
    pos_TK, _ = ops.route_slots(expert_TK, None, row_start_E, capacity, R)
    x_TD = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    gate_TK = torch.rand(T, K, dtype=torch.float64, requires_grad=True)

    def scaled_encode_then_decode(x_TD, gate_TK):
        rows_RD = ops.scatter_rows(x_TD, pos_TK, gate_TK, None, R)[0]
        return ops.gather_sum(rows_RD.sin(), pos_TK, gate_TK, None)[0]
    assert torch.autograd.gradcheck(scaled_encode_then_decode, (x_TD, gate_TK))


@pytest.mark.parametrize("rows, hidden", [(0, 4), (1, 1), (7, 13), (300, 129), (1030, 64)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_swiglu_matches_the_reference(kernels, rows, hidden, dtype):
    pre_RH2 = (torch.randn(rows, 2 * hidden, dtype=torch.float64) * 6).to(dtype)
    if rows:   # far tails: silu saturates to 0 and to x, exp must neither overflow nor turn NaN
        pre_RH2[0, 0], pre_RH2[-1, hidden - 1] = -200.0, 200.0
    grad_RH = torch.randn(rows, hidden, dtype=torch.float64).to(dtype)
    ref_act_RH = torch_ops.swiglu_forward(pre_RH2.double())
    ref_grad_RH2, ref_act2_RH = torch_ops.swiglu_backward(grad_RH.double(), pre_RH2.double())
    tol = DTYPES[dtype]
    assert_close(kernels.swiglu_forward(pre_RH2), ref_act_RH.to(dtype), tol)
    grad_RH2, act_RH = kernels.swiglu_backward(grad_RH, pre_RH2)
    assert_close(grad_RH2, ref_grad_RH2.to(dtype), tol)
    assert_close(act_RH, ref_act2_RH.to(dtype), tol)


def test_swiglu_rejects_bad_shapes(kernels):
    with pytest.raises(RuntimeError, match="2 \\* hidden"):
        kernels.swiglu_forward(torch.randn(4, 5))
    with pytest.raises(RuntimeError, match="grad_act must have shape \\[4, 3\\]"):
        kernels.swiglu_backward(torch.randn(4, 4), torch.randn(4, 6))
