"""fairseq per-layer routing metrics (issue 44; integrations/fairseq_moe/criterions.py): moe_cross_entropy's logging
outputs, summed by fairseq's own aggregation (two ranks' outputs joined as fairseq gathers them, 2 updates of 2
micro-batches), give moe/<layer>/<metric> and moe/all equal to numbers recomputed from each layer's routing as each
forward ran (tests/helpers/routing_reference.py); a fairseq-train run logs them per layer in its log lines, equal to
those numbers recomputed from the forwards of each log interval as they ran inside the run (and the whole-model
moe_dropped likewise), and the same values in its TensorBoard output (--tensorboard-logdir). The routing alarm
(--moe-routing-alarm-*): a collapsed router warns once per layer at the set log interval, through Python's logging,
a balanced run and --no-moe-routing-alarm never; bad flags are one-line errors."""
import copy
import math
import json
import types

import pytest
import torch

from helpers.fairseq import CPU, TINY_LM, needs_fairseq, train_recording_routing, user_dir
from helpers.routing_reference import add, expected, record_forwards, window_expected

pytestmark = needs_fairseq
VOCAB, D = 13, 16


def tiny_model():
    from fairseq.models import BaseFairseqModel

    from moe_plugin import MoELayer

    class Model(BaseFairseqModel):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, D)
            self.blocks = torch.nn.ModuleList([
                MoELayer(model_dim=D, hidden_size=24, num_experts=4, top_k=2, capacity_factor=1.0, z_loss_coef=0.01),
                MoELayer(model_dim=D, hidden_size=24, num_experts=4, top_k=1, capacity_factor=0.0, router="sigmoid",
                         expert_bias_update_rate=0.05)])
            self.out = torch.nn.Linear(D, VOCAB)

        def forward(self, src_tokens):
            h = self.embed(src_tokens)
            for block in self.blocks:
                h = h + block(h)
            return self.out(h), None

        def get_targets(self, sample, net_output):
            return sample["target"]

        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return torch.log_softmax(net_output[0], -1) if log_probs else torch.softmax(net_output[0], -1)
    return Model()


