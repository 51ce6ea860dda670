import pytest
import torch
import torch.nn.functional as F

from moe_plugin import MoEConfig
from moe_plugin.experts import Experts


def loop_reference(experts, x_RD, rows_per_expert, activation):
    outputs, start = [], 0
    for e, n in enumerate(rows_per_expert):
        h = x_RD[start:start + n] @ experts.w1_EDH[e]
        if experts.b1_EH is not None:
            h = h + experts.b1_EH[e]
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = getattr(F, activation)(h)
        y = h @ experts.w2_EHD[e]
        outputs.append(y + experts.b2_ED[e] if experts.b2_ED is not None else y)
        start += n
    return torch.cat(outputs)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows_per_expert", [[3, 0, 7, 1], [0, 0, 0, 0], [5, 5, 5, 5]])
def test_grouped_mlp_matches_per_expert_loop(activation, bias, rows_per_expert):
    config = MoEConfig(model_dim=6, hidden_size=9, num_experts=4, top_k=1, activation=activation, bias=bias)
    experts = Experts(config).double()
    x_RD = torch.randn(sum(rows_per_expert), 6, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(sum(rows_per_expert), 6, dtype=torch.float64)
    params = [x_RD] + list(experts.parameters())
    y = experts(x_RD, rows_per_expert)
    grads = torch.autograd.grad((y * upstream).sum(), params, allow_unused=True)
    y_ref = loop_reference(experts, x_RD, rows_per_expert, activation)
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), params, allow_unused=True, materialize_grads=True)
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads_ref):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_grouped_mlp_gradcheck():
    config = MoEConfig(model_dim=4, hidden_size=5, num_experts=3, top_k=1, activation="silu")
    experts = Experts(config).double()
    x_RD = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in experts.named_parameters()]

    def run(x, *params):
        return torch.func.functional_call(experts, dict(zip(names, params)), (x, [2, 0, 5]))
    inputs = (x_RD,) + tuple(p.detach().clone().requires_grad_() for p in experts.parameters())
    assert torch.autograd.gradcheck(run, inputs)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("capacity_factor", [0.5, 0.0])
def test_fused_path_matches_encode_experts_decode(activation, bias, capacity_factor):
    from moe_plugin.dispatch import decode, encode, plan_routes
    from moe_plugin.dispatchers.local import local_moe

    E, K, T = 6, 3, 41
    config = MoEConfig(model_dim=7, hidden_size=5, num_experts=E, top_k=K, activation=activation, bias=bias)
    experts = Experts(config).double()
    plan = plan_routes(torch.stack([torch.randperm(E)[:K] for _ in range(T)]), E, capacity_factor, 0)
    x_TD = torch.randn(T, 7, dtype=torch.float64, requires_grad=True)
    gate_TK = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(T, 7, dtype=torch.float64)
    params = [x_TD, gate_TK] + list(experts.parameters())

    y = local_moe(x_TD, gate_TK, plan, experts)
    grads = torch.autograd.grad((y * upstream).sum(), params)
    y_ref = decode(experts(encode(x_TD, plan), plan.kept_E.tolist()), gate_TK, plan)
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), params)
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads_ref):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, g: local_moe(x, g, plan, experts), (x_TD, gate_TK))


# ---- the fused layer's lean backward (issue 34 item 2): no [R, D] expert output kept, against the einsum MoE ----

LEAN_CASES = {   # (T, MoEConfig options): dropped tokens, empty experts, k = 1 and k > 2, odd D and H
    "k1_dropping": (23, dict(top_k=1, num_experts=4, capacity_factor=0.5)),
    "k2_dropless": (31, dict(top_k=2, num_experts=5, capacity_factor=0.0)),
    "k3_empty_experts": (3, dict(top_k=3, num_experts=9, capacity_factor=0.0)),
    "k4_dropping_odd": (29, dict(top_k=4, num_experts=6, capacity_factor=0.7, model_dim=9, hidden_size=7)),
}
ALL_ACTIVATIONS = ["relu", "gelu", "silu", "swiglu", "identity", "geglu", "geglu_tanh", "relu2", "swiglu_oai"]


