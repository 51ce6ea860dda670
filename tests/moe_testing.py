"""Shared helpers for comparing the fast layer with the einsum reference, and for launching
`moe-plugin train` on 2 processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.reference import reference_moe


def make_layer(dtype=torch.float64, **overrides) -> MoELayer:
    values = dict(model_dim=12, hidden_size=20, num_experts=4, top_k=2, capacity_factor=1.0, min_capacity=0,
                  z_loss_coef=0.01)
    values.update(overrides)
    return MoELayer(MoEConfig(**values)).to(dtype)


def outputs_and_grads(forward, layer, x):
    """Output, and gradients of (output . fixed random weights + aux loss) w.r.t. x and every parameter."""
    x = x.detach().requires_grad_()
    y, aux = forward(x)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad((y * upstream).sum() + aux, [x] + params, allow_unused=True)
    return y.detach(), aux.detach(), dict(zip(["x"] + [n for n, _ in layer.named_parameters()], grads))


def fast(layer):
    def forward(x):
        y = layer(x)
        return y, layer.aux_loss
    return forward


def reference(layer):
    return lambda x: reference_moe(layer, x)


def relative_error(actual, expected) -> float:
    if expected is None:
        return 0.0 if actual is None or not actual.abs().max() else float("inf")
    actual = torch.zeros_like(expected) if actual is None else actual
    scale = expected.abs().max().clamp(min=1e-30)
    return float((actual.double() - expected.double()).abs().max() / scale)


def assert_matches_reference(layer, x, tolerance):
    y, aux, grads = outputs_and_grads(fast(layer), layer, x)
    y_ref, aux_ref, grads_ref = outputs_and_grads(reference(layer), layer, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    errors = {"y": relative_error(y, y_ref), "aux": relative_error(aux, aux_ref)}
    errors.update({f"grad {name}": relative_error(grads[name], grads_ref[name]) for name in grads_ref})
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{worst} off by {errors[worst]:.3g} (all: {errors})"
    return errors


def random_slots(T, E, K, capacity):
    """Routes for the slot kernels: distinct experts per token (as top-k gives), each expert's first
    row when the kept rows are packed by expert, and the number of kept rows."""
    expert_TK = torch.rand(T, E).topk(K, dim=1).indices
    kept_E = torch.bincount(expert_TK.reshape(-1), minlength=E).clamp(max=capacity)
    return expert_TK, kept_E.cumsum(0) - kept_E, int(kept_E.sum())


def torchrun_train(out: Path, *arguments, timeout=200):
    """`moe-plugin train *arguments` under torchrun on 2 processes writing to out (which must not be the
    working folder): (result.json, the metrics.jsonl records)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "moe_plugin.cli", "train", *arguments, f"log.out_dir={out}"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "result.json").read_text()), records


# ops that read device memory on the host (or size their output by it): a host synchronization on a GPU
HOST_SYNCING_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                    torch.ops.aten.item.default, torch.ops.aten.masked_select.default,
                    torch.ops.aten.bincount.default, torch.ops.aten.repeat_interleave.Tensor,
                    torch.ops.aten._unique2.default)


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs() as record:` ... then record.seen names every host-syncing op that ran."""

    def __init__(self, ops=HOST_SYNCING_OPS):
        super().__init__()
        self.ops, self.seen = set(ops), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
