"""Bias balancing, group-limited routing, route_scale, the shared expert (and its gate) and the
sequence aux loss on 2 and 4 gloo processes against one process holding all experts."""
import pytest
import torch

from helpers.compare import relative_error
from helpers.expert_parallel import expected_shard, single_process_grads
from helpers.launch import run_workers
from moe_plugin import MoEConfig, MoELayer, update_expert_bias

D, H = 6, 8


def build(spec, **parallel):
    config = dict(model_dim=D, hidden_size=H, num_experts=spec["E"], top_k=spec["k"], capacity_factor=spec["cf"],
                  min_capacity=0, z_loss_coef=0.01, **spec["features"])
    return MoELayer(MoEConfig(**config, **parallel)).double()


def compare_features(rank, world, specs):
    worst = {}
    for spec in specs:
        torch.manual_seed(spec["seed"])
        reference = build(spec)
        reference.router.expert_bias_E.copy_(0.05 * torch.randn(spec["E"]))
        layer = build(spec, ep_size=world, parallel=spec["r"], overlap_degree=spec["d"], a2a=spec["a2a"],
                      node_size=spec.get("node"))
        layer.load_full_state_dict(reference.state_dict())
        generator = torch.Generator().manual_seed(spec["seed"] + 1)
        S = spec.get("seq", 1)
        xs = [torch.randn(n, S, D, generator=generator, dtype=torch.float64) for n in spec["sequences"]]
        upstreams = [torch.randn(x.shape, generator=generator, dtype=torch.float64) for x in xs]

        # one process: every rank's tokens as a micro-batch; expert grads summed over them, the rest per rank
        names, total, mine = single_process_grads(reference, xs, upstreams, rank)
        reference_updated = update_expert_bias(reference)

        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        ((y * upstreams[rank]).sum() + layer.aux_loss).backward()
        errors = {"y": relative_error(y.detach(), mine["y"], floor=1e-12),
                  "x.grad": relative_error(x.grad, mine["x.grad"], floor=1e-12),
                  "aux": relative_error(layer.aux_loss.detach(), mine["aux"], floor=1e-12)}
        params = dict(layer.named_parameters())
        for name in names:
            want = mine[name] if not name.startswith("experts.") else expected_shard(
                total[name], name, layer.groups.layout, spec["features"].get("activation") == "swiglu")
            errors[name] = relative_error(params[name].grad, want, floor=1e-12)
        updated = update_expert_bias(layer)
        same_bias = updated == reference_updated and torch.equal(layer.router.expert_bias_E,
                                                                 reference.router.expert_bias_E)
        worst[spec["name"]] = (max(errors.values()), max(errors, key=errors.get), same_bias,
                               layer.router.expert_bias_E.tolist(), sorted(names))
    return worst


DEEPSEEK = dict(router="sigmoid", num_groups=4, topk_groups=2, route_scale=2.5, expert_bias_update_rate=0.01,
                shared_hidden_size=5, activation="swiglu", bias=False)
QWEN2 = dict(router="softmax", shared_hidden_size=7, shared_gate=True, expert_bias_update_rate=0.03)

SPECS_2 = [
    dict(name="deepseek ep", E=8, k=4, cf=0.0, r=1, d=1, a2a="flat", sequences=[3, 2], seq=5, seed=1,
         features=dict(DEEPSEEK, aux_loss="seq")),
    dict(name="deepseek drops overlap empty rank", E=8, k=3, cf=0.6, r=1, d=2, a2a="flat", sequences=[4, 0], seq=3,
         seed=2, features=DEEPSEEK),
    dict(name="qwen2 gathered r0", E=4, k=2, cf=1.0, r=0, d=1, a2a="flat", sequences=[9, 7], seed=3, features=QWEN2),
    dict(name="sliced experts shared gelu seq", E=1, k=1, cf=0.0, r=2, d=1, a2a="flat", sequences=[2, 3], seq=4,
         seed=4, features=dict(shared_hidden_size=3, activation="gelu", aux_loss="seq", expert_bias_update_rate=0.1,
                               route_scale=0.5)),
]

