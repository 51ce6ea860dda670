"""What the one-node paths' tests share (tests/one_process/test_node_cpu.py on CPU, test_node_cuda.py on the CUDA
path): a small layer with every parameter drawn, one step's outputs and named gradients, and a count of the path's
runs."""
import contextlib

import torch

from moe_plugin import MoEConfig, MoELayer

BASE = dict(model_dim=16, hidden_size=24, num_experts=6, top_k=2, capacity_factor=0.0, min_capacity=0,
            activation="swiglu", aux_loss="none", aux_loss_coef=0.0, bias=False)
# the cases both paths' tests run (each file adds what its path covers besides): MoEConfig options over BASE
CASES = {
    "dropless swiglu": dict(normalize_gate="before_drop"),
    "drops, k 3, gshard, z-loss": dict(capacity_factor=0.6, top_k=3, aux_loss="gshard", aux_loss_coef=0.01,
                                       z_loss_coef=0.001),
    "biases, relu, switch loss": dict(bias=True, activation="relu", aux_loss="switch", aux_loss_coef=0.02),
    "gelu, after-drop normalization, scale": dict(activation="gelu", capacity_factor=1.0,
                                                  normalize_gate="after_drop", route_scale=2.5),
    "shared expert": dict(shared_hidden_size=8, shared_gate=True),
}


def make(dtype=torch.float32, **options) -> MoELayer:
    layer = MoELayer(MoEConfig(**{**BASE, **options})).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():      # biases drawn too (they start at 0)
            p.add_(torch.randn_like(p) * 0.05)
    return layer


def outputs(layer, x, router_input=None, upstream=None, context=contextlib.nullcontext):
    """(y, aux, stats, {name: grad}, upstream) of one forward and the backward of <y, upstream> + aux, both inside
    context()."""
    x = x.detach().requires_grad_(x.is_floating_point())
    inputs = [x] + ([] if router_input is None else [router_input])
    with context():
        y = layer(x, router_input=router_input)
        upstream = torch.randn_like(y) if upstream is None else upstream
        wanted = [t for t in inputs + list(layer.parameters()) if t.requires_grad]
        grads = torch.autograd.grad((y * upstream).sum() + layer.aux_loss, wanted, allow_unused=True)
    names = ["x", "router_input"][:len(inputs)] + [n for n, _ in layer.named_parameters()]
    named = dict(zip([n for n, t in zip(names, inputs + list(layer.parameters())) if t.requires_grad], grads))
    return y.detach(), layer.aux_loss.detach(), layer.stats, named, upstream


def count_runs(monkeypatch, module) -> list:
    """A list that grows by one at each run of module.moe (the one-node path's entry)."""
    calls = []
    moe = module.moe
    monkeypatch.setattr(module, "moe", lambda *args: calls.append(1) or moe(*args))
    return calls


def assert_no_grad_forward_is_the_graph_forward(ran: list, context=contextlib.nullcontext) -> None:
    """Under no_grad the path gives the graph forward's output, aux loss and stats, and runs both times (ran: the
    path's count of runs); both forwards inside context()."""
    layer = make(capacity_factor=0.8, top_k=3, aux_loss="gshard", aux_loss_coef=0.01)
    x = torch.randn(21, 16)
    with context():
        with_graph = layer(x)
        aux, stats = layer.aux_loss.detach(), layer.stats
        with torch.no_grad():
            y = layer(x)
    assert len(ran) == 2 and not y.requires_grad
    assert torch.equal(y, with_graph.detach()) and torch.equal(layer.aux_loss, aux) and layer.stats == stats
