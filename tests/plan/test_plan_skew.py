"""`moe-plugin plan --skew` (issue 55): the busiest expert-parallel rank's rows charged to the step, with and without
replicas of hot experts, against hand counts; a routing report as the skew; its errors."""
import json

import pytest
import torch

from moe_plugin import MoEConfig, cli, train
from moe_plugin.parallel import cost_model
from moe_plugin.plan import plan_experiment
from moe_plugin.plan.devices import device
from moe_plugin.plan.skew import read_skew, skewed_load

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.hidden_size=48", "moe.num_experts=4", "train.batch_size=4", "parallel.ep_size=2",
        "moe.capacity_factor=0.0"]


def test_a_number_is_rank_0s_share():
    for E, W, skew in ((16, 4, 2.2), (4, 2, 1.5), (64, 8, 3.0)):
        counts_WE = skewed_load(MoEConfig(model_dim=8, hidden_size=8, num_experts=E, ep_size=W), skew)
        rows_W = counts_WE.sum(0).view(W, E // W).sum(1).double()
        assert float(rows_W.max() / rows_W.mean()) == pytest.approx(skew, rel=1e-3)
        assert int(rows_W.argmax()) == 0


def test_the_busiest_rank_is_charged_by_hand():
    # 2 gloo ranks, ep 2, E 4, dropless, 4 x 32 tokens, top-2: 256 rows a rank, balanced; --skew 1.5 puts 0.75 of
    # every rank's rows on rank 0's experts: rank 0 computes and receives 1.5 x the balanced rows
    balanced = plan_experiment(train.load_config(None, TINY), 2, 2, device("cpu"))
    skewed = plan_experiment(train.load_config(None, TINY), 2, 2, device("cpu"), read_skew("1.5"))
    (layer_skew,) = skewed.skews
    assert layer_skew.before == pytest.approx(1.5, rel=1e-3) and layer_skew.max_rank_load == layer_skew.before
    factor = layer_skew.max_rank_load
    experts = 3 * 2 * 256 * 32 * 48 * 2 / 0.028e12          # the expert GEMMs, forward + backward, balanced
    assert skewed.step.compute - balanced.step.compute == pytest.approx((factor - 1) * experts)
    assert skewed.step.all_to_all == pytest.approx(4 * (1750e-6 + factor * 256 * 32 * 4 / 2 / 0.4e9))
    assert skewed.step.replicas == 0.0

    # one copy: rank 0's hotter expert copied to rank 1 levels the ranks; its weights (relu, biases: 2 x 32 x 48 +
    # 48 + 32 floats) go out and their gradients come back, one call each way
    copied = plan_experiment(train.load_config(None, [*TINY, "moe.redundant_experts=1"]), 2, 2, device("cpu"),
                             read_skew("1.5"))
    (layer_skew,) = copied.skews
    assert layer_skew.copies == 1 and layer_skew.max_rank_load == pytest.approx(1.0, abs=1e-3)
    expert_bytes = (2 * 32 * 48 + 48 + 32) * 4
    assert copied.step.replicas == pytest.approx(2 * (1750e-6 + expert_bytes / 0.4e9))
    assert copied.step.replicas == cost_model.replica_seconds(1, expert_bytes, 2, 2, cost_model.GLOO_HERE)
    assert copied.step.compute < skewed.step.compute and copied.step.all_to_all < skewed.step.all_to_all
    # "auto": at these sizes a copy's traffic costs more than the rows it moves
    auto = plan_experiment(train.load_config(None, [*TINY, "moe.redundant_experts=auto"]), 2, 2, device("cpu"),
                           read_skew("1.5"))
    assert auto.skews[0].copies == 0 and auto.step.seconds == pytest.approx(skewed.step.seconds)


def test_a_routing_report_is_a_skew(tmp_path, capsys):
    report = tmp_path / "routing.json"
    report.write_text(json.dumps({"layers": {"blocks.0.ffn": {"experts": 4, "load": [700, 100, 100, 100]}}}))
    plan = plan_experiment(train.load_config(None, TINY), 2, 2, device("cpu"), read_skew(str(report)))
    assert plan.skews[0].before == pytest.approx(800 / 500)
    assert cli.main(["plan", *TINY, "--world-size", "2", "--skew", str(report)]) == 0
    assert "(--skew): max_rank_load 1.60 -> 1.60 with 0 copies" in capsys.readouterr().out
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"layers": {"a": {"load": [1, 2, 3]}}}))
    with pytest.raises(ValueError, match="a layer of 3 experts, the plan's MoE layer 4"):
        plan_experiment(train.load_config(None, TINY), 2, 2, device("cpu"), read_skew(str(wrong)))


@pytest.mark.parametrize("skew, message", [
    ("0.5", "--skew='0.5' is invalid: must be a number >= 1"),
    ("nope.json", "--skew='nope.json' is invalid: not a number >= 1 and no such file"),
    ("3", "--skew=3.0 is invalid for an MoE layer at ep_size=2: max_rank_load is at most ep_size"),
])
def test_errors_are_one_line(capsys, skew, message):
    assert cli.main(["plan", *TINY, "--world-size", "2", "--skew", skew]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    torch.manual_seed(0)
