"""Routing metrics under DeepSpeed (issue 44; integrations/deepspeed/routing.py): with the JSON's csv_monitor on,
2 gloo processes (ep_size 2, 2 micro-batches a step, steps_per_print 2) write moe/<layer>/<metric> per MoE layer
and moe/all to DeepSpeed's own monitor files, equal to numbers recomputed from each layer's routing on both ranks
as each forward ran (tests/helpers/routing_reference.py); a bad "moe.routing_alarm" is a one-line error."""
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
            assert set(want[name]) == {"max_load", "experts_without_tokens", "dropped_fraction", "capacity_used",
                                       "router_entropy", "balance_loss"}
            for key, value in want[name].items():
                got = read_csv(folder / f"moe_{name}_{key}.csv")
                assert got[step] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key, step)
        assert read_csv(folder / "moe_all_max_load.csv")[step] == pytest.approx(max(w["max_load"]
                                                                                    for w in want.values()))


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
