"""Kernel launches of the layer's CUDA code path, counted on CPU (moe_plugin/ops/launches.py), against the
budgets of issue 33; and the counter itself.

triton reads TRITON_INTERPRET when it is imported, so the counting tests run in a child process started
with TRITON_INTERPRET=1 (test_interpreter_run, helpers.interpreter); `pytest -k launch_budget` selects them all.

Legend: T tokens, D model dim, E experts, K top-k, R routed rows.
"""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer

from helpers.interpreter import check_child_run, in_child, in_parent


@in_parent
def test_interpreter_run(request):
    """Every test of this file again, on CPU under TRITON_INTERPRET=1 (helpers.interpreter)."""
    check_child_run(request)


@in_child
def test_launch_budget_counter_counts_kernels_not_views_and_sees_inside_custom_ops():
    from moe_plugin import ops
    from moe_plugin.ops.launches import count_launches
    T, D, K = 7, 5, 3
    x_TD = torch.randn(T, D)
    pos_TK = torch.randperm(T * K).view(T, K)
    with count_launches() as counter:
        y_TD = x_TD.view(-1).view(T, D).unsqueeze(0)[0].t().t()        # views: nothing
        y_TD = y_TD + 1                                                # one kernel
        torch.empty(3, 4)                                              # an allocation: nothing
        rows_RD = ops.scatter_rows(y_TD, pos_TK, None, None, T * K)[0]  # the Triton kernel (+ its tail zeroing)
    assert counter.by_name["aten.add"] == 1 and counter.by_name["triton.scatter_rows_kernel"] == 1
    assert counter.total == 1 + sum(n for name, n in counter.by_name.items() if name != "aten.add")
    assert not any(name.startswith("aten.view") or name.startswith("aten.empty") for name in counter.by_name)
    assert torch.equal(rows_RD[pos_TK.reshape(-1)], x_TD.add(1).repeat_interleave(K, 0))

    w_D = torch.randn(D, requires_grad=True)
    with count_launches() as counter:           # through the custom op (autograd on): its kernels still counted
        ops.gather_sum(rows_RD * w_D, pos_TK, None, None)[0].sum().backward()
        int(w_D.grad.sum())                     # a read back to the host
    assert counter.by_name["triton.gather_sum_kernel"] == 1 and counter.by_name["triton.scatter_rows_kernel"] == 1
    assert counter.syncs["aten._local_scalar_dense"] == 1

    a_RD, b_EDO = torch.randn(T * K, 8, dtype=torch.bfloat16), torch.randn(3, 8, 16, dtype=torch.bfloat16)
    with count_launches() as counter:           # a grouped GEMM: its arguments' kernel and the GEMM, as on the card
        torch.nn.functional.grouped_mm(a_RD, b_EDO, offs=torch.tensor([5, 12, T * K], dtype=torch.int32))
    assert dict(counter.by_name) == {"aten._grouped_mm": 1, "cuda.grouped_mm_arguments": 1}


# configuration -> (MoEConfig overrides, parameter dtype, autocast dtype, launches allowed forward + backward)
BUDGETS = {
    "dropless_swiglu_bf16": (dict(capacity_factor=0.0, bias=False), torch.bfloat16, None, 30),
    "biases_fixed_capacity_bf16": (dict(capacity_factor=1.25, bias=True), torch.bfloat16, None, 40),
    "autocast_fp32_parameters": (dict(capacity_factor=0.0, bias=False), torch.float32, torch.bfloat16, 45),
}


@in_child
@pytest.mark.parametrize("case", sorted(BUDGETS))
@pytest.mark.parametrize("top_k", [2, 3])
def test_launch_budget(case, top_k, monkeypatch):
    """One forward + backward of the layer (its output's and aux loss's gradients) on the CUDA code path, after a
    first step, launches at most the budget (a grouped GEMM counts two, as on the card), reads nothing back to the
    host, and takes the same routes as the CPU path. The up projection as today (gather, grouped_mm, activation):
    the fused one (ops/fused_gemms.py), taken only where a GPU measured it faster, is not budgeted here."""
    from moe_plugin.ops import fused_gemms, simulated_cuda
    from moe_plugin.ops.launches import count_launches
    monkeypatch.setattr(fused_gemms, "measured_faster", lambda *args: False)
    overrides, dtype, autocast_dtype, budget = BUDGETS[case]
    config = MoEConfig(model_dim=40, hidden_size=24, num_experts=7, top_k=top_k, activation="swiglu", **overrides)
    layer = MoELayer(config).to(dtype)
    x = torch.randn(45, 40, dtype=dtype, requires_grad=True)
    autocast = torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with simulated_cuda(), autocast:    # a first step: what is made once (a cached column of ones) is not counted
        torch.autograd.backward([layer(x), layer.aux_loss], [torch.randn(45, 40, dtype=dtype), torch.rand(())])
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with count_launches() as forward:
        with autocast:
            y = layer(x)
    grad_y, grad_aux = torch.randn_like(y), torch.rand((), dtype=layer.aux_loss.dtype)
    with count_launches() as backward:
        torch.autograd.backward([y, layer.aux_loss], [grad_y, grad_aux])
    total = forward.total + backward.total
    assert total <= budget, f"{total} launches (budget {budget}): forward {dict(forward.by_name)}, " \
                            f"backward {dict(backward.by_name)}"
    assert not forward.syncs and not backward.syncs, (forward.syncs, backward.syncs)
    assert forward.by_name["triton.route_forward_kernel"] == 1, "the fused routing did not run"
    stats = layer.stats
    with autocast:
        layer(x)
    assert layer.stats == stats, "the CPU path routes differently"
