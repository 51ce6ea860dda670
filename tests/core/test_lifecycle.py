"""copy.deepcopy after a forward, and meta-device construction -> to_empty -> reset_parameters."""
import copy

import pytest
import torch
from torch import nn

from moe_plugin import MoEConfig, MoELayer, aux_loss
from moe_plugin.train.models import ModelConfig, TransformerLM
from helpers.reference import make_layer

OPTIONS = [dict(), dict(router="cosine", activation="swiglu", bias=False), dict(router="sigmoid", top_k=3),
           dict(router="sigmoid", num_groups=2, topk_groups=1, expert_bias_update_rate=1e-3, shared_hidden_size=16,
                shared_gate=True)]


@pytest.mark.parametrize("options", OPTIONS)
def test_deepcopy_after_a_training_forward(options):
    layer = make_layer(**options)
    x = torch.randn(2, 17, 12, dtype=torch.float64)
    layer(x)
    assert layer.aux_loss.requires_grad
    twin = copy.deepcopy(layer)
    assert torch.equal(twin.aux_loss, layer.aux_loss.detach()) and twin.stats == layer.stats
    assert torch.equal(twin(x), layer(x))
    twin.experts.w1_EDH.data.add_(1.0)      # a copy, not shared storage
    assert not torch.equal(twin.experts.w1_EDH, layer.experts.w1_EDH)


def test_deepcopy_of_a_model_after_forward_and_backward():
    model = TransformerLM(ModelConfig(dim=16, layers=2, heads=2, seq_len=8, ffn_hidden=32),
                          MoEConfig(model_dim=16, hidden_size=24, num_experts=4), 50)
    tokens = torch.randint(0, 50, (2, 8))
    (model(tokens).sum() + aux_loss(model)).backward()
    model(tokens)                          # a forward whose graph is still alive, as before an EMA copy
    twin = copy.deepcopy(model)
    assert torch.equal(twin(tokens), model(tokens))


def _all_parameters_and_buffers(module: nn.Module):
    return dict(module.named_parameters()) | dict(module.named_buffers())


@pytest.mark.parametrize("options", OPTIONS)
def test_meta_construction_then_to_empty_then_reset_parameters(options):
    config = MoEConfig(**{**dict(model_dim=12, hidden_size=20, num_experts=4, top_k=2), **options})
    with torch.device("meta"):
        layer = MoELayer(config)
    assert all(t.is_meta for t in _all_parameters_and_buffers(layer).values())
    layer.to_empty(device="cpu")
    torch.manual_seed(7)
    layer.reset_parameters()
    torch.manual_seed(7)
    expected = MoELayer(config)            # the same draws as a plain construction after the same seed
    got, want = _all_parameters_and_buffers(layer), _all_parameters_and_buffers(expected)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # every submodule with parameters resets itself
    for name, module in layer.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert hasattr(module, "reset_parameters"), name
    x = torch.randn(9, 12)
    assert torch.equal(layer(x), expected(x))


def test_reset_parameters_redraws():
    layer = make_layer()
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.reset_parameters()
    assert all(not torch.equal(before[n], p) for n, p in layer.named_parameters() if p.numel() > 1)
