"""moe_plugin.integrations.deepspeed.MoE starts every expert as a copy of the module passed as `expert`, as
deepspeed.moe.layer.MoE does (issue 31, item 1): DeepSpeed's own layer built from the same module (random
weights and biases) is the reference, for expert weights and forward outputs; fast and general path, with and
without biases, and ep_size 2 on 2 gloo processes. Hidden-sliced experts: test_deepspeed_options.py (expert
tensor parallelism)."""
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
import moe_plugin.integrations.deepspeed as dsi  # noqa: E402
from deepspeed.moe.layer import MoE as NativeMoE  # noqa: E402
from helpers.launch import run_workers
from moe_plugin.experts import Experts  # noqa: E402
from moe_plugin.module_experts import ModuleExperts  # noqa: E402

D, H, E, T = 8, 12, 4, 20
TOLERANCE = 1e-5   # fp32; DeepSpeed's gate computes in fp32


class NamedMLP(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, H, bias=bias), nn.GELU(), nn.Linear(H, D, bias=bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


MODULES = {   # name -> (build, path)
    "relu_bias": (lambda: nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), Experts),
    "relu_no_bias": (lambda: nn.Sequential(nn.Linear(D, H, bias=False), nn.ReLU(), nn.Linear(H, D, bias=False)),
                     Experts),
    "named_gelu_no_bias": (lambda: NamedMLP(bias=False), Experts),
    "silu_bias": (lambda: nn.Sequential(nn.Linear(D, H), nn.SiLU(), nn.Linear(H, D)), Experts),
    "linear": (lambda: nn.Linear(D, D), ModuleExperts),
    "layernorm_mlp": (lambda: nn.Sequential(nn.Linear(D, H), nn.LayerNorm(H), nn.ReLU(), nn.Linear(H, D)),
                      ModuleExperts),
    "linear_no_bias": (lambda: nn.Linear(D, D, bias=False), ModuleExperts),
}


def random_module(name):
    """The module with every tensor drawn at random (biases and LayerNorm's affine included)."""
    module = MODULES[name][0]()
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return module


def build_pair(module, **kwargs):
    """DeepSpeed's layer and ours from the same module, ours routing with DeepSpeed's gate weight."""
    settings = dict(num_experts=E, k=2, capacity_factor=1.0, min_capacity=0, use_rts=False,
                    top2_2nd_expert_sampling=False, **kwargs)
    native = NativeMoE(D, module, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the general path is slower
        ours = dsi.MoE(D, module, **settings)
    with torch.no_grad():
        ours.deepspeed_moe.router.weight_ED.copy_(native.deepspeed_moe.gate.wg.weight)
    return native, ours


def expert_differences(native, ours):
    """Largest difference of each expert tensor, under the native names (ours renames its state dict)."""
    theirs, mine = native.state_dict(), ours.state_dict()
    assert sorted(theirs) == sorted(mine)
    return {key: (theirs[key] - mine[key]).abs().max().item() for key in theirs if ".experts." in key}


def output_difference(native, ours, x_TD):
    out = [layer(x_TD) for layer in (native, ours)]
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(out[0], out[1]))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_expert_starts_as_the_module(name):
    module = random_module(name)
    before = {key: value.clone() for key, value in module.state_dict().items()}
    native, ours = build_pair(module)
    assert isinstance(ours.deepspeed_moe.experts, MODULES[name][1])
    differences = expert_differences(native, ours)
    assert differences and max(differences.values()) == 0, differences
    # copies: training our experts leaves the module (and DeepSpeed's copies of it) as they were
    with torch.no_grad():
        for param in ours.deepspeed_moe.experts.parameters():
            param.add_(1.0)
    assert all(torch.equal(module.state_dict()[key], value) for key, value in before.items())
    x_TD = torch.randn(T, D)
    with torch.no_grad():
        for param in ours.deepspeed_moe.experts.parameters():
            param.sub_(1.0)
    assert output_difference(native, ours, x_TD) < TOLERANCE


def test_the_module_may_be_fp64():
    module = random_module("relu_bias").double()
    native, ours = build_pair(module)
    differences = expert_differences(native, ours)
    assert max(differences.values()) < 1e-7, differences   # fp64 copied into the layer's fp32 experts


def ep2_worker(rank, world, names):
    from helpers.deepspeed import setup_worker
    setup_worker(rank, world)
    worst = {}
    for i, name in enumerate(names):
        torch.manual_seed(100 + i)   # the same module on both ranks, as a model built from one seed
        native, ours = build_pair(random_module(name), ep_size=2)
        native.set_deepspeed_parallelism()
        differences = expert_differences(native, ours)
        x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(7 + rank))
        worst[name] = (len(differences), max(differences.values()), output_difference(native, ours, x_TD))
    return worst


@pytest.mark.slow
def test_every_expert_starts_as_the_module_at_ep_size_2():
    names = ["relu_bias", "relu_no_bias", "linear", "layernorm_mlp"]
    for worst in run_workers(ep2_worker, 2, names, timeout=150):
        for name, (count, weights, outputs) in worst.items():
            assert count > 0 and weights == 0, (name, weights)
            assert outputs < TOLERANCE, (name, outputs)


def zero_init_worker(rank, world):
    import deepspeed
    from helpers.deepspeed import setup_worker
    setup_worker(rank, world)
    torch.manual_seed(3)   # the same module on both ranks
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    found = {}
    for where in ("outside", "inside"):
        module = random_module("relu_bias")
        if where == "inside":   # the module partitioned too: its weights are gathered for the copy
            with deepspeed.zero.Init(config_dict_or_path=config):
                module = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                with torch.no_grad():
                    for param in module.parameters():
                        param.copy_(torch.randn_like(param))
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            whole = {"w1_EDH": module[0].weight.t().clone(), "b1_EH": module[0].bias.clone(),
                     "w2_EHD": module[2].weight.t().clone(), "b2_ED": module[2].bias.clone()}
        with deepspeed.zero.Init(config_dict_or_path=config):
            layer = dsi.MoE(D, module, num_experts=E, k=1, use_rts=False)
        experts = layer.deepspeed_moe.experts
        params = list(experts.parameters())
        with deepspeed.zero.GatheredParameters(params):
            found[where] = (all(hasattr(p, "ds_id") for p in params),
                            all(torch.equal(getattr(experts, name)[i], tensor)
                                for name, tensor in whole.items() for i in range(E)))
    return found


@pytest.mark.slow
def test_every_expert_starts_as_the_module_under_zero_init():
    """Built under deepspeed.zero.Init (the layer's weights partitioned, and the module's too): gathered copies."""
    for found in run_workers(zero_init_worker, 2, timeout=200):
        assert found == {"outside": (True, True), "inside": (True, True)}, found