def test_fairseq_aggregation_gives_each_layers_routing():
    from fairseq.logging import metrics

    from moe_plugin import MoELayer
    from moe_plugin.integrations.fairseq_moe.criterions import MoECrossEntropyCriterion
    torch.manual_seed(torch.randint(1 << 30, ()).item())
    ranks = [tiny_model()]
    ranks[0].blocks[1].router.expert_bias_E.copy_(torch.randn(4))      # a spread to read
    ranks.append(copy.deepcopy(ranks[0]))        # data parallel: the same weights, other data
    task = types.SimpleNamespace(target_dictionary=types.SimpleNamespace(pad=lambda: -100))   # no padding
    criteria = [MoECrossEntropyCriterion(task, False) for _ in ranks]
    forwards = {}          # both ranks' forwards: fairseq sums their logging outputs
    for model in ranks:
        record_forwards(model, forwards)
    with metrics.aggregate(new_root=True) as aggregate:
        for update in range(2):
            logs = []
            for model, criterion in zip(ranks, criteria):
                for micro in range(2):
                    tokens = torch.randint(VOCAB, (3, 5 + micro))
                    sample = {"net_input": {"src_tokens": tokens}, "target": tokens.roll(1, 1),
                              "ntokens": tokens.numel()}
                    loss, _, log = criterion(model, sample)
                    loss.backward()
                    logs.append(log)
            MoECrossEntropyCriterion.reduce_metrics(logs)
        values = aggregate.get_smoothed_values()
    want = {}
    for name, layer in ranks[0].named_modules():
        if isinstance(layer, MoELayer):
            sums = {}
            for one in forwards[name]:
                sums = add(sums, one)
            want[name] = expected(layer, sums)
            want[name].pop("tokens_per_expert")
            for key, value in want[name].items():
                assert values[f"moe/{name}/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key)
    assert set(want["blocks.0"]) == {"max_load", "max_rank_load", "experts_without_tokens", "dropped_fraction",
                                     "capacity_used", "router_entropy", "balance_loss", "z_loss"}
    assert "expert_bias_spread" in want["blocks.1"] and want["blocks.1"]["expert_bias_spread"] > 0
    assert values["moe/all/max_load"] == max(w["max_load"] for w in want.values())
    assert not any(key.startswith("_moe") for key in values)       # the sums stay hidden


@pytest.mark.timeout(600)
def test_fairseq_train_logs_each_layer(tmp_path, corpus, fresh_seed):
    """One fairseq-train run (2 log intervals of 2 updates of 2 micro-batches) with each MoE layer's training
    forwards recorded inside it (helpers.fairseq.train_recording_routing: a pre-hook on each layer of the model
    moe_cross_entropy watches computes the reference sums from the layer's input and its router's weights as the
    forward runs): each train_inner line's moe/<layer>/<metric>, moe/all and moe_dropped equal the reference of that
    interval's forwards, its TensorBoard output holds the same values, and the alarm (min share 0.99, 2 windows)
    warns at the second interval about exactly the experts the reference starves in both intervals."""
    import pickle

    from moe_plugin.routing_monitor.metrics import METRICS
    args = [corpus["lm"], "--user-dir", user_dir(), "--task", "language_modeling", *TINY_LM, "--criterion",
            "moe_cross_entropy", "--optimizer", "adam", "--lr", "0.005", "--dropout", "0", "--tokens-per-sample",
            "64", "--sample-break-mode", "complete", "--batch-size", "4", "--max-update", "4", "--update-freq", "2",
            "--save-dir", str(tmp_path / "ckpt"), "--no-save", *CPU, "--seed", str(fresh_seed), "--log-format",
            "json", "--log-interval", "2", "--moe-routing-alarm-min-share", "0.99", "--moe-routing-alarm-windows", "2",
            "--tensorboard-logdir", str(tmp_path / "tensorboard")]
    log = train_recording_routing(args, str(tmp_path), tmp_path / "forwards.pkl", timeout=500).stdout
    with open(tmp_path / "forwards.pkl", "rb") as file:
        forwards, configs = pickle.load(file)
    layers = {name: types.SimpleNamespace(config=config) for name, config in configs.items()}   # what expected() reads
    assert len(layers) == 2 and all(len(forwards[name]) == 8 for name in layers), {k: len(v) for k, v in
                                                                                    forwards.items()}
    lines = [json.loads(line[line.index("{"):]) for line in log.splitlines() if "train_inner" in line and "{" in line]
    assert [int(line["num_updates"]) for line in lines] == [2, 4], log[-3000:]
    per_interval = 4           # 2 updates of 2 micro-batches
    wants = [window_expected(layers, forwards, window, per_interval) for window in range(2)]
    loads = [{name: [sum(one["load"][e] for one in forwards[name][w * per_interval:(w + 1) * per_interval])
                     for e in range(4)] for name in layers} for w in range(2)]
    for line, want, window in zip(lines, wants, range(2)):
        logged = sorted(key for key in line if key.startswith("moe/") and key != "moe/alarm_layers")
        assert logged == sorted([f"moe/{name}/{key}" for name in layers for key in want[name]] +
                                [f"moe/all/{key}" for key in METRICS if any(key in w for w in want.values())])
        for name, metrics in want.items():
            for key, value in metrics.items():      # the log line's format_stat keeps 6 significant digits
                assert float(line[f"moe/{name}/{key}"]) == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        assert float(line["moe/all/max_load"]) == pytest.approx(max(w["max_load"] for w in want.values()), rel=1e-5)
        assert float(line["moe/all/dropped_fraction"]) == pytest.approx(
            sum(w["dropped_fraction"] for w in want.values()) / 2, rel=1e-5, abs=1e-6)
        part = [one for name in layers for one in forwards[name][window * per_interval:(window + 1) * per_interval]]
        dropped = 1 - sum(sum(one["kept"]) for one in part) / sum(one["choices"] for one in part)   # the whole model's
        assert float(line["moe_dropped"]) == pytest.approx(dropped, abs=1e-4)          # logged to 4 decimals
    # the alarm: an expert under 99% of the mean load in both intervals, or drops over 20% in both
    expected_alarms = []
    for name in layers:
        shares = [[n * 4 / sum(load[name]) for n in load[name]] for load in loads]
        starved = [e for e in range(4) if shares[0][e] < 0.99 and shares[1][e] < 0.99]
        dropping = all(want[name]["dropped_fraction"] > 0.2 for want in wants)
        trouble = []
        if starved:
            named = ", ".join(f"{e} ({shares[1][e]:.1%})" for e in starved)
            trouble.append(f"experts {named} got under 99% of the mean load (busiest expert "
                           f"{wants[1][name]['max_load']:.2f}x the mean)")
        if dropping:
            trouble.append(f"dropped fraction {wants[1][name]['dropped_fraction']:.1%} over 20%")
        if trouble:
            expected_alarms.append(f"moe_plugin routing alarm: MoE layer {name}: {'; '.join(trouble)}, in each of "
                                   f"the last 2 logging windows")
    assert [float(line["moe/alarm_layers"]) for line in lines] == [0, len(expected_alarms)]
    alarms = [line for line in log.splitlines() if "routing alarm: MoE layer" in line]
    assert len(alarms) == len(expected_alarms) and all(want in line for want, line in zip(expected_alarms, alarms)), \
        (alarms, expected_alarms)
    order = [line for line in log.splitlines() if "routing alarm: MoE layer" in line or "train_inner" in line]
    assert "train_inner" in order[0] and order[1:-1] == alarms and "train_inner" in order[-1]   # at the 2nd interval
    # fairseq's TensorBoard output holds the same per-layer metrics at the same updates
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "train_inner"))
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.startswith("moe/")]
    assert sorted(tags) == sorted(key for key in lines[0] if key.startswith("moe/")), tags
    for tag in tags:
        written = [(e.step, e.value) for e in events.Scalars(tag)]
        assert written == [(int(line["num_updates"]), pytest.approx(float(line[tag]), rel=1e-5, abs=1e-6))
                           for line in lines], tag


