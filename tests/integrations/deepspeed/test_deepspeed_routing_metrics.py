"""Routing metrics under DeepSpeed (issue 44; integrations/deepspeed/routing.py): with the JSON's csv_monitor on,
2 gloo processes (ep_size 2, 2 micro-batches a step, steps_per_print 2) write moe/<layer>/<metric> per MoE layer
and moe/all to DeepSpeed's own monitor files, equal to numbers recomputed from each layer's routing on both ranks
as each forward ran (tests/helpers/routing_reference.py), and under pipeline parallelism (engine.train_batch, 2 stages x
2 data-parallel ranks) every stage's layers likewise; a bad "moe.routing_alarm" is a one-line error. A router
sending every token to one expert raises the alarm once per layer at the set window, on rank 0, through DeepSpeed's
logger; a router balanced by construction never does, nor "routing_alarm": false; with the JSON's wandb and
tensorboard sections on, wandb.log and the event file get the same numbers at DeepSpeed's x-axis (wandb's steps
never going back). Without steps_per_print in the JSON the window is 10 optimizer steps."""
import csv

import pytest
import torch

pytest.importorskip("deepspeed")
import moe_plugin.integrations.deepspeed as dsi  # noqa: E402
from helpers.launch import run_workers  # noqa: E402
from helpers.routing_reference import add, expected  # noqa: E402

STEPS, EVERY, ACCUMULATION = 4, 2, 2
SECTION = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "capacity_factor": 1.0,
           "min_capacity": 0, "aux_loss": "switch"}


def monitored_worker(rank, world, directory, seed):
    from helpers.deepspeed import batches, setup_worker
    from helpers.routing_reference import record_forwards

    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss
    setup_worker(rank, world)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
              "steps_per_print": EVERY, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "csv_monitor": {"enabled": True, "output_path": directory, "job_name": "run"}, "moe": SECTION}
    torch.manual_seed(seed)
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(SECTION, seed=seed), config=config)
    forwards = {}
    layers = record_forwards(engine.module, forwards)
    for tokens in batches(seed + 1 + rank, STEPS * ACCUMULATION, batch=4):
        engine.backward(lm_loss(engine, tokens))
        engine.step()
    assert engine.global_samples == STEPS * ACCUMULATION * 4 * world
    return forwards, {name: layer.config for name, layer in layers.items()}


class _Layer:        # what expected() reads of a layer
    def __init__(self, config):
        self.config = config


def read_csv(path):
    with open(path) as file:
        rows = list(csv.reader(file))[1:]
    return {int(step): float(value) for step, value in rows}


@pytest.mark.timeout(600)
def test_the_monitor_holds_each_layers_routing(tmp_path):
    seed = torch.randint(1 << 30, ()).item()
    (forwards0, configs), (forwards1, _) = run_workers(monitored_worker, 2, str(tmp_path), seed, timeout=500)
    assert len(configs) == 2
    samples = [EVERY * ACCUMULATION * 4 * 2, STEPS * ACCUMULATION * 4 * 2]    # DeepSpeed's x-axis at each log
    per_window = EVERY * ACCUMULATION
    folder = tmp_path / "run"
    for window, step in enumerate(samples):
        want = {}
        for name, config in configs.items():
            sums = {}
            for one in forwards0[name][window * per_window:(window + 1) * per_window] + \
                    forwards1[name][window * per_window:(window + 1) * per_window]:
                sums = add(sums, one)
            want[name] = expected(_Layer(config), sums)
            want[name].pop("tokens_per_expert")
            assert set(want[name]) == {"max_load", "max_rank_load", "experts_without_tokens", "dropped_fraction",
                                       "capacity_used", "router_entropy", "balance_loss"}
            for key, value in want[name].items():
                got = read_csv(folder / f"moe_{name}_{key}.csv")
                assert got[step] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key, step)
        assert read_csv(folder / "moe_all_max_load.csv")[step] == pytest.approx(max(w["max_load"]
                                                                                    for w in want.values()))


