"""RoutingMonitor (moe_plugin/routing_monitor/metrics.py): each layer's window metrics equal numbers recomputed here from the
layer's own routing (its router's choices, probabilities and losses; capacity and drops counted by a plain loop),
summed over micro-batches and over 2 gloo processes; eval forwards and checkpointed recomputes do not count; the
training forward adds no host synchronization."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers.host_syncs import HostSyncs
from helpers.launch import run_workers
from helpers.routing_reference import add, check, expected, reference
from moe_plugin import MoELayer
from moe_plugin.routing_monitor.metrics import RoutingMonitor, scalars

D = 16
LAYERS = {
    "capped": dict(model_dim=D, hidden_size=24, num_experts=6, top_k=2, capacity_factor=0.8, z_loss_coef=0.01),
    "dropless_sigmoid": dict(model_dim=D, hidden_size=24, num_experts=8, top_k=1, capacity_factor=0.0,
                             router="sigmoid", aux_loss="gshard"),
    "biased_none": dict(model_dim=D, hidden_size=24, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss="none",
                        expert_bias_update_rate=0.05),
    # the balance loss recomputed by the monitor (aux_loss_coef 0: the layer's aux loss holds only the z-loss)
    "unweighted_seq": dict(model_dim=D, hidden_size=24, num_experts=5, top_k=3, capacity_factor=1.0, aux_loss="seq",
                           aux_loss_coef=0.0, z_loss_coef=0.02),
    "switch_k3": dict(model_dim=D, hidden_size=24, num_experts=7, top_k=3, capacity_factor=1.25, aux_loss="switch",
                      aux_loss_coef=0.1, z_loss_coef=0.001),
}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9, torch.bfloat16: 3e-2}


def build(seed: int, dtype=torch.float32) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({name: MoELayer(**kw) for name, kw in LAYERS.items()}).to(dtype)


def micro_batches(model, inputs, sums):
    """Forward and backward of each input through every layer; the reference sums of each layer's routing."""
    for x in inputs:
        for name, layer in model.items():
            seq_len = x.shape[-2] if x.dim() >= 3 else None
            sums[name] = add(sums.get(name, {}), reference(layer, x.reshape(-1, D), seq_len))
            layer(x).square().mean().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_window_metrics_equal_the_layers_routing(dtype):
    model = build(torch.randint(1 << 30, ()).item(), dtype)
    monitor = RoutingMonitor(model)
    model.biased_none.router.expert_bias_E.copy_(torch.randn(4))      # a spread to read
    sums, rel = {}, TOLERANCE[dtype]
    micro_batches(model, [torch.randn(3, 7, D, dtype=dtype), torch.randn(5, D, dtype=dtype),
                          torch.randn(2, 9, D, dtype=dtype)], sums)
    with torch.no_grad():
        model.eval()
        model.capped(torch.randn(4, D, dtype=dtype))       # evaluation: not counted
        model.train()
    check(monitor.read(), {name: expected(model[name], s) for name, s in sums.items()}, rel)
    assert monitor.read() == {}               # a new window: nothing ran in it

    sums = {}
    micro_batches(model, [torch.randn(11, D, dtype=dtype)], sums)
    metrics = monitor.read()
    check(metrics, {name: expected(model[name], s) for name, s in sums.items()}, rel)
    flat = scalars(metrics)
    assert flat["moe/capped/max_load"] == metrics["capped"]["max_load"]
    assert flat["moe/all/max_load"] == max(m["max_load"] for m in metrics.values())
    assert flat["moe/all/experts_without_tokens"] == sum(m["experts_without_tokens"] for m in metrics.values())
    assert flat["moe/all/dropped_fraction"] == pytest.approx(sum(m["dropped_fraction"] for m in metrics.values()) /
                                                             len(LAYERS))
    assert "moe/dropless_sigmoid/z_loss" not in flat and "moe/biased_none/balance_loss" not in flat
    monitor.close()
    micro_batches(model, [torch.randn(4, D, dtype=dtype)], {})
    assert monitor.read() == {}


