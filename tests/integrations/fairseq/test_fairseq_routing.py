"""fairseq flags of the modern routers (and --moe-recompute), the seq aux loss over padded batches, and the
balancing bias updated once per fairseq update (all its micro-batches)."""
import argparse
import os
from dataclasses import fields

import pytest
import torch

from helpers.fairseq import CPU, TINY_LM, fairseq, needs_fairseq, user_dir

pytestmark = needs_fairseq


@pytest.fixture(scope="module")
def adapter():
    from moe_plugin.integrations.fairseq_moe import config, layers, models
    return argparse.Namespace(config=config, layers=layers, models=models)


def moe_args(adapter, **flags):
    args = argparse.Namespace(activation_fn="relu", **{f.name: f.default for f in fields(adapter.config.MoEArgs)})
    for name, value in flags.items():
        setattr(args, name, value)
    return args


def test_flags_map_onto_the_config(adapter):
    args = moe_args(adapter, moe_expert_count=16, moe_top_k=4, moe_router="sigmoid", moe_aux_loss="seq",
                    moe_expert_bias_update_rate=0.002, moe_num_groups=4, moe_topk_groups=2, moe_route_scale=2.5,
                    moe_shared_hidden_size=24, moe_shared_gate=True, moe_recompute="experts")
    config = adapter.config.moe_config_from_args(args, model_dim=32, ffn_dim=64)
    assert (config.aux_loss, config.expert_bias_update_rate, config.num_groups, config.topk_groups,
            config.route_scale, config.shared_hidden_size, config.shared_gate, config.recompute) == \
        ("seq", 0.002, 4, 2, 2.5, 24, True, "experts")
    default = adapter.config.moe_config_from_args(moe_args(adapter), model_dim=32, ffn_dim=64)
    assert (default.aux_loss, default.expert_bias_update_rate, default.num_groups, default.shared_hidden_size,
            default.recompute) == ("gshard", 0.0, 1, 0, "none")


@pytest.mark.parametrize("flags, message", [
    ({"moe_aux_loss": "seqwise"}, "--moe-aux-loss: MoEConfig.aux_loss='seqwise' is invalid"),
    ({"moe_expert_bias_update_rate": -1.0}, "--moe-expert-bias-update-rate: MoEConfig.expert_bias_update_rate=-1.0"),
    ({"moe_num_groups": 3}, "--moe-num-groups: MoEConfig.num_groups=3 is invalid: must divide num_experts=8"),
    ({"moe_num_groups": 2, "moe_topk_groups": 3}, "--moe-topk-groups: MoEConfig.topk_groups=3 is invalid"),
    ({"moe_num_groups": 4, "moe_topk_groups": 1, "moe_top_k": 3}, "--moe-top-k: MoEConfig.top_k=3 is invalid"),
    ({"moe_route_scale": 0.0}, "--moe-route-scale: MoEConfig.route_scale=0.0 is invalid: must be a finite number > 0"),
    ({"moe_shared_hidden_size": -2}, "--moe-shared-hidden-size: MoEConfig.shared_hidden_size=-2 is invalid"),
    ({"moe_shared_gate": True}, "--moe-shared-gate: MoEConfig.shared_gate=True is invalid"),
    ({"moe_recompute": "all"}, "--moe-recompute: MoEConfig.recompute='all' is invalid"),
])
def test_a_bad_value_names_the_flag(adapter, flags, message):
    with pytest.raises(ValueError) as error:
        adapter.config.moe_config_from_args(moe_args(adapter, **flags), model_dim=32, ffn_dim=64)
    assert message in str(error.value)


@pytest.mark.parametrize("padded", [False, True])
def test_seq_aux_loss_treats_each_batch_column_as_a_sequence(adapter, padded):
    from moe_plugin import MoEConfig
    config = MoEConfig(model_dim=8, hidden_size=16, num_experts=4, top_k=2, aux_loss="seq", aux_loss_coef=1.0,
                       router="sigmoid")
    ffn = adapter.layers.MoEFFN(config).double()
    x_TBD = torch.randn(6, 3, 8, dtype=torch.float64)
    mask_BT = torch.zeros(3, 6, dtype=torch.bool)
    if padded:
        mask_BT[0, 4:] = True
        mask_BT[2, :1] = True
    ffn.padding_mask_BT = mask_BT
    ffn(x_TBD)
    per_column = [ffn.moe.router(x_TBD[~mask_BT[b], b]).aux_loss for b in range(3)]   # one sequence each
    assert float(ffn.moe.aux_loss) == pytest.approx(float(sum(per_column) / 3), rel=1e-12)


