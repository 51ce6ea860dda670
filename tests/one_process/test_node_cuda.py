"""The one-node CUDA path (moe_plugin/one_process/node_cuda.py: the Triton routing and the experts in one autograd
function) against the two-node path it replaces (fused_route -> the local dispatcher's FusedMoE, run with
node_cuda.ENABLED off) and the einsum reference: outputs, aux loss, stats and every gradient, on fresh random
inputs, with dropped tokens, empty experts, k > 2, odd token counts, biases, several activations, recompute, a shared
expert, a separate router input, frozen weights, fp32 and bf16; that it is the path taken where it applies and not
where it does not; and the routing kernels' two options it uses (each kept row's final gate written by row; the
gates' gradient read by row). On CPU under the Triton interpreter, in the child process of test_interpreter_run.

Legend: T tokens, D model dim, E experts, K top-k, R routed rows.
"""
import contextlib
import copy

import pytest
import torch

from moe_plugin.lora import add_lora

from helpers import one_node
from helpers.compare import relative_error
from helpers.interpreter import check_child_run, in_child, in_parent
from helpers.one_node import make
from helpers.poison import poison_triton_buffers

CASES = {
    **one_node.CASES,
    "swiglu with biases, capacity -0.5": dict(bias=True, capacity_factor=-0.5),
    "k 1, many experts (some empty)": dict(top_k=1, num_experts=16),
    "recompute experts, drops": dict(recompute="experts", capacity_factor=0.75, top_k=3),
}


@in_parent
def test_interpreter_run(request):
    """This file's tests again, on CPU under TRITON_INTERPRET=1 (helpers.interpreter)."""
    check_child_run(request)


def outputs(layer, x, router_input=None, upstream=None):
    """helpers.one_node.outputs on the CUDA path (simulated on CPU tensors)."""
    from moe_plugin.ops import simulated_cuda
    context = simulated_cuda if x.device.type == "cpu" else contextlib.nullcontext
    return one_node.outputs(layer, x, router_input, upstream, context)


@pytest.fixture(autouse=True)
def untimed(monkeypatch):
    """The fused grouped GEMMs (ops/fused_gemms.py) never taken: under the interpreter, timing them once per shape
    is most of a test's time (test_one_node_equals_two_nodes_and_reference takes them in two cases)."""
    from moe_plugin.ops import fused_gemms
    monkeypatch.setattr(fused_gemms, "measured_faster", lambda *args: False)


@pytest.fixture
def ran(monkeypatch):
    """How often the one-node CUDA path ran."""
    from moe_plugin.one_process import node_cuda
    return one_node.count_runs(monkeypatch, node_cuda)


def two_node(monkeypatch):
    from moe_plugin.one_process import node_cuda
    monkeypatch.setattr(node_cuda, "ENABLED", False)


def assert_close(got, expected, tolerance, exact=None):
    """got within tolerance of expected (the two-node path) in every output and gradient. exact (the same step in
    float64) also passes a quantity further off where got is nearer exact than expected is: with a token or two in
    bf16, a gradient that cancels can be off by more than the tolerance on each path, rounded differently."""
    def quantities(outputs):
        return {"y": outputs[0], "aux": outputs[1], **{f"grad {name}": grad for name, grad in outputs[3].items()}}
    assert got[2] == expected[2] and set(got[3]) == set(expected[3])
    mine, theirs = quantities(got), quantities(expected)
    errors = {key: relative_error(mine[key], theirs[key]) for key in theirs}
    off = {key: error for key, error in errors.items() if error > tolerance}
    if exact is not None:
        exact = quantities(exact)
        off = {key: error for key, error in off.items()
               if relative_error(mine[key], exact[key]) > relative_error(theirs[key], exact[key])}
    assert not off, f"{off} off by more than {tolerance} (all: {errors})"


@in_child
@pytest.mark.parametrize("case, tokens, fused", [(case, 19, False) for case in CASES] +
                         [("dropless swiglu", 33, True), ("biases, relu, switch loss", 24, True)])
def test_one_node_equals_two_nodes_and_reference(case, tokens, fused, ran, monkeypatch):
    """fused: the fused grouped GEMMs taken wherever they apply. Every buffer the kernels allocate starts as NaN."""
    from helpers.reference import assert_matches_reference
    from moe_plugin.one_process import node_cuda
    from moe_plugin.ops import fused_gemms, simulated_cuda
    monkeypatch.setattr(fused_gemms, "measured_faster", lambda *args: fused)
    poison_triton_buffers(monkeypatch)
    layer = make(**CASES[case])
    x = torch.randn(tokens, 16)
    got = outputs(layer, x)
    assert len(ran) == 1, "the one-node CUDA path did not run"
    two_node(monkeypatch)
    assert_close(got, outputs(layer, x, upstream=got[-1]), 2e-5)
    assert len(ran) == 1
    if CASES[case].get("capacity_factor", 0.0) == 0.6:
        assert got[2]["dropped_fraction"] > 0
    if case in ("dropless swiglu", "drops, k 3, gshard, z-loss") and not fused:
        monkeypatch.setattr(node_cuda, "ENABLED", True)
        with simulated_cuda():
            assert_matches_reference(layer, x, 5e-5)     # the einsum MoE, with the one-node path on again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter tests above cover CPU)")