def alarm_model(case):
    """Two top-1 MoE layers on the embedding (one dropless, one at capacity factor 1.0). "collapsed": every router
    sends every token to expert 3; "balanced": token v goes to expert v % 4 (an embedding and router built so)."""
    from fairseq.models import BaseFairseqModel

    from moe_plugin import MoELayer

    class Model(BaseFairseqModel):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, D)
            self.blocks = torch.nn.ModuleList([
                MoELayer(model_dim=D, hidden_size=8, num_experts=4, top_k=1, capacity_factor=0.0),
                MoELayer(model_dim=D, hidden_size=8, num_experts=4, top_k=1, capacity_factor=1.0, min_capacity=0)])
            self.out = torch.nn.Linear(D, VOCAB)

        def forward(self, src_tokens):
            h = self.embed(src_tokens)
            return self.out(sum(block(h) for block in self.blocks)), None

        def get_targets(self, sample, net_output):
            return sample["target"]

        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return torch.log_softmax(net_output[0], -1)
    model = Model()
    with torch.no_grad():
        if case == "balanced":
            model.embed.weight[:, :4] = 5.0 * torch.eye(4)[torch.arange(VOCAB) % 4]
        for block in model.blocks:
            block.router.weight_ED.requires_grad_(False).zero_()
            if case == "balanced":
                block.router.weight_ED[:, :4] = torch.eye(4)
            else:
                block.router.fixed_bias = True
                block.router.expert_bias_E[3] = 10.0
    return model


@pytest.fixture
def fairseq_metrics():
    from fairseq.logging import metrics
    metrics.reset()        # fairseq's meters are global: this test's own, as fairseq-train's main starts them
    yield metrics
    metrics.reset()


def run_log_intervals(metrics, model, criterion, intervals, caplog, updates=2, micro_batches=2):
    """fairseq_cli/train.py's loop: each update under the epoch's "train" and the interval's "train_inner" meters,
    its logging outputs reduced in the trainer's per-update aggregation (read at once, as the trainer does), the
    interval's values read once and reset; here each interval ends an epoch too (its "train" values read and reset).
    Returns each interval's values, the alarm's warnings logged in it, and each forward's token count."""
    lines, warnings, tokens = [], [], []
    for _ in range(intervals):
        caplog.clear()
        for _ in range(updates):
            with metrics.aggregate("train"), metrics.aggregate("train_inner"):
                logs = []
                for micro in range(micro_batches):
                    src = torch.randint(VOCAB, (3, 5 + micro))
                    sample = {"net_input": {"src_tokens": src}, "target": src, "ntokens": src.numel()}
                    loss, _, log = criterion(model, sample)
                    loss.backward()
                    logs.append(log)
                    tokens.append(src.numel())
                with metrics.aggregate() as update:
                    type(criterion).reduce_metrics(logs)
                    update.get_smoothed_values()
        lines.append(metrics.get_smoothed_values("train_inner"))
        metrics.reset_meters("train_inner")
        metrics.get_smoothed_values("train")
        metrics.reset_meters("train")
        warnings.append([r.getMessage() for r in caplog.records if "routing alarm" in r.getMessage()])
    return lines, warnings, tokens


