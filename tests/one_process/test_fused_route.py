"""The fused routing kernels (moe_plugin/one_process/fused_route.py, ops/triton_route.py) and the one-pass bias add against
the torch path they replace, on CPU under the Triton interpreter (in a child process, as triton reads
TRITON_INTERPRET when imported), and the CPU form of the fused routing (ops/torch_route.py) in this process, with
fresh random inputs: dropless, dropping, capped, k > 2, odd sizes,
experts that get no token, each gate normalization and balance loss, the z-loss, fp32 and bf16.

Legend: T tokens, D model dim, E experts, K top-k, R routed rows, O output columns.
"""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer

from helpers.compare import relative_error
from helpers.interpreter import check_child_run, in_child, in_parent
from helpers.poison import poison_triton_buffers


# (T, D, E, K, capacity_factor, normalize_gate, aux_loss, z_loss_coef): E > T * K leaves experts without a token;
# T 2100 at E 130 gives route_plan's scans several tiles (66 token blocks, 198 histogram rows, 32 rows a tile), the
# GShard loss's counted rows ending inside one
CASES = [(50, 24, 8, 2, 0.0, "before_drop", "gshard", 0.0), (37, 13, 5, 3, 1.0, "after_drop", "switch", 0.01),
         (41, 40, 9, 4, 0.5, "none", "gshard", 0.0), (17, 7, 3, 1, 1.25, "none", "none", 0.1),
         (3, 16, 33, 2, 0.0, "before_drop", "switch", 0.0), (70, 20, 6, 6, -0.5, "after_drop", "gshard", 0.02),
         (2100, 8, 130, 3, 0.75, "after_drop", "gshard", 0.01)]


@in_parent
def test_interpreter_run(request):
    """This file's tests marked in_child, on CPU under TRITON_INTERPRET=1 (helpers.interpreter)."""
    check_child_run(request)


CASE_IDS = [f"T{c[0]}-E{c[2]}-K{c[3]}-cf{c[4]}" for c in CASES]


@in_child
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_route_equals_router_plan_and_gates(case, dtype, monkeypatch):
    """Every buffer the routing kernels allocate starts as NaN (z_loss_coef 0 once read an unwritten z-loss sum)."""
    from moe_plugin.ops import simulated_cuda
    poison_triton_buffers(monkeypatch)
    compare_with_reference(case, dtype, simulated_cuda)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_cpu_fused_route_equals_router_plan_and_gates(case, dtype, autocast, kernels, monkeypatch):
    """The CPU form (ops/torch_route.py), in this process: the native route_plan / route_backward (auto, where
    they build) and the torch ops (MOE_PLUGIN_KERNELS=torch)."""
    from moe_plugin.ops import torch_route
    monkeypatch.setenv("MOE_PLUGIN_KERNELS", kernels)
    assert (torch_route._native(torch.device("cpu")) is None) == (kernels == "torch") or kernels == "auto"
    compare_with_reference(case, dtype, lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast))


def unique_top_k(layer, T, D, K, dtype):
    """Fresh random tokens whose top K+1 router scores hold no exact tie. Where scores tie exactly (bf16 tokens
    through an fp32 router do, about once in a thousand draws of the largest case), the order of the tied experts is
    unspecified (torch.topk's; the kernels put the lower index first), and with it the slots and drops that follow."""
    for _ in range(20):
        x_TD = torch.randn(T, D, dtype=dtype, requires_grad=True)
        with torch.no_grad():
            scores_TE = layer.router.scores(layer.router.logits(x_TD).float())
        top_TX = scores_TE.topk(min(K + 1, scores_TE.shape[1]), dim=-1).values
        if not (top_TX[:, 1:] == top_TX[:, :-1]).any():
            return x_TD
    raise AssertionError("20 draws all held an exact tie in some token's top-k")


def compare_with_reference(case, dtype, context):
    from moe_plugin.one_process import fused_route
    T, D, E, K, cf, normalize, aux, z = case
    config = MoEConfig(model_dim=D, hidden_size=8, num_experts=E, top_k=K, capacity_factor=cf, normalize_gate=normalize,
                       aux_loss=aux, z_loss_coef=z, route_scale=1.5, min_capacity=1)
    layer = MoELayer(config).to(dtype)
    x_TD = unique_top_k(layer, T, D, K, dtype)
    weight_ED = layer.router.weight_ED
    with context():
        assert fused_route.eligible(layer, x_TD)
        gate_TK, aux_loss, plan = fused_route.route(layer, x_TD, cf, dtype)
        gate_ref, aux_ref, plan_ref, _ = fused_route.reference(layer, x_TD, cf, dtype)
    for name in ("pos_TK", "kept_TK", "load_E", "kept_E", "offs_E"):
        assert torch.equal(getattr(plan, name), getattr(plan_ref, name)), name
    assert (plan.cap, plan.fixed) == (plan_ref.cap, plan_ref.fixed)
    if cf > 0 and T * K > E:
        assert not plan.kept_TK.all() or cf >= 1, "a dropping case that drops nothing"
    assert gate_TK.dtype == gate_ref.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(gate_TK, gate_ref) <= tolerance and relative_error(aux_loss, aux_ref) <= 1e-5

    grad_gate, grad_aux = torch.randn_like(gate_TK), torch.randn(())
    grads = torch.autograd.grad((gate_TK, aux_loss), (x_TD, weight_ED), (grad_gate, grad_aux))
    grads_ref = torch.autograd.grad((gate_ref, aux_ref), (x_TD, weight_ED), (grad_gate, grad_aux))
    # fp32: the gradient of a structurally-zero term (a lone normalized gate) is rounding noise on both paths
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for grad, grad_ref in zip(grads, grads_ref):
        assert grad.dtype == grad_ref.dtype and relative_error(grad, grad_ref) <= tolerance


