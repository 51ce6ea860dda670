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
