import pytest
import torch

from moe_plugin import MoEConfig
from moe_plugin.router import Router, balance_loss, finalize_gates, z_loss


@pytest.mark.parametrize("kind", ["gshard", "switch"])
def test_balance_loss_is_one_when_balanced_and_larger_when_not(kind):
    E, T = 4, 8
    uniform_TE = torch.full((T, E), 1.0 / E)
    balanced_TK = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], dim=1)
    assert float(balance_loss(kind, uniform_TE, balanced_TK, E)) == pytest.approx(1.0)
    skewed_TE = torch.softmax(torch.tensor([[4.0, 0, 0, 0]]).repeat(T, 1), dim=-1)
    collapsed_TK = torch.tensor([[0, 1]]).repeat(T, 1)
    assert float(balance_loss(kind, skewed_TE, collapsed_TK, E)) > 1.5
    assert float(balance_loss("none", skewed_TE, collapsed_TK, E)) == 0.0


def test_z_loss_formula():
    logits_TE = torch.randn(9, 5)
    expected = sum(float(torch.log(torch.exp(row).sum())) ** 2 for row in logits_TE) / 9
    assert float(z_loss(logits_TE)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("router", ["softmax", "sigmoid", "cosine"])
def test_router_chooses_top_k_and_normalizes(router):
    router_module = Router(MoEConfig(model_dim=8, hidden_size=8, num_experts=6, top_k=3, router=router))
    routes = router_module(torch.randn(20, 8))
    assert routes.expert_TK.shape == (20, 3)
    best_TK = torch.topk(routes.scores_TE, 3, dim=-1).indices
    assert torch.equal(routes.expert_TK, best_TK)
    assert torch.allclose(routes.gate_TK.sum(-1), torch.ones(20))


def test_fp32_router_on_bf16_input():
    router_module = Router(MoEConfig(model_dim=8, hidden_size=8, num_experts=4)).to(torch.bfloat16)
    routes = router_module(torch.randn(5, 8, dtype=torch.bfloat16))
    assert routes.scores_TE.dtype == torch.float32


def test_finalize_gates_after_drop_renormalizes_kept_choices():
    gate_TK = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    kept_TK = torch.tensor([[True, False], [True, True]])
    assert torch.allclose(finalize_gates(gate_TK, kept_TK, "after_drop"), torch.tensor([[1.0, 0.0], [0.7, 0.3]]))
    assert torch.allclose(finalize_gates(gate_TK, kept_TK, "before_drop"), torch.tensor([[0.6, 0.0], [0.7, 0.3]]))