SPECS_4 = [
    dict(name="deepseek ep4 k8", E=16, k=8, cf=0.0, r=1, d=1, a2a="flat", sequences=[2, 1, 3, 2], seq=7, seed=11,
         features=dict(DEEPSEEK, aux_loss="seq")),
    dict(name="deepseek ep4 2dh drops", E=8, k=4, cf=0.7, r=1, d=2, a2a="2dh", node=2, sequences=[5, 0, 17, 8],
         seed=12, features=DEEPSEEK),
    dict(name="qwen2 sliced r1", E=2, k=2, cf=-1.0, r=1, d=1, a2a="flat", sequences=[6, 9, 1, 4], seed=13,
         features=QWEN2),
    dict(name="groups softmax r0", E=8, k=3, cf=1.25, r=0, d=1, a2a="flat", sequences=[4, 4, 0, 6], seq=2, seed=14,
         features=dict(num_groups=4, topk_groups=3, aux_loss="seq", route_scale=1.5, expert_bias_update_rate=0.02)),
]


def _check(results, specs):
    for spec in specs:
        biases = [worst[spec["name"]][3] for worst in results]
        for rank, worst in enumerate(results):
            error, where, same_bias, _, names = worst[spec["name"]]
            assert error < 1e-10, f"{spec['name']}: rank {rank} {where} off by {error:.3g}"
            assert same_bias, f"{spec['name']}: rank {rank} bias {biases[rank]} differs from one process's"
            if spec["features"].get("shared_hidden_size"):
                assert any(n.startswith("shared_expert.") for n in names)
        assert all(b == biases[0] for b in biases), f"{spec['name']}: ranks differ: {biases}"


# generous limits: on a shared 2-core machine spawning and importing alone can take a minute
@pytest.mark.timeout(900)
def test_two_processes_match_single_process():
    _check(run_workers(compare_features, 2, SPECS_2, timeout=800), SPECS_2)


@pytest.mark.timeout(900)
def test_four_processes_match_single_process():
    _check(run_workers(compare_features, 4, SPECS_4, timeout=800), SPECS_4)


def full_state_loads(rank, world):
    torch.manual_seed(0)
    config = dict(model_dim=D, hidden_size=H, num_experts=4, shared_hidden_size=5, shared_gate=True,
                  expert_bias_update_rate=0.1)
    full = MoELayer(MoEConfig(**config))
    full.router.expert_bias_E.copy_(torch.randn(4))
    torch.manual_seed(rank + 100)      # each rank starts from different weights
    layer = MoELayer(MoEConfig(**config, ep_size=world))
    layer.load_full_state_dict(full.state_dict())
    mine, theirs = layer.state_dict(), full.state_dict()
    return all(torch.equal(mine[n], theirs[n]) for n in theirs
               if n.startswith(("shared_expert.", "router."))) and "shared_expert.gate_D" in mine


@pytest.mark.timeout(600)
def test_load_full_state_dict_carries_shared_expert_gate_and_bias():
    assert run_workers(full_state_loads, 2, timeout=500) == [True, True]


def shared_expert_while_in_flight(rank, world, overlaps):
    import moe_plugin.dispatchers.all_to_all as ep
    events = []

    class LoggedAllToAll(ep.PendingAllToAll):
        def __init__(self, *args):
            events.append("start")
            super().__init__(*args)

        def wait(self):
            events.append("wait")
            return super().wait()
    ep.PendingAllToAll = LoggedAllToAll
    runs = []
    for overlap in overlaps:
        events.clear()
        layer = MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=4, shared_hidden_size=5, ep_size=world,
                                   overlap_degree=overlap))
        layer.shared_expert.register_forward_hook(lambda *args: events.append("shared"))
        layer(torch.randn(12, D))
        runs.append(list(events))
    return runs


@pytest.mark.timeout(600)
def test_shared_expert_runs_while_the_first_all_to_all_is_in_flight():
    for runs in run_workers(shared_expert_while_in_flight, 2, [1, 2], timeout=500):
        for events in runs:
            assert events.count("shared") == 1 and events.count("start") >= 2   # out and back
            assert events.index("start") < events.index("shared") < events.index("wait"), events