def unprinted_worker(rank, world, directory, seed, steps):
    """One process (ep_size 1), a JSON without steps_per_print, the csv monitor on, `steps` optimizer steps of one
    micro-batch: each forward's reference sums and the layers' configs."""
    from helpers.deepspeed import batches, setup_worker
    from helpers.routing_reference import record_forwards

    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss
    setup_worker(rank, world)
    section = {**SECTION, "ep_size": 1}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2,
                                                                                             "torch_adam": True}},
              "csv_monitor": {"enabled": True, "output_path": directory, "job_name": "run"}, "moe": section}
    torch.manual_seed(seed)
    engine, _, _, _ = dsi.initialize(model=MoETransformerLM(section, seed=seed), config=config)
    assert engine.steps_per_print() is None
    forwards = {}
    layers = record_forwards(engine.module, forwards)
    for tokens in batches(seed + 1, steps, batch=2):
        engine.backward(lm_loss(engine, tokens))
        engine.step()
    return forwards, {name: layer.config for name, layer in layers.items()}


@pytest.mark.timeout(300)
def test_without_steps_per_print_the_window_is_10_steps(tmp_path, fresh_seed):
    """11 optimizer steps: the monitor gets one write, at the 10th step (DeepSpeed's x-axis: 20 samples), of the
    first 10 steps' routing."""
    (forwards, configs), = run_workers(unprinted_worker, 1, str(tmp_path), fresh_seed, 11, timeout=250)
    assert len(configs) == 2 and all(len(forwards[name]) == 11 for name in configs)
    for name, config in configs.items():
        sums = {}
        for one in forwards[name][:10]:
            sums = add(sums, one)
        want = expected(_Layer(config), sums)
        want.pop("tokens_per_expert")
        for key, value in want.items():
            got = read_csv(tmp_path / "run" / f"moe_{name}_{key}.csv")
            assert list(got) == [10 * 2] and got[20] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key, got)


@pytest.mark.parametrize("setting, words", [
    ("often", "\"moe.routing_alarm\"='often' is invalid: must be true, false or an object with some of"),
    ({"window": 3}, "\"moe.routing_alarm\"={'window': 3} is invalid"),
    ({"windows": 0}, "\"moe.routing_alarm\": routing alarm: windows must be an integer >= 1, got 0")])
def test_a_bad_alarm_setting_is_one_line(setting, words):
    from moe_plugin.integrations.deepspeed.routing import routing_alarm
    assert dsi.read_moe_section({"moe": {**SECTION, "routing_alarm": setting}}) == SECTION
    with pytest.raises(ValueError) as error:
        routing_alarm(setting)
    assert words in str(error.value) and "\n" not in str(error.value)


ALARM_CASES = ("collapsed", "balanced", "collapsed_alarm_off")


def collapse(model):
    """Every router sends every token to expert 3."""
    from moe_plugin import MoELayer
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.router.weight_ED.zero_()
                layer.router.fixed_bias = True
                layer.router.expert_bias_E.zero_()
                layer.router.expert_bias_E[3] = 10.0


def balance(model):
    """Every router sends the token at position s to expert s % 4: the blocks pass on the position embedding alone
    (no token embedding, attention and experts giving zeros), which holds 5 at dimension s % 4, where expert e's
    router row reads dimension e."""
    from moe_plugin import MoELayer
    with torch.no_grad():
        model.token_embedding.weight.zero_()
        positions = model.position_embedding.weight
        positions.zero_()
        positions[:, :4] = 5.0 * torch.eye(4)[torch.arange(positions.shape[0]) % 4]
        for block in model.blocks:
            block.out.weight.zero_()
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.router.weight_ED.zero_()
                layer.router.weight_ED[:, :4] = torch.eye(4)
                for weight in layer.experts.parameters():
                    weight.zero_()


