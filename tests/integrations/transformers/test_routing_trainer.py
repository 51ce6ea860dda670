"""HF Trainer with RoutingMetrics (issue 44): a 6-step run with report_to=["tensorboard"] (2 micro-batches a step,
a log every 2 steps) writes moe/<layer>/<metric> per swapped layer and the moe/all summary into TensorBoard's event
file, equal to numbers recomputed from each layer's routing as each forward ran (tests/helpers/routing_reference.py);
a router sending every token to one expert raises the alarm once per layer, through transformers' logger, at the log
that ends the set number of windows, and a run balanced by construction never does; the alarm can be turned off."""
import tempfile
from pathlib import Path

import pytest
import torch

from helpers.hf import build_model, needs_transformers, tokens
from helpers.routing_reference import record_forwards, window_expected

pytestmark = [needs_transformers]

STEPS, EVERY = 6, 2


def train(model, callbacks, report_to, out_dir, eval_steps=None, rows=None):
    """rows: the training token rows (default: 24 fresh random rows)."""
    from transformers import Trainer, TrainingArguments
    rows = tokens(seed=torch.randint(1 << 30, ()).item(), batch=24) if rows is None else rows
    data = [{"input_ids": row, "labels": row} for row in rows]
    evaluation = dict(eval_strategy="steps", eval_steps=eval_steps) if eval_steps else {}
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-2, save_strategy="no",
                             report_to=report_to, logging_steps=EVERY, disable_tqdm=True, **evaluation)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4] if eval_steps else None,
                      callbacks=callbacks)
    trainer.train()
    return trainer


def swapped(hf_config=None, **overrides):
    from moe_plugin.integrations.transformers import swap_moe_blocks
    model = build_model("mixtral", seed=torch.randint(1 << 30, ()).item(), **(hf_config or {}))
    return swap_moe_blocks(model, **overrides)


def moe_layers(model):
    from moe_plugin import MoELayer
    return {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}