@pytest.mark.parametrize("case", ["collapsed", "balanced", "collapsed_alarm_off"])
def test_fairseq_alarm_fires_once_per_layer_at_the_set_interval(case, fairseq_metrics, caplog):
    from moe_plugin.integrations.fairseq_moe.criterions import MoECrossEntropyCriterion
    model = alarm_model("balanced" if case == "balanced" else "collapsed")
    task = types.SimpleNamespace(target_dictionary=types.SimpleNamespace(pad=lambda: -100))
    criterion = MoECrossEntropyCriterion(task, False, moe_routing_alarm_windows=2,
                                         no_moe_routing_alarm=case == "collapsed_alarm_off")
    with caplog.at_level("WARNING"):
        lines, warnings, tokens = run_log_intervals(fairseq_metrics, model, criterion, 4, caplog)
    if case == "collapsed_alarm_off":
        assert warnings == [[]] * 4 and not any("moe/alarm_layers" in line for line in lines)
        return
    if case == "balanced":
        assert warnings == [[]] * 4 and [line["moe/alarm_layers"] for line in lines] == [0] * 4
        # balanced indeed: the collapsed router's is 4.0; these random tokens' busiest expert gave 1.09-1.58 over 10
        # seeds, and once 2.18 (MOE_TEST_SEED=938268401)
        assert all(line["moe/blocks.0/max_load"] < 3 for line in lines), [line["moe/blocks.0/max_load"] for line in lines]
        return
    assert [len(w) for w in warnings] == [0, 2, 0, 0]        # at the 2nd log interval, once per layer
    assert [line["moe/alarm_layers"] for line in lines] == [0, 2, 2, 2]
    starved = "experts 0 (0.0%), 1 (0.0%), 2 (0.0%) got under 10% of the mean load (busiest expert 4.00x the mean)"
    per_interval = tokens[:4]            # each interval's forwards (both intervals alike)
    dropped = 1 - sum(math.ceil(t / 4) for t in per_interval) / sum(per_interval)   # expert 3 keeps T/4 a forward
    assert warnings[1][0] == (f"moe_plugin routing alarm: MoE layer blocks.0: {starved}, in each of the last 2 "
                              f"logging windows")
    assert warnings[1][1] == (f"moe_plugin routing alarm: MoE layer blocks.1: {starved}; dropped fraction "
                              f"{dropped:.1%} over 20%, in each of the last 2 logging windows")


def test_fairseq_alarm_flags(fairseq_metrics):
    import argparse

    from fairseq.dataclass.utils import gen_parser_from_dataclass

    from moe_plugin.integrations.fairseq_moe.config import RoutingAlarmArgs
    from moe_plugin.integrations.fairseq_moe.criterions import (MoECrossEntropyCriterion,
                                                                MoELabelSmoothedCrossEntropyCriterion)
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, RoutingAlarmArgs())
    task = types.SimpleNamespace(target_dictionary=types.SimpleNamespace(pad=lambda: -100))

    def build(cls, *flags):
        args = parser.parse_args(list(flags))
        args.sentence_avg, args.label_smoothing = False, 0.1
        return cls.build_criterion(args, task).gate_loss.alarm
    alarm = build(MoECrossEntropyCriterion, "--moe-routing-alarm-min-share", "0.3", "--moe-routing-alarm-windows", "5")
    assert (alarm.min_share, alarm.max_dropped, alarm.windows) == (0.3, 0.2, 5)
    alarm = build(MoELabelSmoothedCrossEntropyCriterion, "--moe-routing-alarm-max-dropped", "0.05")
    assert (alarm.min_share, alarm.max_dropped, alarm.windows) == (0.1, 0.05, 3)
    assert build(MoECrossEntropyCriterion, "--no-moe-routing-alarm") is None
    for flags, words in [(("--moe-routing-alarm-min-share", "1.5"), "--moe-routing-alarm-min-share 1.5 is invalid: "
                                                                      "routing alarm: min_share must be in [0, 1)"),
                         (("--moe-routing-alarm-windows", "0"), "--moe-routing-alarm-windows 0 is invalid")]:
        with pytest.raises(ValueError) as error:
            build(MoECrossEntropyCriterion, *flags)
        assert words in str(error.value) and "\n" not in str(error.value)


def test_a_training_forward_reads_nothing_from_the_device():
    """The criterion's training forward (the model's, the task loss, the gate loss and every MoE statistic it logs)
    runs no op that waits on the device; reduce_metrics reads the update's sums; evaluation logs the same keys."""
    from helpers.host_syncs import HostSyncs

    from moe_plugin.integrations.fairseq_moe.criterions import MoECrossEntropyCriterion
    model = tiny_model()
    task = types.SimpleNamespace(target_dictionary=types.SimpleNamespace(pad=lambda: -100))
    criterion = MoECrossEntropyCriterion(task, False)
    tokens = torch.randint(VOCAB, (3, 6))
    sample = {"net_input": {"src_tokens": tokens}, "target": tokens.roll(1, 1), "ntokens": tokens.numel()}
    criterion(model, sample)         # the first forward builds the monitor
    with HostSyncs() as record:
        _, _, log = criterion(model, sample)
    assert record.seen == []
    assert log["moe_choices"] == 18 * 2 + 18 and any(key.startswith("_moe/blocks.1/") for key in log)
    model.eval()
    with torch.no_grad():
        _, _, evaluated = criterion(model, sample)
    assert {key for key in log if key.startswith("moe_")} == {key for key in evaluated if key.startswith("moe_")}
    assert evaluated["moe_choices"] == 18 * 2 + 18 and not any(key.startswith("_moe/") for key in evaluated)
