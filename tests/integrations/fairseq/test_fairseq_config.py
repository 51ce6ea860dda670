"""The fairseq adapter in-process: flags -> MoEConfig, clear errors, padding tokens, the gate loss."""
import argparse
from dataclasses import fields

import pytest
import torch

from helpers.fairseq import needs_fairseq

pytestmark = needs_fairseq


@pytest.fixture(scope="module")
def adapter():
    from moe_plugin.integrations.fairseq_moe import config, criterions, layers
    return argparse.Namespace(config=config, criterions=criterions, layers=layers)


def moe_args(adapter, **flags):
    args = argparse.Namespace(activation_fn="relu", **{f.name: f.default for f in fields(adapter.config.MoEArgs)})
    for name, value in flags.items():
        setattr(args, name, value)
    return args


def test_flags_map_onto_one_moe_config(adapter):
    args = moe_args(adapter, moe_expert_count=16, moe_top_k=2, moe_capacity_factor=1.25,
                    moe_eval_capacity_token_fraction=0.25, moe_gating_use_fp32=True,
                    moe_normalize_gate_prob_before_dropping=True, moe_batch_prioritized_routing=True,
                    moe_router="cosine", moe_parallel="auto", moe_overlap_degree="2", moe_a2a="2dh",
                    activation_fn="swish")
    config = adapter.config.moe_config_from_args(args, model_dim=32, ffn_dim=128)
    assert (config.model_dim, config.hidden_size, config.num_experts, config.top_k) == (32, 128, 16, 2)
    assert config.capacity_factor == 1.25
    assert config.eval_capacity_factor == 0.25 * 16 / 2   # capacity = fraction * tokens, as in fairseq's branch
    assert config.fp32_router and config.batch_prioritized_routing
    assert config.normalize_gate == "before_drop" and config.router == "cosine" and config.activation == "silu"
    assert (config.parallel, config.overlap_degree, config.a2a) == ("auto", 2, "2dh")
    assert (config.aux_loss, config.aux_loss_coef) == ("gshard", 1.0)   # weighed by --moe-gate-loss-wt


def test_a_linear_activation_fn_is_the_identity_activation(adapter):
    config = adapter.config.moe_config_from_args(moe_args(adapter, activation_fn="linear"), model_dim=8, ffn_dim=12)
    assert config.activation == "identity"


def test_defaults_follow_fairseqs_moe_branch(adapter):
    config = adapter.config.moe_config_from_args(moe_args(adapter, moe_expert_ffn_dim=48), model_dim=32, ffn_dim=128)
    assert config.hidden_size == 48 and config.num_experts == 8 and config.top_k == 2
    assert config.normalize_gate == "after_drop" and not config.fp32_router and not config.batch_prioritized_routing
    no_eval = moe_args(adapter, moe_eval_capacity_token_fraction=-1.0)
    assert adapter.config.moe_config_from_args(no_eval, 32, 128).eval_capacity_factor is None


def test_the_tuner_flags_take_auto_and_auto_once(adapter):
    per_load = moe_args(adapter, moe_parallel="auto", moe_overlap_degree="auto", moe_a2a="auto", moe_ep_size=2)
    config = adapter.config.moe_config_from_args(per_load, model_dim=32, ffn_dim=64)
    assert (config.parallel, config.overlap_degree, config.a2a) == ("auto", "auto", "auto")
    once = moe_args(adapter, moe_parallel="auto_once", moe_overlap_degree="auto_once", moe_ep_size=2)
    config = adapter.config.moe_config_from_args(once, model_dim=32, ffn_dim=64)
    assert (config.parallel, config.overlap_degree) == ("auto_once", "auto_once")