def test_trainer_tensorboard_holds_each_layers_routing(capsys):
    EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                           reason="tensorboard is not installed (pip install tensorboard)"
                                           ).EventAccumulator

    from moe_plugin.integrations.transformers import RoutingMetrics
    model = swapped(capacity_factor=1.0, z_loss_coef=1e-3, aux_loss="switch")
    forwards = {}                                # each training forward's reference sums, in order
    layers = record_forwards(model, forwards)
    assert len(layers) == 2
    out_dir = tempfile.mkdtemp()
    train(model, [RoutingMetrics()], ["tensorboard"], out_dir)

    console = capsys.readouterr().out            # the Trainer's console log (PrinterCallback) shows them too
    assert all(console.count(f"'moe/{name}/max_load'") == STEPS // EVERY for name in layers), console[-2000:]
    event_files = list(Path(out_dir).rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files
    events = EventAccumulator(str(event_files[0]), size_guidance={"scalars": 0})
    events.Reload()
    per_window = 2 * EVERY       # forwards per window: 2 micro-batches a step
    for name, layer in layers.items():
        assert len(forwards[name]) == STEPS * 2
    for window in range(STEPS // EVERY):
        step = (window + 1) * EVERY
        want = window_expected(layers, forwards, window, per_window)
        for name, metrics in want.items():
            assert set(metrics) == {"max_load", "max_rank_load", "experts_without_tokens", "dropped_fraction",
                                    "capacity_used", "router_entropy", "balance_loss", "z_loss"}
            for key, value in metrics.items():
                got = {e.step: e.value for e in events.Scalars(f"train/moe/{name}/{key}")}
                assert got[step] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key, step)
        got = {e.step: e.value for e in events.Scalars("train/moe/all/max_load")}
        assert got[step] == pytest.approx(max(w["max_load"] for w in want.values()), rel=1e-6)
        got = {e.step: e.value for e in events.Scalars("train/moe/all/dropped_fraction")}
        assert got[step] == pytest.approx(sum(w["dropped_fraction"] for w in want.values()) / 2, rel=1e-5, abs=1e-6)


def collapse(model):
    """Every router sends every token to expert 3 (the other experts' rows zero, its own rows a large bias)."""
    for layer in moe_layers(model).values():
        layer.router.weight_ED.requires_grad_(False).zero_()
        layer.router.expert_bias_E.zero_()
        layer.router.fixed_bias = True
        layer.router.expert_bias_E[3] = 10.0


def balance(model):
    """Every router sends the token at position s to expert s % E and keeps doing so, given rows whose token at
    position s is s % E plus a multiple of E (balanced_rows): token v's embedding holds 5 at dimension v % E and
    zeros elsewhere, which the blocks pass on unchanged (attention output and experts zero), normalized to
    sqrt(D) by the post-attention RMSNorm, where expert e's router row reads dimension e; only lm_head trains."""
    layers = moe_layers(model)
    E = next(iter(layers.values())).config.num_experts
    with torch.no_grad():
        embedding = model.model.embed_tokens.weight
        embedding.zero_()
        embedding[:, :E] = 5.0 * torch.eye(E)[torch.arange(embedding.shape[0]) % E]
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        for layer in layers.values():
            for weight in layer.experts.parameters():
                weight.zero_()
            layer.router.weight_ED.zero_()
            layer.router.weight_ED[:, :E] = torch.eye(E)
        for weight in model.parameters():
            weight.requires_grad_(False)
        model.lm_head.weight.requires_grad_(True)
    return E


def balanced_rows(E, batch=24, length=13):
    """Fresh random rows whose token at position s is s % E plus a random multiple of E (below the vocabulary)."""
    from helpers.hf import VOCAB
    return E * torch.randint(VOCAB // E, (batch, length)) + torch.arange(length) % E


@pytest.mark.parametrize("case", ["collapsed", "balanced", "collapsed_alarm_off"])
def test_the_alarm_fires_once_on_a_collapse_only(case, caplog, fresh_seed):
    """Windows of EVERY steps, alarm windows 2: a collapse warns once per layer, at the second log (step 2 * EVERY),
    and at no other; a run balanced by construction (position s to expert s % E, its load checked) and a collapse
    with the alarm off never warn."""
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from moe_plugin.integrations.transformers import RoutingMetrics
    from moe_plugin.routing_monitor.alarm import RoutingAlarm
    model = swapped({"num_experts_per_tok": 1}, capacity_factor=0.0)     # top-1: a collapse can take every token
    names = list(moe_layers(model))
    rows = None
    if case == "balanced":
        E = balance(model)
        rows = balanced_rows(E)
    else:
        collapse(model)
    callback = RoutingMetrics(alarm=False if case == "collapsed_alarm_off" else RoutingAlarm(min_share=0.05,
                                                                                             windows=2))
    seen = []         # at each training log: (step, its moe/ values, the alarm warnings logged so far)

    class Seen(TrainerCallback):      # after RoutingMetrics, which moves itself to the front
        def on_log(self, args, state, control, logs=None, **kwargs):
            alarms = [r.getMessage() for r in caplog.records if "routing alarm" in r.getMessage()]
            seen.append((state.global_step, {k: v for k, v in logs.items() if k.startswith("moe/")}, alarms))
    hf_logging.enable_propagation()       # transformers' logger reaches caplog's handler
    try:
        with caplog.at_level("WARNING"):
            train(model, [callback, Seen()], [], tempfile.mkdtemp(), rows=rows)
    finally:
        hf_logging.disable_propagation()
    seen = [entry for entry in seen if entry[1]]          # the training logs (the last one, train's summary, has none)
    assert [step for step, _, _ in seen] == list(range(EVERY, STEPS + 1, EVERY))
    fired = [len(alarms) for _, _, alarms in seen]
    if case == "balanced":
        # each window: 2 steps x 2 micro-batches x 2 rows of 13 positions, position s to expert s % 6
        load = [sum(1 for s in range(13) if s % 6 == e) * 8 for e in range(6)]
        for _, logs, _ in seen:
            for name in names:
                assert logs[f"moe/{name}/max_load"] == pytest.approx(max(load) / (sum(load) / 6))
                assert logs[f"moe/{name}/experts_without_tokens"] == 0
    if case != "collapsed":
        assert fired == [0] * len(seen)
        return
    assert fired == [0, 2, 2], fired             # at the 2nd window (windows=2), once per layer, not again at the 3rd
    alarms = seen[-1][2]
    for name, message in zip(names, alarms):
        assert f"MoE layer {name}: experts 0 (0.0%), 1 (0.0%), 2 (0.0%), 4 (0.0%), 5 (0.0%) got under 5%" in message
        assert "busiest expert 6.00x the mean" in message and "last 2 logging windows" in message


def test_evaluation_logs_leave_the_training_window_whole():
    """With an evaluation every step, the training logs (every EVERY steps) still hold their whole window's routing
    (evaluation forwards not counted) and the evaluations' logs hold none."""
    from moe_plugin.integrations.transformers import RoutingMetrics
    model = swapped(capacity_factor=1.0)
    forwards = {}
    layers = record_forwards(model, forwards)
    history = train(model, [RoutingMetrics(alarm=False)], [], tempfile.mkdtemp(), eval_steps=1).state.log_history
    evaluations = [log for log in history if "eval_loss" in log]
    assert len(evaluations) == STEPS and not any(key.startswith("moe/") for log in evaluations for key in log)
    logs = [log for log in history if "loss" in log]
    assert [log["step"] for log in logs] == list(range(EVERY, STEPS + 1, EVERY))
    for window, log in enumerate(logs):
        for name, metrics in window_expected(layers, forwards, window, 2 * EVERY).items():
            for key, value in metrics.items():
                assert log[f"moe/{name}/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


def test_a_model_without_moe_layers_is_named_in_a_warning(caplog):
    """HF's own blocks (the experts backend too) route with HF's router: the callback says it sees no MoE layer."""
    from transformers.utils import logging as hf_logging

    from moe_plugin.integrations.transformers import RoutingMetrics
    model = build_model("mixtral", seed=torch.randint(1 << 30, ()).item())
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            history = train(model, [RoutingMetrics()], [], tempfile.mkdtemp()).state.log_history
    finally:
        hf_logging.disable_propagation()
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RoutingMetrics: ")]
    assert len(warnings) == 1 and "no moe_plugin MoELayer" in warnings[0] and "swap_moe_blocks" in warnings[0]
    assert not any(key.startswith("moe/") for log in history for key in log)
    assert any("loss" in log for log in history)