def alarm_worker(rank, world, seed, board):
    """Three engines in turn (ALARM_CASES), a window each optimizer step; the balanced one with the JSON's wandb
    section on (wandb replaced by a recorder) and, with board (a folder), its tensorboard section. Returns per case
    each engine.step() call's alarm warnings, the forwards' reference sums and the layers' configs; and the
    wandb.log calls."""
    import logging
    import sys
    import types

    from deepspeed.utils import logger
    from helpers.deepspeed import batches, setup_worker
    from helpers.routing_reference import record_forwards

    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss
    setup_worker(rank, world)
    logger.setLevel(logging.WARNING)
    messages, wandb_calls = [], []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    logger.addHandler(Keep())
    sys.modules["wandb"] = types.SimpleNamespace(
        init=lambda **kwargs: None, log=lambda data, step=None, commit=None: wandb_calls.append((dict(data), step)))
    results = {}
    for case in ALARM_CASES:
        section = {**SECTION, "top_k": 1, "capacity_factor": 2.0,
                   "routing_alarm": False if case.endswith("off") else {"min_share": 0.05, "windows": 2}}
        # lr 0: the routing stays as set
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
                  "steps_per_print": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.0, "torch_adam": True}},
                  "moe": section}
        if case == "balanced":
            config["wandb"] = {"enabled": True, "project": "routing"}
            if board:
                config["tensorboard"] = {"enabled": True, "output_path": board, "job_name": "run"}
        torch.manual_seed(seed)
        engine, _, _, _ = dsi.initialize(model=MoETransformerLM(section, seed=seed), config=config)
        if case == "balanced":
            balance(engine.module)
        else:
            collapse(engine.module)
        forwards = {}
        layers = record_forwards(engine.module, forwards)
        alarms = []
        for tokens in batches(seed + 1 + rank, STEPS * ACCUMULATION, batch=4):
            engine.backward(lm_loss(engine, tokens))
            del messages[:]
            engine.step()
            alarms.append([m for m in messages if "routing alarm" in m])
        results[case] = (alarms, forwards, {name: layer.config for name, layer in layers.items()})
    return results, wandb_calls


@pytest.mark.timeout(600)
def test_the_alarm_fires_on_a_collapse_only_and_wandb_and_tensorboard_get_the_metrics(tmp_path):
    import importlib.util
    board = str(tmp_path) if importlib.util.find_spec("tensorboard") is not None else None   # else wandb's only
    seed = torch.randint(1 << 30, ()).item()
    (results0, wandb0), (results1, wandb1) = run_workers(alarm_worker, 2, seed, board, timeout=500)
    boundaries = list(range(ACCUMULATION - 1, STEPS * ACCUMULATION, ACCUMULATION))   # engine.step() calls ending a step
    alarms = results0["collapsed"][0]
    fired = [i for i, found in enumerate(alarms) if found]
    assert fired == [boundaries[1]], alarms           # at the 2nd window (windows: 2), once
    starved = "experts 0 (0.0%), 1 (0.0%), 2 (0.0%) got under 5% of the mean load (busiest expert 4.00x the mean)"
    dropped = 1 - 2 * 128 / 4 / 128        # capacity 2.0 * 128 tokens / 4 experts, all sent to expert 3
    names = list(results0["collapsed"][2])
    assert alarms[fired[0]] == [f"[Rank 0] moe_plugin routing alarm: MoE layer {name}: {starved}; dropped fraction "
                                f"{dropped:.1%} over 20%, in each of the last 2 logging windows" for name in names]
    assert not any(results1["collapsed"][0])          # rank 1 reads the same sums, rank 0 warns
    for case in ("balanced", "collapsed_alarm_off"):
        assert not any(results0[case][0]) and not any(results1[case][0]), case
    # the balanced run is healthy by the reference's numbers; its metrics reached wandb.log at DeepSpeed's x-axis
    _, forwards0, configs = results0["balanced"]
    forwards1 = results1["balanced"][1]
    assert wandb1 == []                                # DeepSpeed's monitor writes on rank 0 only
    steps = [step for _, step in wandb0]
    assert steps == sorted(steps)                      # wandb drops a step lower than its last
    logged = {}
    for data, step in wandb0:
        for key, value in data.items():
            logged.setdefault(key, {})[step] = value
    events = None
    if board:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
        events.Reload()
    for window in range(STEPS):
        step = (window + 1) * ACCUMULATION * 4 * 2
        want = {}
        for name, config in configs.items():
            sums = {}
            for one in forwards0[name][window * ACCUMULATION:(window + 1) * ACCUMULATION] + \
                    forwards1[name][window * ACCUMULATION:(window + 1) * ACCUMULATION]:
                sums = add(sums, one)
            want[name] = expected(_Layer(config), sums)
            load = want[name].pop("tokens_per_expert")
            assert load == [load[0]] * 4 and want[name]["dropped_fraction"] == 0      # balanced indeed
            for key, value in want[name].items():
                assert logged[f"moe/{name}/{key}"][step] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key)
                board_values = {e.step: e.value for e in events.Scalars(f"moe/{name}/{key}")} if events else {}
                assert not events or board_values[step] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        assert logged["moe/all/max_load"][step] == pytest.approx(max(w["max_load"] for w in want.values()))