@in_child
@pytest.mark.parametrize("R, O, counts", [(40, 24, [5, 0, 12, 3]), (7, 300, [7]), (33, 5, [0, 0, 10, 0, 9]),
                                          (9, 16, [0, 0])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_bias_rows_equals_the_reference(R, O, counts, dtype):
    from moe_plugin.ops import grouped, offsets, simulated_cuda
    offs_E = offsets(counts)
    out_RO, bias_EO = torch.randn(R, O, dtype=dtype), torch.randn(len(counts), O, dtype=dtype)
    expected_RO = out_RO.clone()
    grouped.add_bias(expected_RO, bias_EO, offs_E)     # the CPU path: block by block
    with simulated_cuda():
        grouped.add_bias(out_RO, bias_EO, offs_E)      # the one-pass kernel
    # fp32 exact; bf16 within an ulp: the interpreter truncates on the cast to bf16 (a GPU rounds to nearest)
    rtol = 0 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(out_RO, expected_RO, rtol=rtol, atol=0)
    assert torch.equal(out_RO[offs_E[-1]:], expected_RO[offs_E[-1]:])      # the rows past the groups untouched


@in_child
@pytest.mark.parametrize("capacity_factor, bias, top_k, fused", [(0.0, False, 2, True), (0.5, True, 3, False),
                                                                 (-0.5, True, 1, True), (1.25, False, 4, False)])
def test_layer_on_the_cuda_path_equals_the_cpu_path_with_poisoned_memory(capacity_factor, bias, top_k, fused,
                                                                         monkeypatch):
    """Every Triton output starts as NaN: rows past the kept ones (no longer zeroed) must never be read. fused: the
    fused grouped GEMMs (ops/fused_gemms.py) taken wherever they apply, or never (not timed: under the interpreter
    timing them was most of this test's time)."""
    from moe_plugin.ops import fused_gemms, simulated_cuda
    from helpers.reference import outputs_and_grads
    monkeypatch.setattr(fused_gemms, "measured_faster", lambda *args: fused)
    poison_triton_buffers(monkeypatch)
    config = MoEConfig(model_dim=19, hidden_size=11, num_experts=6, top_k=top_k, activation="swiglu", bias=bias,
                       capacity_factor=capacity_factor, z_loss_coef=0.01, aux_loss="switch")
    layer = MoELayer(config)
    x = torch.randn(2, 23, 19)
    with simulated_cuda():
        y, aux, grads = outputs_and_grads(lambda x: (layer(x), layer.aux_loss), layer, x)
        stats, aux_value = layer.stats, layer.aux_loss_value.clone()     # written by the routing kernel itself
    y_ref, aux_ref, grads_ref = outputs_and_grads(lambda x: (layer(x), layer.aux_loss), layer, x)
    assert stats == layer.stats and torch.equal(aux_value, aux.detach().float())
    if capacity_factor == 0.5:
        assert stats["dropped_fraction"] > 0
    assert relative_error(y, y_ref) <= 1e-5 and relative_error(aux, aux_ref) <= 1e-5
    for name in grads_ref:
        assert relative_error(grads[name], grads_ref[name]) <= 1e-4, name


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_layer_under_activation_checkpointing_equals_without(capacity_factor):
    """Non-reentrant checkpointing allows one unpack of the saved tensors per backward (the fused layer's
    backward once unpacked them twice: CheckpointError)."""
    from torch.utils.checkpoint import checkpoint
    from helpers.reference import outputs_and_grads
    layer = MoELayer(MoEConfig(model_dim=12, hidden_size=10, num_experts=4, top_k=2, activation="swiglu",
                               capacity_factor=capacity_factor))
    x = torch.randn(29, 12)
    y, aux, grads = outputs_and_grads(lambda x: (checkpoint(layer, x, use_reentrant=False), layer.aux_loss), layer, x)
    y_ref, aux_ref, grads_ref = outputs_and_grads(lambda x: (layer(x), layer.aux_loss), layer, x)
    assert torch.equal(y, y_ref) and torch.equal(aux, aux_ref)
    for name in grads_ref:
        assert torch.equal(grads[name], grads_ref[name]), name
