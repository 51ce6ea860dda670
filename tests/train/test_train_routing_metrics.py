"""`moe-plugin train` routing metrics (issue 44): each record of metrics.jsonl and TensorBoard holds
moe/<layer>/<metric> per MoE layer (plus moe/all), equal to numbers recomputed from each layer's routing as each
forward ran (tests/helpers/routing_reference.py); the expert-load heatmap is drawn from the records; a collapsed
router raises the alarm once on stderr, and log.routing_alarm=false silences it, a router balanced by construction
never raises it; bad alarm settings are one line."""
import importlib.util

import pytest
import torch

from helpers.routing_reference import record_forwards, window_expected
from helpers.train import TINY, run
from moe_plugin import MoELayer, train
from moe_plugin.train import plots


STEPS, EVERY = 4, 2


def test_records_hold_each_layers_routing(tmp_path, fresh_seed, monkeypatch):
    forwards = {}      # per layer name: each training forward's reference sums
    built = {}
    real_build = train.loop.build

    def build(cfg, procs):          # the run's own parts, with a recording hook on each MoE layer
        parts = built["parts"] = real_build(cfg, procs)
        built["layers"] = record_forwards(parts.model, forwards)
        return parts
    monkeypatch.setattr(train.loop, "build", build)
    _, records = run(tmp_path, *TINY, f"train.steps={STEPS}", f"log.every={EVERY}", "train.eval_every=100",
                     "moe.capacity_factor=1.0", "moe.z_loss_coef=0.001", "model.moe_every=1",
                     f"train.seed={fresh_seed}")
    layers = built["layers"]
    assert len(layers) == 2 and all(len(f) == STEPS for f in forwards.values())
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [EVERY, STEPS]
    events = None          # TensorBoard's records too, where the tensorboard package is installed
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
    for window, rec in enumerate(train_records):
        want = window_expected(layers, forwards, window, EVERY)
        for index, (name, metrics) in enumerate(want.items()):
            load = [sum(one["load"][e] for one in forwards[name][window * EVERY:(window + 1) * EVERY])
                    for e in range(4)]
            assert rec["tokens_per_expert"][index] == load
            for key, value in metrics.items():
                assert rec[f"moe/{name}/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key)
                board = {e.step: e.value for e in events.Scalars(f"moe/{name}/{key}")} if events else {}
                assert not events or board[rec["step"]] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        assert rec["moe/all/max_load"] == max(w["max_load"] for w in want.values())
    shares = plots.load_shares(train_records)
    for layer in range(2):
        for e in range(4):
            for i, rec in enumerate(train_records):
                load = rec["tokens_per_expert"][layer]
                assert shares[layer][e][i] == pytest.approx(100 * load[e] / sum(load))
    # the heatmap the run saved is the one drawn from these records (redrawn: the same bytes), whose image per layer
    # holds each expert's share of the layer's recorded tokens (a row) per record (a column, centred on its step)
    again = tmp_path / "again"
    again.mkdir()
    figure = plots.save_heatmap(train_records, again)
    assert (again / "expert_load_heatmap.png").read_bytes() == (tmp_path / "run" / "expert_load_heatmap.png").read_bytes()
    images = [image for ax in figure.axes for image in ax.get_images()]
    assert len(images) == 2
    for layer, image in enumerate(images):
        drawn = image.get_array()
        assert drawn.shape == (4, len(train_records))
        for i, rec in enumerate(train_records):
            load = rec["tokens_per_expert"][layer]
            assert drawn[:, i].tolist() == pytest.approx([100 * n / sum(load) for n in load])
        left, right, _, _ = image.get_extent()
        width = (right - left) / len(train_records)
        assert [left + (i + 0.5) * width for i in range(len(train_records))] == [r["step"] for r in train_records]


def collapse(parts):
    for layer in parts.model.modules():
        if isinstance(layer, MoELayer):
            with torch.no_grad():
                layer.router.weight_ED.zero_()
                layer.router.weight_ED.requires_grad_(False)
                layer.router.fixed_bias = True
                layer.router.expert_bias_E.zero_()
                layer.router.expert_bias_E[1] = 10.0
    return parts


def balance(parts):
    """Every router sends the token at position s to expert s % 4, and keeps doing so: the blocks pass on the
    position embedding alone (token embedding, attention output and experts zero), which holds 5 at dimension
    s % 4, where expert e's router row reads dimension e; all of these frozen."""
    model = parts.model
    with torch.no_grad():
        zeros = [model.token_embedding.weight] + [block.attn.out.weight for block in model.blocks]
        for layer in model.moe_layers():
            zeros += list(layer.experts.parameters())
        for weight in zeros:
            weight.zero_()
        positions = model.position_embedding.weight
        positions.zero_()
        positions[:, :4] = 5.0 * torch.eye(4)[torch.arange(positions.shape[0]) % 4]
        routers = [layer.router.weight_ED for layer in model.moe_layers()]
        for weight_ED in routers:
            weight_ED.zero_()
            weight_ED[:, :4] = torch.eye(4)
        for weight in zeros + [positions] + routers:
            weight.requires_grad_(False)
    return parts


@pytest.mark.parametrize("case", ["collapsed", "balanced", "collapsed_alarm_off"])
def test_a_collapse_raises_the_alarm_once(tmp_path, monkeypatch, capsys, case):
    """A record every step, alarm windows 3: a collapse warns once per layer at the third record's check and at no
    other (the run's alarm recorded check by check, one check per record), on stderr; a run balanced by
    construction and a collapse with the alarm off never warn."""
    real_build = train.loop.build
    rig = balance if case == "balanced" else collapse
    monkeypatch.setattr(train.loop, "build", lambda cfg, procs: rig(real_build(cfg, procs)))
    checks = []         # what the run's alarm returned at each check: its warnings

    class Recorded(train.loop.RoutingAlarm):
        def check(self, metrics):
            checks.append(super().check(metrics))
            return checks[-1]
    monkeypatch.setattr(train.loop, "RoutingAlarm", Recorded)
    _, records = run(tmp_path, *TINY, "train.steps=4", "log.every=1", "train.eval_every=100", "moe.top_k=1",
                     "model.moe_every=1", "moe.capacity_factor=0", "log.plots=false", "log.alarm_windows=3",
                     f"log.routing_alarm={'false' if case.endswith('off') else 'true'}")
    lines = capsys.readouterr().err.splitlines()
    alarms = [line for line in lines if "routing alarm" in line]
    if case == "balanced":
        assert alarms == [] and checks == [[]] * 4
        loads = [load for r in records if "loss" in r for load in r["tokens_per_expert"]]
        assert len(loads) == 4 * 2 and all(load == [load[0]] * 4 and load[0] > 0 for load in loads)   # balanced
        return
    if case == "collapsed_alarm_off":
        assert alarms == [] and checks == []
        return
    assert [len(messages) for messages in checks] == [0, 0, 2, 0], checks    # one per layer, at the third window
    assert alarms == [f"moe-plugin train: {message}" for message in checks[2]]
    assert "experts 0 (0.0%), 2 (0.0%), 3 (0.0%) got under 10% of the mean load (busiest expert 4.00x" in alarms[0]


@pytest.mark.parametrize("override, words", [("log.alarm_min_share=1.5", "log.alarm_min_share=1.5 is invalid"),
                                             ("log.alarm_windows=0", "log.alarm_windows=0 is invalid: must be >= 1")])
def test_bad_alarm_settings_name_the_key(override, words):
    with pytest.raises(ValueError) as error:
        train.load_config(None, [*TINY, override])
    assert words in str(error.value) and "\n" not in str(error.value)
