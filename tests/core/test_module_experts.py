"""The general path (any expert module) and the identity activation, against the einsum reference and a
plain per-token loop; expert parallelism on 2 gloo processes against one process.

What this module tests (moved here from the README):

- `tests/core/test_module_experts.py` (fp64). Four kinds of module (Linear with and without bias, a LayerNorm
  MLP, a custom residual module with a constant buffer), k = 1 and 3, with drops and dropless. Each is
  checked against the einsum reference: outputs, aux loss and every gradient.
- The same file also has:
  - a plain per-token loop;
  - identity on the fast path against the reference, and against the same weights on the general path;
  - warn-once, the named errors, per-expert seeding, autocast;
  - ep_size 2 on 2 gloo processes against one process, sometimes with a rank that gets no tokens.
"""
import warnings

import pytest
import torch
from torch import nn

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.module_experts import ModuleExperts
from moe_plugin.reference import reference_moe

from helpers.launch import run_workers

D = 6


class ScaledResidual(nn.Module):
    """A custom expert: tanh MLP plus a residual, scaled by a constant buffer."""

    def __init__(self, dim):
        super().__init__()
        self.inner, self.outer = nn.Linear(dim, 5), nn.Linear(5, dim, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.scale * (self.outer(torch.tanh(self.inner(x))) + x)


EXPERTS = {
    "linear": lambda: nn.Linear(D, D),
    "linear_no_bias": lambda: nn.Linear(D, D, bias=False),
    "layernorm_mlp": lambda: nn.Sequential(nn.Linear(D, 7), nn.LayerNorm(7), nn.GELU(approximate="tanh"),
                                           nn.Linear(7, D)),
    "custom": lambda: ScaledResidual(D),
}


def distinct(layer):
    """Every expert its own random weights (they start as copies of one module)."""
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return layer


def grads(y, x, upstream, aux, params):
    return torch.autograd.grad((y * upstream).sum() + aux, [x] + params)


@pytest.mark.parametrize("capacity_factor", [0.6, 0.0], ids=["drops", "dropless"])
@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("expert", sorted(EXPERTS))
def test_general_path_matches_reference(expert, top_k, capacity_factor):
    config = MoEConfig(model_dim=D, hidden_size=4, num_experts=5, top_k=top_k, capacity_factor=capacity_factor,
                       min_capacity=1, z_loss_coef=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        layer = distinct(MoELayer(config, expert=EXPERTS[expert]()).double())
    x = torch.randn(3, 7, D, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn_like(x)
    params = list(layer.parameters())

    y = layer(x)
    got = grads(y, x, upstream, layer.aux_loss, params)
    y_ref, aux_ref = reference_moe(layer, x)
    want = grads(y_ref, x, upstream, aux_ref, params)

    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(layer.aux_loss, aux_ref)
    for name, g, w in zip(["x"] + [n for n, _ in layer.named_parameters()], got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")
    if capacity_factor:
        assert layer.stats["dropped_fraction"] > 0


def test_general_path_equals_a_plain_loop_over_tokens():
    """Top-1 without drops: every token is its chosen expert's module times the softmax gate."""
    config = MoEConfig(model_dim=D, hidden_size=4, num_experts=4, top_k=1, capacity_factor=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        layer = distinct(MoELayer(config, expert=EXPERTS["custom"]()).double())
    x = torch.randn(11, D, dtype=torch.float64)
    probs = torch.softmax(x @ layer.router.weight_ED.t(), dim=1)
    want = torch.stack([probs[t].max() * layer.experts.local[int(probs[t].argmax())](x[t:t + 1])[0]
                        for t in range(x.shape[0])])
    torch.testing.assert_close(layer(x), want)


@pytest.mark.parametrize("bias", [True, False])
def test_identity_activation_on_the_fast_path(bias):
    """Linear -> Linear: activation identity on the stacked-weights path, with drops and k = 3; the same
    experts as modules on the general path give the same result."""
    config = MoEConfig(model_dim=D, hidden_size=4, num_experts=5, top_k=3, capacity_factor=0.7, min_capacity=1,
                       activation="identity", bias=bias)
    layer = MoELayer(config).double()
    x = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn_like(x)
    y = layer(x)
    got = grads(y, x, upstream, layer.aux_loss, list(layer.parameters()))
    y_ref, aux_ref = reference_moe(layer, x)
    want = grads(y_ref, x, upstream, aux_ref, list(layer.parameters()))
    torch.testing.assert_close(y, y_ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        general = MoELayer(config, expert=nn.Sequential(nn.Linear(D, 4, bias=bias), nn.Linear(4, D, bias=bias)))
    general = general.double()
    state = {"router.weight_ED": layer.router.weight_ED, "router.expert_bias_E": layer.router.expert_bias_E}
    for e in range(5):
        state[f"experts.local.{e}.0.weight"] = layer.experts.w1_EDH[e].t()
        state[f"experts.local.{e}.1.weight"] = layer.experts.w2_EHD[e].t()
        if bias:
            state[f"experts.local.{e}.0.bias"] = layer.experts.b1_EH[e]
            state[f"experts.local.{e}.1.bias"] = layer.experts.b2_ED[e]
    general.load_state_dict(state)
    torch.testing.assert_close(general(x), y)


def test_warns_once_that_it_is_the_slower_path():
    class OnceExpert(nn.Linear):
        pass

    config = MoEConfig(model_dim=D, hidden_size=4, num_experts=2)
    with pytest.warns(RuntimeWarning, match="OnceExpert.*general path.*slower"):
        MoELayer(config, expert=OnceExpert(D, D))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MoELayer(config, expert=OnceExpert(D, D))


class TupleOut(nn.Linear):
    def forward(self, x):
        return super().forward(x), x


@pytest.mark.parametrize("module, match", [
    (nn.Linear(D, D + 1), r"Linear must map rows .* gave shape \(3, 7\)"),
    (nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)), r"Sequential changes its buffers \['1.running_mean'"),
    (TupleOut(D, D), r"TupleOut must map rows .* gave tuple"),
    (nn.Linear(D + 2, D), r"Linear cannot run on routed rows"),
])
def test_modules_that_cannot_run_are_named(module, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(MoEConfig(model_dim=D, hidden_size=4, num_experts=2), expert=module)


def test_bad_expert_arguments():
    config = MoEConfig(model_dim=D, hidden_size=4, num_experts=2)
    with pytest.raises(TypeError, match="expert must be a torch.nn.Module, got builtin_function_or_method"):
        MoELayer(config, expert=torch.tanh)
    with pytest.raises(ValueError, match="cannot slice"):
        ModuleExperts(config.replace(ep_size=4), nn.Linear(D, D), slices=2)
    with pytest.raises(ValueError, match=r"parallel='auto' is invalid with expert module Linear"):
        ModuleExperts(config.replace(ep_size=2, parallel="auto"), nn.Linear(D, D), local_experts=1)


def test_reset_parameters_draws_each_expert_from_its_own_seed():
    config = MoEConfig(model_dim=D, hidden_size=4, num_experts=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        full = ModuleExperts(config, EXPERTS["layernorm_mlp"]())
        part = ModuleExperts(config, EXPERTS["layernorm_mlp"](), first_expert=2, local_experts=2)
    torch.manual_seed(7)
    full.reset_parameters()
    torch.manual_seed(7)
    part.reset_parameters()
    weights = [m[0].weight for m in full.local]
    assert not torch.equal(weights[0], weights[1])
    torch.testing.assert_close(part.local[0][0].weight, weights[2], rtol=0, atol=0)
    torch.testing.assert_close(part.local[1][3].bias, full.local[3][3].bias, rtol=0, atol=0)
    share = part.local_share({"router.weight_ED": torch.ones(1), **{f"experts.{k}": v for k, v in
                                                                     full.state_dict().items()}})
    assert sorted(share) == sorted(["router.weight_ED"] + [f"experts.{k}" for k in part.state_dict()])
    torch.testing.assert_close(share["experts.local.1.0.weight"], full.local[3][0].weight, rtol=0, atol=0)


def test_autocast_runs_the_modules_in_the_autocast_dtype():
    config = MoEConfig(model_dim=D, hidden_size=4, num_experts=3, top_k=2, capacity_factor=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        layer = distinct(MoELayer(config, expert=EXPERTS["layernorm_mlp"]()))
    x = torch.randn(10, D, requires_grad=True)
    want = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=0.05, atol=0.05)
    y.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in layer.experts.parameters())


def _expert_parallel_worker(rank, world, seed):
    torch.manual_seed(seed)
    base = dict(model_dim=D, hidden_size=4, num_experts=4, top_k=3, capacity_factor=0.8, min_capacity=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reference = distinct(MoELayer(MoEConfig(**base), expert=EXPERTS["custom"]()).double())
        layer = MoELayer(MoEConfig(**base, ep_size=world), expert=EXPERTS["custom"]()).double()
    layer.load_full_state_dict(reference.state_dict())
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = [9, 0] if seed % 2 else [9, 5]        # sometimes a rank with no tokens
    xs = [torch.randn(n, D, generator=generator, dtype=torch.float64) for n in tokens]
    upstreams = [torch.randn(n, D, generator=generator, dtype=torch.float64) for n in tokens]

    ref_params = dict(reference.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in ref_params.items()}
    for i, (x, upstream) in enumerate(zip(xs, upstreams)):
        x = x.clone().requires_grad_()
        y = reference(x)
        got = grads(y, x, upstream, reference.aux_loss, list(ref_params.values()))
        for n, g in zip(ref_params, got[1:]):
            total[n] += g
        if i == rank:
            mine = {"y": y.detach(), "x": got[0], **dict(zip(ref_params, got[1:]))}

    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    params = dict(layer.named_parameters())
    got = grads(y, x, upstreams[rank], layer.aux_loss, list(params.values()))
    errors = {"y": _error(y, mine["y"]), "x": _error(got[0], mine["x"])}
    first = layer.groups.layout.first_expert
    for name, g in zip(params, got[1:]):
        if name.startswith("experts.local."):
            index, rest = name[len("experts.local."):].split(".", 1)
            want = total[f"experts.local.{int(index) + first}.{rest}"]
        else:
            want = mine[name]
        errors[name] = _error(g, want)
    return errors


def _error(got, want):
    assert got.shape == want.shape
    return (got - want).abs().max().item() if got.numel() else 0.0


@pytest.mark.slow
def test_expert_parallel_general_path_matches_one_process(fresh_seed):
    for errors in run_workers(_expert_parallel_worker, 2, fresh_seed, timeout=180):
        assert max(errors.values()) < 1e-12, errors
