"""MoEConfig(recompute="experts") against recompute="none" (itself held to the einsum reference elsewhere): the same
outputs, aux loss and every gradient (fp64 to 1e-12, bf16 to rounding) on every expert path (the one-node CPU path,
the fused dispatcher path, the grouped experts module, module experts, LoRA), with dropped tokens, empty experts,
k > 2 and odd sizes, under torch.utils.checkpoint and torch.compile; and what it buys: the bytes a forward keeps for
backward fall to at most 0.25x of "none" (issue 45's target), counted by saved-tensor hooks."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.one_process import node_cpu
from moe_plugin.lora import add_lora
from moe_plugin.plan.state_bytes import saved_for_backward
from helpers.compare import relative_error
from helpers.reference import assert_matches_reference

BASE = dict(model_dim=24, hidden_size=40, num_experts=6, top_k=2, capacity_factor=0.0, min_capacity=0,
            activation="swiglu", bias=False, z_loss_coef=0.01)
CASES = {
    "dropless swiglu": {},
    "drops, k 3, biases, relu": dict(capacity_factor=0.6, top_k=3, bias=True, activation="relu"),
    "gelu, fixed capacity": dict(activation="gelu", capacity_factor=1.0, bias=True),
    "geglu, k 1, empty experts": dict(activation="geglu", top_k=1, num_experts=16),
    "clamped gpt-oss swiglu": dict(activation="swiglu_oai", activation_limit=0.5, activation_alpha=1.702, bias=True),
    "shared expert": dict(shared_hidden_size=8),
}


def pair(dtype=torch.float64, expert=None, **options):
    """Layers with recompute "none" and "experts", the same weights."""
    none = MoELayer(MoEConfig(**{**BASE, **options}), expert=expert).to(dtype)
    with torch.no_grad():
        for p in none.parameters():     # biases drawn too (they start at 0)
            p.add_(torch.randn_like(p) * 0.05)
    experts = MoELayer(MoEConfig(**{**BASE, **options, "recompute": "experts"}), expert=expert).to(dtype)
    experts.load_state_dict(none.state_dict())
    return none, experts


def run(layer, x, upstream, wrap=None):
    """(y, aux, {name: grad}) of <y, upstream> + aux, its forward through wrap (e.g. a checkpoint) if given."""
    x = x.detach().requires_grad_()
    y = wrap(layer, x) if wrap else layer(x)
    loss = (y.float() * upstream).sum() + layer.aux_loss.float()
    names = ["x"] + [n for n, p in layer.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x] + [p for p in layer.parameters() if p.requires_grad])
    return y.detach(), layer.aux_loss.detach(), dict(zip(names, grads))


def assert_same(a, b, tolerance):
    (y, aux, grads), (y_ref, aux_ref, grads_ref) = a, b
    errors = {"y": relative_error(y, y_ref), "aux": relative_error(aux, aux_ref)}
    errors.update({name: relative_error(grads[name], grads_ref[name]) for name in grads_ref})
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{worst} off by {errors[worst]:.3g} (all: {errors})"


@pytest.mark.parametrize("one_node", [True, False], ids=["one-node path", "dispatcher path"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_experts_recompute_equals_none(case, dtype, one_node, monkeypatch):
    monkeypatch.setattr(node_cpu, "ENABLED", one_node)
    none, experts = pair(dtype, **CASES[case])
    x = torch.randn(53, BASE["model_dim"], dtype=dtype)
    upstream = torch.randn(53, BASE["model_dim"])
    # recomputing runs the same kernels on the same inputs: equal to rounding, and in fact bit for bit here
    assert_same(run(experts, x, upstream), run(none, x, upstream), 1e-12 if dtype == torch.float64 else 1e-2)
    if dtype == torch.float64:
        assert_matches_reference(experts, x, 1e-10)


def test_module_experts_and_lora_recompute_equal_none():
    """The general path (any module as the expert: each runs under torch.utils.checkpoint) and LoRA adapters on the
    grouped path (their low-rank up projection recomputed with it)."""
    expert = torch.nn.Sequential(torch.nn.Linear(24, 20), torch.nn.Tanh(), torch.nn.Linear(20, 24))
    none, experts = pair(expert=expert, capacity_factor=0.8, top_k=3)
    x, upstream = torch.randn(37, 24, dtype=torch.float64), torch.randn(37, 24)
    assert_same(run(experts, x, upstream), run(none, x, upstream), 1e-12)

    none, experts = pair()
    for layer in (none, experts):
        torch.manual_seed(5)
        add_lora(layer, rank=4, alpha=8, targets=("up", "down"))
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if "lora" in name:
                    p.add_(torch.randn_like(p) * 0.1)     # B starts at 0: give the adapter a term to recompute
    assert any("lora" in n for n, p in experts.named_parameters() if p.requires_grad)
    assert_same(run(experts, x, upstream), run(none, x, upstream), 1e-12)


def test_recompute_under_activation_checkpointing():
    """torch.utils.checkpoint around the layer (what HF's gradient_checkpointing does): both modes still agree."""
    none, experts = pair(capacity_factor=0.7, top_k=3, bias=True, activation="relu")
    x, upstream = torch.randn(45, 24, dtype=torch.float64), torch.randn(45, 24)

    def wrap(layer, x):
        return checkpoint(layer, x, use_reentrant=False)
    assert_same(run(experts, x, upstream, wrap), run(none, x, upstream), 1e-12)


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_recompute_under_torch_compile(activation):
    torch._dynamo.reset()
    none, experts = pair(torch.float32, activation=activation, capacity_factor=1.0, bias=activation == "relu")
    compiled = torch.compile(experts, fullgraph=True)
    for T in (41, 41):      # the second call runs the cached graph
        x, upstream = torch.randn(T, 24), torch.randn(T, 24)
        got = run(experts, x, upstream, lambda layer, x: compiled(x))
        assert_same(got, run(none, x, upstream), 1e-5)


@pytest.mark.parametrize("one_node", [True, False], ids=["one-node path", "dispatcher path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_mode_keeps_at_most_a_quarter(dtype, one_node, monkeypatch):
    """At a Mixtral-like width ratio (H = 3.5 D, gated, k 2, dropless) the forward keeps x and the routing only."""
    monkeypatch.setattr(node_cpu, "ENABLED", one_node)
    kept = {}
    for mode in ("none", "experts"):
        layer = MoELayer(MoEConfig(model_dim=64, hidden_size=224, num_experts=8, top_k=2, capacity_factor=0.0,
                                   activation="swiglu", bias=False, recompute=mode)).to(dtype)
        x = torch.randn(301, 64, dtype=dtype, requires_grad=True)
        total = {}
        with saved_for_backward(layer, total):
            y = layer(x)
        y.sum().backward()        # the saved tensors are all read: recompute did not need anything else
        kept[mode] = total["bytes"]
    assert kept["experts"] <= 0.25 * kept["none"], kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU kernels' recompute path)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_recompute_equals_none_on_cuda(dtype):
    """On the GPU's kernels (grouped_mm, Triton's gather_up where it measured faster), also under bf16 autocast."""
    none, experts = pair(dtype, top_k=3, capacity_factor=0.8)
    none, experts = none.cuda(), experts.cuda()
    x, upstream = torch.randn(203, 24, dtype=dtype, device="cuda"), torch.randn(203, 24, device="cuda")
    assert_same(run(experts, x, upstream), run(none, x, upstream), 1e-6 if dtype == torch.float32 else 1e-2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = run(experts.float(), x.float(), upstream), run(none.float(), x.float(), upstream)
    assert_same(got, want, 1e-2)
