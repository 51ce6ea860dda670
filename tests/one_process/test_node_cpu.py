"""The one-node CPU path (moe_plugin/one_process/node_cpu.py: routing and experts in one autograd function, native kernels
called directly) against the einsum reference and against the two-node path it replaces (fused_route ->
dispatcher, run with node_cpu.ENABLED off): outputs, aux loss, stats and every gradient, on fresh random inputs,
with dropped tokens, empty experts, k > 2, odd token counts, biases, several activations, a shared expert, a
separate router input, frozen weights, fp32 and bf16; that it is the path taken where it applies and not where it
does not; and that a backward runs no GEMM for a gradient nothing asks for."""
import copy

import pytest
import torch

from moe_plugin.one_process import node_cpu
from moe_plugin.lora import add_lora
from moe_plugin.ops import kernels_for
from helpers import one_node
from helpers.compare import relative_error
from helpers.one_node import count_runs, make, outputs
from helpers.reference import assert_matches_reference

pytestmark = pytest.mark.skipif(kernels_for(torch.device("cpu"))[1] != "native",
                                reason="the one-node path runs with the native CPU kernels, which do not load here")

CASES = {
    **one_node.CASES,
    "clamped gpt-oss swiglu with biases": dict(activation="swiglu_oai", activation_limit=0.5, activation_alpha=1.702,
                                               bias=True),
    "geglu, k 1, many experts (some empty)": dict(activation="geglu", top_k=1, num_experts=16),
}


@pytest.fixture
def count_fused(monkeypatch):
    """How often the one-node path ran."""
    return count_runs(monkeypatch, node_cpu)


def two_node(monkeypatch):
    monkeypatch.setattr(node_cpu, "ENABLED", False)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [37, 64])
def test_one_node_equals_two_nodes_and_reference(case, tokens, count_fused, monkeypatch):
    layer = make(**CASES[case])
    x = torch.randn(tokens, 16)
    y, aux, stats, grads, upstream = outputs(layer, x)
    assert count_fused, "the one-node path did not run"
    monkeypatch.setattr(node_cpu, "ENABLED", False)
    y_ref, aux_ref, stats_ref, grads_ref, _ = outputs(layer, x, upstream=upstream)
    assert len(count_fused) == 1
    assert stats == stats_ref
    errors = {"y": relative_error(y, y_ref), "aux": relative_error(aux, aux_ref)}
    errors.update({f"grad {name}": relative_error(grads[name], grads_ref[name]) for name in grads_ref})
    assert set(grads) == set(grads_ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-5, f"{worst} off by {errors[worst]:.3g} (all: {errors})"
    monkeypatch.setattr(node_cpu, "ENABLED", True)
    assert_matches_reference(layer, x, 5e-5)     # the einsum MoE, with the one-node path on again


def test_router_input_gets_the_router_gradient(count_fused, monkeypatch):
    layer = make(aux_loss="switch", aux_loss_coef=0.05)
    x, routed = torch.randn(2, 9, 16), torch.randn(2, 9, 16).requires_grad_()
    y, aux, _, grads, upstream = outputs(layer, x, router_input=routed)
    assert count_fused
    two_node(monkeypatch)
    y_ref, aux_ref, _, grads_ref, _ = outputs(layer, x, router_input=routed, upstream=upstream)
    assert relative_error(y, y_ref) <= 1e-5 and relative_error(aux, aux_ref) <= 1e-5
    for name in ("x", "router_input", "router.weight_ED", "experts.w1_EDH", "experts.w2_EHD"):
        assert relative_error(grads[name], grads_ref[name]) <= 1e-5, name


@pytest.mark.parametrize("case", ["dropless swiglu", "drops, k 3, gshard, z-loss"])
def test_bf16(case, count_fused, monkeypatch):
    layer = make(torch.bfloat16, **CASES[case])
    x = torch.randn(40, 16, dtype=torch.bfloat16)
    y, aux, stats, grads, upstream = outputs(layer, x)
    assert count_fused and y.dtype == torch.bfloat16
    two_node(monkeypatch)
    y_ref, aux_ref, stats_ref, grads_ref, _ = outputs(layer, x, upstream=upstream)
    assert stats == stats_ref
    assert relative_error(y, y_ref) <= 2e-2 and relative_error(aux, aux_ref) <= 2e-2
    for name in grads_ref:
        assert relative_error(grads[name], grads_ref[name]) <= 3e-2, name


def test_no_grad_forward_is_the_graph_forward(count_fused):
    one_node.assert_no_grad_forward_is_the_graph_forward(count_fused)


class CountingKernels:
    """The native module, counting its grouped GEMMs."""

    def __init__(self, native):
        self.native, self.grouped = native, 0

    def grouped_mm(self, *args):
        self.grouped += 1
        return self.native.grouped_mm(*args)

    def __getattr__(self, name):
        return getattr(self.native, name)


@pytest.mark.parametrize("frozen, input_grad, gemms", [
    ((), True, 6),                                       # 2 forward, 4 backward
    (("experts.w1_EDH", "experts.w2_EHD"), True, 4),     # LoRA-style frozen experts: no weight gradients
    (("experts.w1_EDH", "experts.w2_EHD", "router.weight_ED"), False, 2),   # nothing below asks: forward only
])
def test_backward_runs_no_gemm_for_a_gradient_nothing_asks_for(frozen, input_grad, gemms, monkeypatch):
    layer = make()
    counting = CountingKernels(node_cpu.kernels(torch.zeros(1)))
    monkeypatch.setattr(node_cpu, "kernels", lambda x: counting)
    for name, p in layer.named_parameters():
        p.requires_grad_(name not in frozen)
    x = torch.randn(30, 16, requires_grad=input_grad)
    y = layer(x)
    if y.requires_grad:
        y.square().sum().backward()
    assert counting.grouped == gemms
    assert all(p.grad is None for name, p in layer.named_parameters() if name in frozen)
    reference = copy.deepcopy(layer)
    two_node(monkeypatch)
    xr = x.detach().requires_grad_(input_grad)
    yr = reference(xr)
    assert relative_error(y, yr) <= 1e-5
    if yr.requires_grad:
        yr.square().sum().backward()
        for (name, p), (_, pr) in zip(layer.named_parameters(), reference.named_parameters()):
            assert relative_error(p.grad, pr.grad) <= 1e-5, name
        assert relative_error(x.grad, xr.grad) <= 1e-5


@pytest.mark.parametrize("why, options, dtype", [
    ("fp64 (no BLAS fast path)", dict(), torch.float64),
    ("rows of 12 bytes", dict(model_dim=3), torch.float32),
    ("sigmoid router", dict(router="sigmoid"), torch.float32),
])
def test_elsewhere_the_two_node_path_runs(why, options, dtype, count_fused):
    layer = make(dtype, **options)
    x = torch.randn(13, layer.config.model_dim, dtype=dtype)
    assert_matches_reference(layer, x, 1e-10 if dtype == torch.float64 else 5e-5)
    assert not count_fused, why


def test_autocast_and_lora_take_the_two_node_path(count_fused):
    layer = make()
    x = torch.randn(10, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    add_lora(layer, rank=2)
    layer(x)
    assert not count_fused