@pytest.mark.parametrize("flags, message", [
    ({"moe_second_expert_policy": "random"}, "--moe-second-expert-policy 'random' is not supported"),
    ({"moe_router": "topk"}, "--moe-router: MoEConfig.router='topk' is invalid: must be one of"),
    ({"moe_expert_count": 8, "moe_ep_size": 3}, "--moe-ep-size: ep_size=3 cannot hold num_experts=8"),
    ({"moe_parallel": "fast"}, "--moe-parallel 'fast' is invalid: must be an integer >= 0, 'auto' or 'auto_once'"),
    ({"moe_overlap_degree": "0"}, "--moe-overlap-degree: MoEConfig.overlap_degree=0 is invalid"),
    ({"moe_expert_ffn_dim": 0}, "--moe-expert-ffn-dim: MoEConfig.hidden_size=0 is invalid"),
    ({"moe_capacity_factor": "big"}, "--moe-capacity-factor: MoEConfig.capacity_factor='big' is invalid"),
    ({"moe_a2a": "ring"}, "--moe-a2a: MoEConfig.a2a='ring' is invalid"),
    ({"activation_fn": "tanh"}, "--activation-fn 'tanh' is not supported in MoE layers"),
])
def test_a_bad_value_names_the_flag(adapter, flags, message):
    with pytest.raises(ValueError) as error:
        adapter.config.moe_config_from_args(moe_args(adapter, **flags), model_dim=32, ffn_dim=64)
    assert message in str(error.value)


def test_moe_freq_picks_every_nth_layer(adapter):
    indices = adapter.config.moe_layer_indices
    assert indices(moe_args(adapter, moe_freq=2), 6, "decoder") == [1, 3, 5]
    assert indices(moe_args(adapter, moe_freq=1), 3, "encoder") == [0, 1, 2]
    with pytest.raises(ValueError, match="--moe-freq 0 is invalid"):
        indices(moe_args(adapter, moe_freq=0), 6, "decoder")
    with pytest.raises(ValueError, match="--moe-freq 7 with --decoder-layers 6 gives no MoE layer"):
        indices(moe_args(adapter, moe_freq=7), 6, "decoder")


def test_padding_tokens_skip_the_moe_layer(adapter):
    from moe_plugin import MoEConfig
    config = MoEConfig(model_dim=8, hidden_size=16, num_experts=4, top_k=2, capacity_factor=1.0, min_capacity=0)
    ffn = adapter.layers.MoEFFN(config)
    x_TBD = torch.randn(5, 3, 8)
    mask_BT = torch.zeros(3, 5, dtype=torch.bool)
    mask_BT[0, 3:] = True     # right padding
    mask_BT[2, :2] = True     # left padding
    ffn.padding_mask_BT = mask_BT
    y_TBD = ffn(x_TBD)
    keep_TB = ~mask_BT.t()
    assert torch.equal(y_TBD[~keep_TB], torch.zeros(int((~keep_TB).sum()), 8))
    alone_ND = ffn.moe(x_TBD[keep_TB])          # the same layer on the real tokens only
    torch.testing.assert_close(y_TBD[keep_TB], alone_ND)
    assert sum(ffn.moe.stats["tokens_per_expert"]) == 2 * int(keep_TB.sum())


def test_gate_loss_is_weighted_by_sample_size_and_logged(adapter):
    from moe_plugin import MoEConfig, MoELayer
    model = torch.nn.Sequential(MoELayer(MoEConfig(model_dim=8, hidden_size=16, num_experts=4, min_capacity=0)),
                                MoELayer(MoEConfig(model_dim=8, hidden_size=16, num_experts=4, min_capacity=0)))
    model(torch.randn(10, 8))
    logging_output = {}
    loss = adapter.criterions.GateLoss(0.5, "average").add(torch.tensor(3.0), model, 20, logging_output)
    gate = (model[0].aux_loss + model[1].aux_loss) / 2
    torch.testing.assert_close(loss, 3.0 + 0.5 * gate * 20)
    assert logging_output["moe_choices"] == 2 * 10 * 2
    assert sum(logging_output[f"moe_tokens_e{e}"] for e in range(4)) == 40
    with pytest.raises(ValueError, match="--moe-gate-loss-wt -1 is invalid"):
        adapter.criterions.GateLoss(-1, "average")