@pytest.mark.parametrize("case", ["dropless swiglu", "drops, k 3, gshard, z-loss", "swiglu with biases, capacity -0.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_one_node_equals_two_nodes(case, dtype, ran, monkeypatch):
    """The same, with the Triton kernels compiled (benchmarks/gpu/run.sh --tests runs this file on the card)."""
    layer = make(dtype, **CASES[case]).cuda()
    x = torch.randn(301, 16, dtype=dtype, device="cuda")
    got = outputs(layer, x)
    assert ran, "the one-node CUDA path did not run"
    two_node(monkeypatch)
    assert_close(got, outputs(layer, x, upstream=got[-1]), 2e-5 if dtype == torch.float32 else 3e-2)


@in_child
def test_router_input_gets_the_router_gradient(ran, monkeypatch):
    layer = make(aux_loss="switch", aux_loss_coef=0.05)
    x, routed = torch.randn(2, 7, 16), torch.randn(2, 7, 16).requires_grad_()
    got = outputs(layer, x, router_input=routed)
    assert ran and set(got[3]) >= {"x", "router_input"}
    two_node(monkeypatch)
    assert_close(got, outputs(layer, x, router_input=routed, upstream=got[-1]), 1e-5)


@in_child
@pytest.mark.parametrize("case", ["dropless swiglu", "drops, k 3, gshard, z-loss", "biases, relu, switch loss"])
def test_bf16(case, ran, monkeypatch):
    """bf16 to rounding: here the gates' gradient reaches the routing in fp32 (the two-node path rounds it to the
    gates' bf16 first) and the router's share of x's gradient is added inside its GEMM."""
    layer = make(torch.bfloat16, **CASES[case])
    x = torch.randn(23, 16, dtype=torch.bfloat16)
    got = outputs(layer, x)
    assert ran and got[0].dtype == torch.bfloat16
    two_node(monkeypatch)
    assert_close(got, outputs(layer, x, upstream=got[-1]), 3e-2)


@in_child
@pytest.mark.parametrize("frozen, input_grad", [
    (("experts.w1_EDH", "experts.w2_EHD"), True),                       # LoRA-style frozen experts
    (("router.weight_ED",), True),                                      # a frozen router: no routing backward
    (("experts.w1_EDH", "experts.w2_EHD", "router.weight_ED"), False),  # nothing asks: forward only
])
def test_frozen_weights_get_no_gradient(frozen, input_grad, ran, monkeypatch):
    from moe_plugin.ops import simulated_cuda
    layer = make(capacity_factor=0.8, aux_loss="gshard", aux_loss_coef=0.01)
    for name, p in layer.named_parameters():
        p.requires_grad_(name not in frozen)
    x = torch.randn(17, 16)

    def step():
        for p in layer.parameters():
            p.grad = None
        xr = x.clone().requires_grad_(input_grad)
        with simulated_cuda():
            y = layer(x if not input_grad else xr)
            if y.requires_grad:
                (y.square().sum() + layer.aux_loss).backward()
        return y.detach(), xr.grad, {n: p.grad for n, p in layer.named_parameters()}
    y, x_grad, grads = step()
    assert ran and all(grads[name] is None for name in frozen)
    two_node(monkeypatch)
    y_ref, x_grad_ref, grads_ref = step()
    assert relative_error(y, y_ref) <= 1e-5
    assert (x_grad is None) == (x_grad_ref is None) and (x_grad is None or relative_error(x_grad, x_grad_ref) <= 1e-5)
    for name, grad in grads.items():
        assert (grad is None) == (grads_ref[name] is None), name
        assert grad is None or relative_error(grad, grads_ref[name]) <= 1e-5, name


@in_child
def test_no_grad_forward_is_the_graph_forward(ran):
    from moe_plugin.ops import simulated_cuda
    one_node.assert_no_grad_forward_is_the_graph_forward(ran, simulated_cuda)


@in_child
@pytest.mark.parametrize("case", ["dropless swiglu", "biases, relu, switch loss", "shared expert"])
def test_autocast_fp32_parameters(case, ran, monkeypatch):
    """Under bf16 autocast with fp32 parameters the experts take x in bf16 and the router x in fp32 (two inputs of
    the node), as on the two-node path: the same outputs and gradients to bf16 rounding."""
    layer = make(**CASES[case])
    x = torch.randn(21, 16)

    def step(upstream=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return outputs(layer, x, upstream=upstream)
    got = step()
    assert ran and got[0].dtype == torch.bfloat16
    assert all(grad.dtype == torch.float32 for grad in got[3].values())
    two_node(monkeypatch)
    assert_close(got, step(got[-1]), 3e-2)


@in_child
def test_lora_and_other_routers_take_the_two_node_path(ran):
    from moe_plugin.ops import simulated_cuda
    x = torch.randn(10, 16)
    with simulated_cuda():
        layer = make()
        make(router="sigmoid")(x)
        add_lora(layer, rank=2)
        layer(x)
    assert not ran


@in_child
@pytest.mark.parametrize("T, E, K, cap, normalize", [(37, 6, 2, 74, "before_drop"), (23, 5, 3, 9, "after_drop"),
                                                     (9, 16, 1, 2, "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_kernels_by_row(T, E, K, cap, normalize, dtype):
    """route_slots' final_R holds each kept choice's final gate at its row (other rows untouched), and
    route_backward(by_row) given a gradient per row equals route_backward given it per choice."""
    from moe_plugin.ops import triton_route
    x_TD, w_ED = torch.randn(T, 8, dtype=dtype), torch.randn(E, 8, dtype=dtype)
    expert_TK, gate_TK, probs_TE, hist_AE, psum_BE, zsum_B, lse_T = triton_route.route_forward(
        x_TD, w_ED, K, normalize == "before_drop", True)
    first_AE, load_E, kept_E, offs_E, aux, aux_grad_E = triton_route.route_plan(
        hist_AE, psum_BE, zsum_B, T, K, cap, "gshard", 0.01, 0.001)
    final_R = torch.full((T * K,), 7.0, dtype=dtype)
    pos_TK, kept_TK, final_TK = triton_route.route_slots(expert_TK, gate_TK, first_AE, kept_E, offs_E, cap,
                                                         normalize == "after_drop", 1.5, dtype, final_R)
    kept = pos_TK[kept_TK]
    assert torch.equal(final_R[kept], final_TK[kept_TK])
    unnamed = torch.ones(T * K, dtype=torch.bool)
    unnamed[kept] = False
    assert (final_R[unnamed] == 7.0).all() and (not kept_TK.all() or not unnamed.any())

    grad_TK = torch.randn(T, K)
    grad_R = torch.randn(T * K)          # rows no choice names hold noise: never read
    grad_R[kept] = grad_TK[kept_TK]
    args = (expert_TK, gate_TK, pos_TK, probs_TE, lse_T, aux_grad_E, normalize, 1.5, 0.001, torch.float32)
    by_choice = triton_route.route_backward(grad_TK, torch.tensor(0.5), *args)
    by_row = triton_route.route_backward(grad_R, torch.tensor(0.5), *args, by_row=True)
    assert torch.equal(by_row, by_choice)


@in_child
@pytest.mark.parametrize("seed", range(10))
def test_random_configurations(seed, ran, monkeypatch):
    """A configuration drawn at random (experts 1-8, k up to E, 1-30 tokens, every capacity policy, activations,
    biases, gate normalizations, losses, recompute, a router input, bf16, fp32 under bf16 autocast) and the fused
    grouped GEMMs taken or not: the same outputs, stats and gradients as the two-node path."""
    import random
    from moe_plugin.ops import fused_gemms
    draw = random.Random(seed)
    monkeypatch.setattr(fused_gemms, "measured_faster", lambda *args: draw.random() < 0.5)
    E = draw.choice([1, 2, 5, 8])
    options = dict(model_dim=draw.choice([8, 24]), hidden_size=draw.choice([8, 12]), num_experts=E,
                   top_k=draw.randint(1, E), capacity_factor=draw.choice([0.0, 0.5, 1.25, -0.5]),
                   min_capacity=draw.choice([0, 4]), activation=draw.choice(["swiglu", "relu", "gelu", "geglu"]),
                   bias=draw.random() < 0.5, normalize_gate=draw.choice(["none", "before_drop", "after_drop"]),
                   aux_loss=draw.choice(["gshard", "switch"]), aux_loss_coef=0.05, z_loss_coef=draw.choice([0.0, 0.01]),
                   route_scale=draw.choice([1.0, 2.0]), recompute=draw.choice(["none", "experts"]))
    dtype = draw.choice([torch.float32, torch.bfloat16])
    amp = dtype == torch.float32 and draw.random() < 0.4
    layer = make(dtype, **options)
    T = draw.choice([1, 3, 17, 30])
    x = torch.randn(T, options["model_dim"], dtype=dtype)
    routed = torch.randn(T, options["model_dim"], dtype=dtype).requires_grad_() if draw.random() < 0.3 else None

    def step(upstream=None):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return outputs(layer, x, router_input=routed, upstream=upstream)
    got = step()
    assert ran, "the one-node CUDA path did not run"
    two_node(monkeypatch)
    expected = step(got[-1])
    if options["top_k"] == 1 and options["normalize_gate"] == "before_drop":     # a lone normalized gate: its
        for name in ("router.weight_ED", "router_input"):                      # gradient is rounding noise
            got[3].pop(name, None), expected[3].pop(name, None)
    if dtype == torch.float32 and not amp:
        assert_close(got, expected, 1e-4)
    else:
        exact = one_node.outputs(copy.deepcopy(layer).double(), x.double(),
                                 None if routed is None else routed.detach().double().requires_grad_(),
                                 got[-1].double())
        assert_close(got, expected, 5e-2, exact)
