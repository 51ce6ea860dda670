"""max_rank_load (issue 55 item 1), RoutingMonitor's busiest expert-parallel rank over the mean rank, against the
rows counted by hand from each process's routes: on 4 gloo ranks, a layer at ep_size 4 whose router is biased
towards experts of rank 0, one with experts sliced over ranks (E < ep_size), one at ep_size 2 under data
parallelism (2 ep groups) and one that gathers every expert (parallel 0: each rank computes its own rows); then single-process checks of the formula, the alarm and the hosts' keys."""
import pytest
import torch
import torch.distributed as dist

from helpers.launch import run_workers
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.parallel.groups import ExpertLayout
from moe_plugin.routing_monitor.alarm import RoutingAlarm
from moe_plugin.routing_monitor.metrics import RoutingMonitor, max_rank_load, metrics_from_sums, rank_rows, rank_shares

D = 8
LAYERS = {"hot_rank0": dict(num_experts=16, ep_size=4, top_k=2), "sliced": dict(num_experts=2, ep_size=4, top_k=1),
          "ep2_dp2": dict(num_experts=8, ep_size=2, top_k=2),
          "gathered": dict(num_experts=8, ep_size=4, top_k=2, parallel=0)}


def rows_by_hand(rank, world):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: MoELayer(MoEConfig(model_dim=D, hidden_size=8, capacity_factor=0.0,
                                                          router_bias=True, **kw)) for name, kw in LAYERS.items()})
    with torch.no_grad():
        for layer in model.values():
            layer.router.bias_E.zero_()
        model.hot_rank0.router.bias_E[[0, 1, 3]] = torch.tensor([2.0, 1.5, 1.0])    # rank 0 holds experts 0-3
        model.ep2_dp2.router.bias_E[5] = 1.0
        model.sliced.router.bias_E[0] = 1.0
        model.gathered.router.bias_E[[0, 1]] = 2.0                                 # rank 0 holds experts 0, 1
    monitor = RoutingMonitor(model)
    counted = {}
    for step in range(2):
        x = torch.randn(20 + 7 * rank + step, D, generator=torch.Generator().manual_seed(10 * rank + step))
        for name, layer in model.items():
            cfg, W = layer.config, layer.config.ep_size
            expert_TK = layer.router(x).expert_TK.reshape(-1)
            if cfg.parallel == 0:        # every expert gathered: each rank computes its own tokens' rows
                rows_W = torch.zeros(W, dtype=torch.float64)
                rows_W[dist.get_rank() % W] = len(expert_TK)
                held_W = torch.bincount(expert_TK // (cfg.num_experts // W), minlength=W).double()
                counted["gathered, by holder"] = counted.get("gathered, by holder", 0) + held_W
            elif cfg.num_experts >= W:   # rank of each routed row: its expert's holder
                rows_W = torch.bincount(expert_TK // (cfg.num_experts // W), minlength=W).double()
            else:                        # every holder of a slice computes all of its expert's rows, 1 / slices wide
                slices = W // cfg.num_experts
                rows_W = torch.bincount(expert_TK, minlength=cfg.num_experts).double().repeat_interleave(slices) / slices
            counted[name] = counted.get(name, 0) + rows_W
            layer(x).sum().backward()
    metrics = monitor.read()
    out = {}
    for name, rows_W in counted.items():
        dist.all_reduce(rows_W)
        out[name] = (metrics.get(name, {}).get("max_rank_load"), float(rows_W.max() / rows_W.mean()),
                     rows_W.tolist())
    return out


@pytest.mark.timeout(600)
def test_max_rank_load_equals_the_rows_counted_from_the_routes():
    results = run_workers(rows_by_hand, 4, timeout=500)
    for name in LAYERS:
        got, want, rows = results[0][name]
        assert got == pytest.approx(want, rel=1e-12), (name, rows)
        assert all(result[name][0] == got for result in results), name      # every process reads the same
    assert results[0]["hot_rank0"][1] > 1.5        # the skew is there: rank 0 holds the hot experts
    assert results[0]["sliced"][1] > 1.0
    # gathered (parallel 0): each rank computes its own tokens' rows (uneven only by their token counts), where the
    # holders' count would be far more skewed
    assert results[0]["gathered, by holder"][1] > 2 * results[0]["gathered"][1]


def test_the_formula_on_layouts_with_empty_experts_and_ranks():
    shares_EW = rank_shares(ExpertLayout(8, 4, 4, 0))
    load = [5, 0, 0, 0, 3, 1, 0, 0]         # rank 1 (experts 2, 3) and rank 3 (6, 7) get no row
    assert rank_rows(load, shares_EW) == [5.0, 0.0, 4.0, 0.0]
    assert max_rank_load(rank_rows(load, shares_EW)) == pytest.approx(5 / (9 / 4))
    assert rank_rows(torch.tensor(load, dtype=torch.float64), shares_EW).tolist() == [5.0, 0.0, 4.0, 0.0]
    sliced = rank_shares(ExpertLayout(2, 8, 8, 0))       # 4 slices per expert
    assert rank_rows([8, 0], sliced) == [2.0] * 4 + [0.0] * 4
    assert max_rank_load(rank_rows([8, 0], sliced)) == 2.0
    assert max_rank_load([7.0]) == 1.0 and max_rank_load([0.0]) == 1.0       # ep_size 1; no rows at all
    assert max_rank_load([0.0, 0.0, 0.0]) == 1.0
    assert max_rank_load([9.0, 0.0, 0.0]) == 3.0           # one rank takes all: ep_size
    sums = {"load": load, "kept": load, "rank_rows": rank_rows(load, shares_EW), "choices": 9, "slots": 9,
            "entropy": 0.0, "tokens": 9, "forwards": 1}
    assert metrics_from_sums(sums)["max_rank_load"] == pytest.approx(20 / 9)


def test_one_process_reads_one():
    layer = MoELayer(MoEConfig(model_dim=D, hidden_size=8, num_experts=4, top_k=1, capacity_factor=0.0))
    monitor = RoutingMonitor(torch.nn.Sequential(layer))
    layer(torch.randn(10, D)).sum().backward()
    metrics = monitor.read()["0"]
    assert metrics["max_rank_load"] == 1.0 and metrics["max_load"] > 1.0
    layer(torch.randn(10, D)).sum().backward()
    taken = monitor.take_sums()["0"]            # fairseq's path: device sums, read later
    assert metrics_from_sums({key: value.tolist() if torch.is_tensor(value) and value.dim() else
                              float(value) if torch.is_tensor(value) else value
                              for key, value in taken.items()})["max_rank_load"] == 1.0


def test_the_alarm_watches_the_busiest_rank():
    alarm = RoutingAlarm(min_share=0.0, windows=2, max_rank_load=1.5)
    busy = {"tokens_per_expert": [4, 4, 4, 4], "dropped_fraction": 0.0, "max_load": 1.0, "max_rank_load": 2.2}
    calm = dict(busy, max_rank_load=1.2)
    assert alarm.check({"l": busy}) == [] and alarm.layers_in_alarm() == 0
    messages = alarm.check({"l": busy})
    assert len(messages) == 1 and "busiest expert-parallel rank computes 2.20x the mean rank's routed rows, " \
        "over 1.5x" in messages[0] and alarm.layers_in_alarm() == 1
    assert alarm.check({"l": busy}) == []           # once, until healthy
    assert alarm.check({"l": calm}) == [] and alarm.layers_in_alarm() == 0
    assert RoutingAlarm(windows=1).check({"l": busy}) == []      # not watched by default
    with pytest.raises(ValueError, match="max_rank_load must be a number >= 1.*got 0.5"):
        RoutingAlarm(max_rank_load=0.5)


def test_the_hosts_take_the_alarm_key():
    from moe_plugin.integrations.deepspeed.routing import routing_alarm
    assert routing_alarm({"max_rank_load": 1.8}).max_rank_load == 1.8
    with pytest.raises(ValueError, match="moe.routing_alarm"):
        routing_alarm({"max_rank_load": 0.9})