PIPE_SECTION = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "capacity_factor": 1.0,
                "min_capacity": 0, "aux_loss": "switch"}


def pipeline_worker(rank, world, directory):
    """2 stages x 2 data-parallel ranks (examples/deepspeed/pipeline_moe.py: an MoE layer in each stage),
    engine.train_batch with the csv monitor on: each rank's forwards as they ran."""
    from helpers.deepspeed import setup_worker
    from helpers.paths import load_script
    from helpers.routing_reference import record_forwards

    example = load_script("examples/deepspeed/pipeline_moe.py")
    setup_worker(rank, world)
    torch.manual_seed(0)
    model = example.pipeline(PIPE_SECTION, stages=2)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
              "steps_per_print": EVERY, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "moe": PIPE_SECTION,
              "csv_monitor": {"enabled": True, "output_path": directory, "job_name": "run"}}
    engine, _, _, _ = dsi.initialize(model=model, config=config, model_parameters=model.parameters())
    forwards = {}
    layers = record_forwards(engine.module, forwards)
    generator = torch.Generator().manual_seed(100 + engine.grid.get_data_parallel_rank())
    for _ in range(STEPS):
        engine.train_batch(iter([example.batch(generator, 4) for _ in range(ACCUMULATION)]))
    return forwards, {name: layer.config for name, layer in layers.items()}


@pytest.mark.timeout(600)
def test_a_pipeline_logs_every_stages_layers(tmp_path):
    """engine.train_batch (pipeline parallelism, where engine.step is never called): rank 0's monitor holds each
    stage's MoE layers, each summed over its stage's data-parallel ranks, equal to the recomputed numbers."""
    results = run_workers(pipeline_worker, 4, str(tmp_path), timeout=500)
    configs = {name: config for _, named in results for name, config in named.items()}
    assert len(configs) == 2, configs          # one MoE layer in each stage
    per_window = EVERY * ACCUMULATION
    samples = [EVERY * ACCUMULATION * 4 * 2, STEPS * ACCUMULATION * 4 * 2]    # 2 data-parallel ranks
    folder = tmp_path / "run"
    for window, step in enumerate(samples):
        want = {}
        for name, config in configs.items():
            sums = {}
            for forwards, _ in results:        # the two ranks of the layer's stage recorded it
                for one in forwards.get(name, [])[window * per_window:(window + 1) * per_window]:
                    sums = add(sums, one)
            assert sums["forwards"] == 2 * per_window, (name, sums["forwards"])
            want[name] = expected(_Layer(config), sums)
            want[name].pop("tokens_per_expert")
            for key, value in want[name].items():
                got = read_csv(folder / f"moe_{name}_{key}.csv")
                assert got[step] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key, step)
        assert read_csv(folder / "moe_all_max_load.csv")[step] == pytest.approx(max(w["max_load"]
                                                                                    for w in want.values()))