def test_bias_updates_once_per_update_from_all_micro_batches(adapter):
    from fairseq.models import BaseFairseqModel

    from moe_plugin import MoEConfig, MoELayer

    class Model(adapter.models._UpdatesExpertBias, BaseFairseqModel):
        def __init__(self):
            super().__init__()
            self.moe = MoELayer(MoEConfig(model_dim=8, hidden_size=8, num_experts=4, top_k=1,
                                          expert_bias_update_rate=0.1))
    model = Model()
    bias = model.moe.router.expert_bias_E
    expected = torch.zeros(4)
    for update, micro_batches in [(0, 2), (1, 3), (2, 1)]:
        counts = torch.zeros(4)
        for _ in range(micro_batches):
            model.set_num_updates(update)           # what fairseq's task.train_step does first
            assert torch.equal(bias, expected)      # between micro-batches of one update the bias stays
            x = torch.randn(20, 8) + torch.arange(8.0)
            counts += torch.bincount(model.moe.router(x).expert_TK[:, 0], minlength=4)
            model.moe(x)
        expected = expected + 0.1 * torch.sign(counts.mean() - counts)
    model.set_num_updates(3)
    assert torch.allclose(bias, expected, atol=1e-6, rtol=0) and float(bias.abs().max()) > 0
    assert model.moe.router.load_E is None


def test_a_global_balance_loss_counts_over_each_update_s_micro_batches(adapter):
    """fairseq's update count marks the steps (moe_plugin.begin_step): a global balance loss counts the tokens of
    the update's micro-batches so far, anew at each update."""
    from fairseq.models import BaseFairseqModel

    from moe_plugin import MoEConfig, MoELayer

    class Model(adapter.models._UpdatesExpertBias, BaseFairseqModel):
        def __init__(self):
            super().__init__()
            self.moe = MoELayer(MoEConfig(model_dim=8, hidden_size=8, num_experts=4, top_k=2, aux_loss="switch",
                                          aux_loss_scope="global"))
    model = Model()
    for update, sizes in [(0, [5, 3]), (1, [7]), (2, [2, 6, 1])]:
        for seen, size in enumerate(sizes):
            model.set_num_updates(update)
            model.moe(torch.randn(size, 8))
            assert model.moe.router.step_counts_E1[-1] == sum(sizes[:seen + 1])


@pytest.mark.timeout(900)
def test_fairseq_train_with_the_new_flags(tmp_path, corpus):
    lm = corpus["lm"]
    save_dir = str(tmp_path / "ckpt")
    flags = ["--moe-expert-count", "8", "--moe-top-k", "4", "--moe-router", "sigmoid", "--moe-num-groups", "4",
             "--moe-topk-groups", "2", "--moe-route-scale", "2.0", "--moe-expert-bias-update-rate", "0.01",
             "--moe-shared-hidden-size", "16", "--moe-shared-gate", "--moe-aux-loss", "seq", "--update-freq", "2",
             "--moe-recompute", "experts"]
    args = [lm, "--user-dir", user_dir(), "--task", "language_modeling", *TINY_LM, *flags,
            "--criterion", "moe_cross_entropy", "--optimizer", "adam", "--lr", "0.005", "--dropout", "0",
            "--tokens-per-sample", "64", "--sample-break-mode", "complete", "--batch-size", "4",
            "--max-update", "6", "--save-dir", save_dir, "--no-epoch-checkpoints", *CPU]
    fairseq("train", args, cwd=str(tmp_path), timeout=800)
    checkpoint = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=False)
    assert checkpoint["cfg"]["model"].moe_recompute == "experts"
    state = checkpoint["model"]
    biases = [v for k, v in state.items() if k.endswith("router.expert_bias_E")]
    assert len(biases) == 2 and any(float(b.abs().max()) > 0 for b in biases)
    # 5 updates applied by the time update 6 ends (each update's bias step comes at the next update's start)
    for bias in biases:
        steps = bias / 0.01
        assert float(steps.abs().max()) <= 5 + 1e-4 and torch.allclose(steps, steps.round(), atol=1e-3)
    assert any(k.endswith("shared_expert.gate_D") for k in state)
