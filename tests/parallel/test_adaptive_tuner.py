"""The per-load tuner and asynchronous 2DH on 4 gloo processes ("nodes" of 2), fp64, in one spawn:
- a drifting load under parallel / overlap_degree / a2a "auto": every step's output and gradients equal
  the single-process layer whatever setting the tuner picked, and every rank picks the same;
- 2DH with overlap d > 1 equals flat with d = 1 (outputs and gradients), experts whole and sliced;
- no host synchronization but route_counts' in a tuned forward + backward;
- the dictionary survives state_dict.

What this module tests (moved here from the README):

- `tests/parallel/test_adaptive_tuner.py` runs one spawn of 4 gloo processes with 2 "nodes",
  fp64 (about 35 s). It checks:
  - over a drifting load, every step's output and gradients equal the single-process layer,
    whatever setting the tuner picked, and all ranks pick the same settings;
  - 2DH with d > 1 equals flat with d = 1, outputs and gradients, for whole and sliced experts;
  - a tuned forward + backward reads no device memory on the host except the counts
    `route_counts` gathers. Provenance is tracked through a dispatch mode; the CPU-only
    branches of moe_plugin/ops are exempt, and their CUDA branches are covered by
    test_compile.py's CUDA test;
  - the dictionary survives `state_dict`.
"""
import traceback

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from helpers.compare import relative_error
from helpers.expert_parallel import expected_shard, single_process_grads
from helpers.launch import run_workers
from helpers.paths import package_path
from moe_plugin import MoEConfig, MoELayer

D, H = 6, 8
PHASES = [3, 14, 5, 24]          # tokens per rank; the largest expert's rows follow them (capacity_factor < 0)
STEPS_PER_PHASE = 16


def drifting_load_equals_one_process(rank, world):
    torch.manual_seed(0)
    base = dict(model_dim=D, hidden_size=H, num_experts=2, top_k=2, capacity_factor=-1.0, min_capacity=0,
                activation="swiglu", z_loss_coef=0.01)
    reference = MoELayer(MoEConfig(**base)).double()
    tuned = dict(base, ep_size=world, parallel="auto", overlap_degree="auto", a2a="auto", node_size=2)
    layer = MoELayer(MoEConfig(**tuned)).double()
    layer.load_full_state_dict(reference.state_dict())
    layer.tuner.trials = 1                     # explore fast: one timed call per setting after its warm-up
    layer.tuner.prune = layer.tuner.prune_same_r = float("inf")   # time every candidate: which ones run must
                                                                  # not depend on timings (nor on the model)
    generator = torch.Generator().manual_seed(1)
    worst, used = 0.0, []
    for tokens in [n for n in PHASES for _ in range(STEPS_PER_PHASE)]:
        counts = [tokens + (3 * w) % 5 for w in range(world)]
        xs = [torch.randn(n, D, generator=generator, dtype=torch.float64) for n in counts]
        ups = [torch.randn(n, D, generator=generator, dtype=torch.float64) for n in counts]
        names, total, mine = single_process_grads(reference, xs, ups, rank)
        x = xs[rank].clone().requires_grad_()
        layer.zero_grad()
        y = layer(x)
        ((y * ups[rank]).sum() + layer.aux_loss).backward()
        params = dict(layer.named_parameters())
        errors = [relative_error(y.detach(), mine["y"], floor=1e-12),
                  relative_error(x.grad, mine["x.grad"], floor=1e-12)]
        for name in names:
            want = mine[name] if name.startswith("router.") else \
                expected_shard(total[name], name, layer.groups.layout, swiglu=True)
            errors.append(relative_error(params[name].grad, want, floor=1e-12))
        worst = max(worst, *errors)
        used.append((layer.stats["parallel"], layer.stats["overlap_degree"], layer.stats["a2a"]))

    table = layer.stats["tuned_table"]
    resumed = MoELayer(MoEConfig(**tuned)).double()
    resumed.load_state_dict(layer.state_dict())
    resumed(torch.randn(4, D, dtype=torch.float64))
    return dict(worst=worst, used=used, table=table, resumed=resumed.stats["tuned_table"],
                saved_key="tuner._extra_state" in layer.state_dict())


def two_step_overlap_equals_flat(rank, world):
    worst = {}
    for name, experts, r, d in [("whole experts d3", 8, 1, 3), ("sliced r2 d2", 2, 2, 2), ("sliced r1 d4", 2, 1, 4)]:
        torch.manual_seed(10 + experts)
        base = dict(model_dim=D, hidden_size=H, num_experts=experts, top_k=2, capacity_factor=0.0, min_capacity=0,
                    ep_size=world, node_size=2, parallel=r)
        flat = MoELayer(MoEConfig(**base, overlap_degree=1, a2a="flat")).double()
        two = MoELayer(MoEConfig(**base, overlap_degree=d, a2a="2dh")).double()
        two.load_state_dict(flat.state_dict())
        x = torch.randn(5 + 4 * rank, D, dtype=torch.float64)
        up = torch.randn_like(x)
        results = []
        for layer in (flat, two):
            x_in = x.clone().requires_grad_()
            (layer(x_in) * up).sum().backward()
            results.append([layer(x).detach(), x_in.grad] + [p.grad for p in layer.parameters()])
        assert [g is None for g in results[1]] == [g is None for g in results[0]]
        worst[name] = max(relative_error(got, want, floor=1e-12)
                          for got, want in zip(results[1], results[0]) if want is not None)
    return worst


SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
           torch.ops.aten.masked_select.default, torch.ops.aten.repeat_interleave.Tensor,
           torch.ops.aten._unique2.default, torch.ops.aten.bincount.default}


class HostReads(TorchDispatchMode):
    """Records every read of device memory by the host. Device memory: the layer's input, parameters and
    buffers, and whatever an op computes from them, except route_counts' result (its one host copy)."""

    def __init__(self):
        super().__init__()
        self.device, self.seen, self.allowed = WeakTensorKeyDictionary(), [], False

    def read(self, what):
        """The CPU branches of moe_plugin/ops read offsets on the host by design; their device branches
        do not (test_compile.py checks those on CUDA)."""
        frames = traceback.extract_stack()[:-2]
        if not any((package_path(frame.filename) or "").startswith("ops/") for frame in frames):
            ours = [frame for frame in frames if package_path(frame.filename)] or frames
            self.seen.append(f"{what} at {ours[-1].filename}:{ours[-1].lineno}")

    def on_device(self, tensors):
        return [t for t in tensors if isinstance(t, torch.Tensor) and t in self.device]

    def mark(self, tensors, on_device=True):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                if on_device:
                    self.device[t] = True
                else:
                    self.device.pop(t, None)

    def pack(self, tensor):
        """Tensors saved for backward come back as new objects: they keep their provenance."""
        return tensor, tensor in self.device

    def unpack(self, packed):
        self.mark([packed[0]], packed[1])
        return packed[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device_inputs = self.on_device(pytree.tree_leaves((args, kwargs)))
        if func in SYNCING and device_inputs:
            self.read(str(func))
        out = func(*args, **(kwargs or {}))
        if device_inputs:
            self.mark(pytree.tree_leaves(out))
        return out


def one_host_synchronization(rank, world):
    import moe_plugin.dispatchers.all_to_all as dispatcher_module
    torch.manual_seed(2)
    layer = MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=2, top_k=2, capacity_factor=-1.0,
                               ep_size=world, node_size=2, parallel="auto", overlap_degree="auto", a2a="auto",
                               shared_hidden_size=4))
    layer.tuner.prune = layer.tuner.prune_same_r = float("inf")
    record, original = HostReads(), dispatcher_module.route_counts
    calls = []

    def route_counts(*args, **kwargs):
        calls.append(1)
        try:
            record.allowed = True           # its copy of the gathered counts to the host is the one allowed
            result = original(*args, **kwargs)
        finally:
            record.allowed = False
        record.mark(result, on_device=False)
        return result
    dispatcher_module.route_counts = route_counts
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def reading(name):
        def read(self, *args, **kwargs):
            if record.on_device([self]) and not record.allowed:
                record.read(f"Tensor.{name}")
            return methods[name](self, *args, **kwargs)
        return read
    settings = set()
    try:
        for name in methods:
            setattr(torch.Tensor, name, reading(name))
        for step in range(24):
            x = torch.randn(6 + 3 * step % 11, D, requires_grad=True)
            record.mark([x, *layer.parameters(), *layer.buffers()])
            with record, torch.autograd.graph.saved_tensors_hooks(record.pack, record.unpack):
                layer(x).sum().backward()
            chosen = layer._parallel_stats      # layer.stats would read the routing counts: on purpose, when asked
            settings.add((chosen["parallel"], chosen["overlap_degree"], chosen["a2a"]))
    finally:
        for name, method in methods.items():
            setattr(torch.Tensor, name, method)
        dispatcher_module.route_counts = original
    return dict(seen=sorted(set(record.seen)), calls=len(calls), settings=len(settings))


def four_processes(rank, world):
    return dict(drift=drifting_load_equals_one_process(rank, world), overlap=two_step_overlap_equals_flat(rank, world),
                sync=one_host_synchronization(rank, world))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tuner_on_four_processes():
    results = run_workers(four_processes, 4, timeout=540)
    for rank, result in enumerate(results):
        drift = result["drift"]
        assert drift["worst"] < 1e-10, f"rank {rank}: a tuned step is off by {drift['worst']:.3g}"
        assert drift["used"] == results[0]["drift"]["used"], f"rank {rank} chose differently"
        assert len(set(drift["used"])) >= 6, drift["used"]        # settings switched mid-run
        assert drift["table"] and drift["table"] == results[0]["drift"]["table"]
        assert drift["saved_key"] and drift["resumed"] == drift["table"]
        for name, error in result["overlap"].items():
            assert error < 1e-12, f"rank {rank} {name}: 2DH overlapped is off by {error:.3g}"
        sync = result["sync"]
        assert sync["seen"] == [] and sync["calls"] == 24 and sync["settings"] >= 3, sync
