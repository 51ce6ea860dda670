"""The transformer LM of `moe-plugin train`."""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer, aux_loss
from moe_plugin.train.models import ModelConfig, TransformerLM


def make_model(capacity_factor=1.0, **overrides):
    cfg = ModelConfig(**{"dim": 16, "layers": 4, "heads": 2, "seq_len": 12, "ffn_hidden": 24, **overrides})
    moe = MoEConfig(model_dim=cfg.dim, hidden_size=20, num_experts=4, capacity_factor=capacity_factor)
    return TransformerLM(cfg, moe, vocab_size=256)


@pytest.mark.parametrize("moe_every, moe_blocks", [(1, [0, 1, 2, 3]), (2, [1, 3]), (3, [2]), (5, [])])
def test_moe_every_places_the_moe_blocks(moe_every, moe_blocks):
    model = make_model(moe_every=moe_every)
    assert [i for i, block in enumerate(model.blocks) if isinstance(block.ffn, MoELayer)] == moe_blocks
    assert len(model.moe_layers()) == len(moe_blocks)


def test_logits_are_causal_and_aux_loss_flows():
    model = make_model(capacity_factor=0.0).double()  # dropless: with a capacity, drops depend on the whole batch
    x_BS = torch.randint(0, 256, (3, 12))
    logits_BSV = model(x_BS)
    assert logits_BSV.shape == (3, 12, 256)
    changed_BS = x_BS.clone()
    changed_BS[:, 7:] = torch.randint(0, 256, (3, 5))
    assert torch.allclose(model(changed_BS)[:, :7], logits_BSV[:, :7], atol=1e-12, rtol=0)
    assert aux_loss(model) > 0


def test_tied_and_untied_output():
    tied, untied = make_model(tie_embeddings=True), make_model(tie_embeddings=False)
    assert tied.head is None and untied.head.weight.shape == (256, 16)
    assert sum(p.numel() for p in untied.parameters()) == sum(p.numel() for p in tied.parameters()) + 256 * 16


def test_too_long_input_and_mismatched_moe_dim():
    with pytest.raises(ValueError, match="longer than model.seq_len=12"):
        make_model()(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match="model_dim=8 must equal model.dim=16"):
        TransformerLM(ModelConfig(dim=16, heads=2), MoEConfig(model_dim=8, hidden_size=8), 256)