def lean_layer(activation, bias, case, dtype):
    from helpers.reference import make_layer
    T, options = LEAN_CASES[case]
    options = dict(dict(model_dim=11, hidden_size=13), **options)
    if activation == "swiglu_oai":
        options.update(activation_limit=1.5, activation_alpha=1.702)   # a low limit: some values clamped
    layer = make_layer(dtype=dtype, activation=activation, bias=bias, min_capacity=0, **options)
    return layer, torch.randn(T, options["model_dim"], dtype=dtype)


@pytest.mark.parametrize("case", sorted(LEAN_CASES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_lean_backward_matches_reference_fp64(activation, bias, case):
    """Output, input, router (through the gate gradient) and every expert weight's gradient, to 1e-12."""
    from helpers.reference import assert_matches_reference
    layer, x = lean_layer(activation, bias, case, torch.float64)
    assert_matches_reference(layer, x, 1e-12)


@pytest.mark.parametrize("case", sorted(LEAN_CASES))
@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("relu", True), ("geglu", True),
                                              ("swiglu_oai", False), ("silu", True)])
def test_lean_backward_matches_reference_bf16(activation, bias, case):
    """The layer in bf16 against the reference in fp64 on the same (bf16) values: outputs per token, and each
    gradient in norm no further off than the einsum reference run in bf16 itself is (twice its error, plus 1e-2:
    at these tiny sizes bf16's rounding alone reaches a few percent; the router runs in fp32 either way, so the
    routes agree)."""
    import copy
    from helpers.reference import outputs_and_grads, fast, reference
    layer, x = lean_layer(activation, bias, case, torch.bfloat16)
    exact = copy.deepcopy(layer).double()
    y, _, grads = outputs_and_grads(fast(layer), layer, x)
    _, _, grads_bf16_ref = outputs_and_grads(reference(layer), layer, x)
    y_ref, _, grads_ref = outputs_and_grads(reference(exact), exact, x.double())
    assert y.dtype == torch.bfloat16
    per_token = (y.double() - y_ref).norm(dim=1) / y_ref.norm(dim=1).clamp(min=1e-6)
    assert float(per_token.max()) <= 3e-2
    assert set(grads) == set(grads_ref)

    def error(got, want):
        return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))
    for name, want in grads_ref.items():
        assert grads[name].dtype == torch.bfloat16, name
        got, baseline = error(grads[name], want), error(grads_bf16_ref[name], want)
        assert got <= 2 * baseline + 1e-2, f"grad {name}: {got:.3g} (the bf16 reference: {baseline:.3g})"


@pytest.mark.parametrize("activation", ["relu", "swiglu", "gelu"])
def test_fused_backward_keeps_no_expert_output(activation):
    """Nothing with the routed rows' shape [T*K, D] is saved for backward (the expert output was, for the gate
    gradient, before issue 34), and the gate still gets its gradient."""
    from moe_plugin.dispatch import plan_routes
    from moe_plugin.dispatchers.local import local_moe

    T, E, K, D = 41, 6, 3, 7
    config = MoEConfig(model_dim=D, hidden_size=5, num_experts=E, top_k=K, activation=activation, bias=True)
    experts = Experts(config).double()
    plan = plan_routes(torch.stack([torch.randperm(E)[:K] for _ in range(T)]), E, 0.0, 0)
    x_TD = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    gate_TK = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y_TD = local_moe(x_TD, gate_TK, plan, experts)
    assert (T * K, D) not in saved and (T, D) in saved, saved
    grad_gate_TK = torch.autograd.grad(y_TD.square().sum(), gate_TK)[0]
    assert grad_gate_TK.abs().min() > 0