def test_a_collapsed_router_reads_as_collapsed():
    layer = MoELayer(model_dim=D, hidden_size=8, num_experts=4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.weight_ED.zero_()
        layer.router.weight_ED[2] = 1.0       # inputs with a positive sum all go to expert 2
    monitor = RoutingMonitor(layer)
    layer(torch.rand(40, D)).sum().backward()
    metrics = monitor.read()[""]
    assert metrics["tokens_per_expert"] == [0, 0, 40, 0]
    assert metrics["max_load"] == 4.0 and metrics["experts_without_tokens"] == 3.0
    assert metrics["dropped_fraction"] == pytest.approx(0.75) and metrics["capacity_used"] == pytest.approx(0.25)


def test_checkpointed_recompute_counts_once():
    layer = MoELayer(model_dim=D, hidden_size=8, num_experts=4, top_k=2, capacity_factor=1.5)
    monitor = RoutingMonitor(layer)
    x = torch.randn(9, D, requires_grad=True)
    want = expected(layer, reference(layer, x.detach()))
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    check(monitor.read(), {"": want})


def test_the_hook_reads_nothing_from_the_device():
    """What the hook adds to a training forward runs no op that waits on the device (a GPU's host sync)."""
    model = build(seed=torch.randint(1 << 30, ()).item())
    monitor = RoutingMonitor(model)
    for name, layer in model.items():
        x = torch.randn(3, 4, D)
        layer(x).sum().backward()
        hook = next(iter(layer._forward_hooks.values()))
        with HostSyncs() as record:
            hook(layer, (x,), {}, None)
        assert record.seen == [], name
    assert set(monitor.read()) == set(LAYERS)


def _rank_sums(rank, world_size, seed):
    model = build(seed)
    monitor = RoutingMonitor(model)
    torch.manual_seed(seed + 1 + rank)        # each rank its own data
    sums = {}
    micro_batches(model, [torch.randn(6 + rank, D), torch.randn(2, 5, D)], sums)
    return monitor.read(), sums


def test_the_window_is_summed_over_processes():
    seed = torch.randint(1 << 30, ()).item()
    (metrics0, sums0), (metrics1, sums1) = run_workers(_rank_sums, 2, seed)
    model = build(seed)
    want = {name: expected(model[name], add(sums0[name], sums1[name])) for name in LAYERS}
    for name in want:
        want[name].pop("expert_bias_spread", None)
        for metrics in (metrics0, metrics1):
            metrics[name].pop("expert_bias_spread", None)
    check(metrics0, want)
    check(metrics1, want)


@pytest.mark.parametrize("coef", [0.0, 0.01])
def test_a_noisy_balance_loss_is_the_layers_own_or_noise_free(coef):
    """Tutel's load_importance loss (its router noise drawn each training forward): with aux_loss_coef > 0 the metric
    is the layer's own loss of each forward (its aux_loss over the weight); at 0, the router's noise-free one."""
    layer = MoELayer(model_dim=D, hidden_size=8, num_experts=4, top_k=2, capacity_factor=1.5, gate_noise=1.0,
                     gate_noise_kind="tutel", aux_loss="load_importance", aux_loss_coef=coef)
    monitor = RoutingMonitor(layer)
    want = []
    for x in (torch.randn(9, D), torch.randn(2, 6, D)):
        if coef == 0:
            with torch.no_grad():
                want.append(float(layer.router.eval()(x.reshape(-1, D)).aux_loss))
                layer.router.train()
        layer(x).square().mean().backward()
        if coef > 0:
            want.append(float(layer.aux_loss) / coef)
    assert monitor.read()[""]["balance_loss"] == pytest.approx(sum(want) / 2, rel=1e-5)


COMPILED_RUN = """
import copy, json, sys
import torch
from torch import nn
from moe_plugin import MoELayer
from moe_plugin.routing_monitor.metrics import RoutingMonitor
assert "torch._dynamo" not in sys.modules       # else the monitor's hooks run eagerly whenever it is built
torch.manual_seed(int(sys.argv[1]))
layers = [MoELayer(model_dim=16, hidden_size=24, num_experts=6, top_k=2, capacity_factor=0.8, z_loss_coef=0.01),
          MoELayer(model_dim=16, hidden_size=24, num_experts=8, top_k=1, capacity_factor=0.0, router="sigmoid"),
          MoELayer(model_dim=16, hidden_size=24, num_experts=7, top_k=3, capacity_factor=1.25, aux_loss="switch",
                   aux_loss_coef=0.1, z_loss_coef=0.001)]
model, eager = nn.Sequential(*layers), nn.Sequential(*copy.deepcopy(layers))
monitor, eager_monitor = RoutingMonitor(model), RoutingMonitor(eager)     # built before torch.compile
compiled = torch.compile(model, backend="aot_eager")   # dynamo and AOTAutograd trace the hooks; no C++ to build
for _ in range(3):
    x = torch.randn(2, 5, 16)
    compiled(x).square().mean().backward()
    eager(x).square().mean().backward()
print(json.dumps([monitor.read(), eager_monitor.read()]))
"""


@pytest.mark.timeout(600)
def test_a_monitor_compiled_with_the_model_reads_what_an_eager_one_does():
    """A monitor built before torch.compile has its hooks compiled with the model (traced by dynamo and AOTAutograd;
    inductor's code generation, which adds nothing here, is left out): it reads the same window as the eager model's
    over several forwards (a fresh process, where the compiler is not loaded yet)."""
    import json
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", COMPILED_RUN, str(torch.randint(1 << 30, ()).item())],
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled, eager = json.loads(run.stdout.splitlines()[-1])
    assert len(eager) == 3
    check(compiled, eager, rel=1e-4)
