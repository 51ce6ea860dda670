"""Where no autograd graph is recorded (no_grad, inference_mode: generation), the fused routing and the fused
experts run their forwards without autograd.Function.apply (host time per generated token): the output, aux loss
and stats must be the einsum reference's, as with a graph."""
import pytest
import torch

from moe_plugin.reference import reference_moe
from helpers.compare import relative_error
from helpers.reference import make_layer


@pytest.mark.parametrize("no_graph", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("options", [
    dict(),                                                     # dropless SwiGLU: the fused routing's path
    dict(capacity_factor=0.5, top_k=3, num_experts=5),          # dropped tokens, k > 2, odd sizes
    dict(bias=True, activation="relu", num_experts=7),
])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_forward_without_graph_matches_reference(no_graph, options, dtype, tolerance):
    values = dict(activation="swiglu", capacity_factor=0.0, bias=False, aux_loss="gshard")
    values.update(options)
    layer = make_layer(dtype, **values)
    x = torch.randn(3, 11, 12, dtype=dtype)     # 33 tokens
    with torch.no_grad():
        y_ref, aux_ref = reference_moe(layer, x)
    with_graph = layer(x)
    aux_graph, stats_graph = layer.aux_loss.detach(), layer.stats
    with no_graph():
        y = layer(x)
        aux = layer.aux_loss
    assert not y.requires_grad and not aux.requires_grad
    assert torch.allclose(y, y_ref, rtol=tolerance, atol=tolerance)
    assert relative_error(aux, aux_ref) <= tolerance
    assert torch.equal(aux, aux_graph)
    assert torch.equal(layer.aux_loss_value, aux_graph.to(layer.aux_loss_value.dtype))   # its persistent fp32 copy
    assert torch.equal(y, with_graph.detach()) and layer.stats == stats_graph


def test_empty_expert_and_one_token_without_graph():
    layer = make_layer(torch.float64, activation="swiglu", capacity_factor=0.0, num_experts=9, top_k=2)
    x = torch.randn(1, 1, 12, dtype=torch.float64)   # one token: seven experts get none
    with torch.no_grad():
        y_ref, _ = reference_moe(layer, x)
        y = layer(x)
    assert torch.allclose(y, y_ref, rtol=1e-10, atol=1e-10)
    assert sum(layer.stats["tokens_per_expert"]) == 2 and layer.stats["tokens_per_expert"].count(0) == 7
