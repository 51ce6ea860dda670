"""A plan put together from what any host's run holds: the roles' bytes (given), the MoE layers' traffic, the
activations and FLOPs of one micro-batch (a forward on CPU fake tensors), the step time and the largest
micro-batch. experiment.py feeds it a `moe-plugin train` experiment; the DeepSpeed adapter
(moe_plugin.integrations.deepspeed.plan) a DeepSpeed config with a Hugging Face model.

Legend: B rows per rank (the micro-batch), S sequence length.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ..config import RECOMPUTE_MODES, MoEConfig
from ..layer import MoELayer
from .devices import Device
from .state_bytes import StateBytes, nbytes, saved_for_backward
from .skew import LayerSkew, layer_skews
from .step_time import StepTime, step_time
from .traffic import LayerTraffic, check_capacity, layer_traffic


@dataclass
class Role:
    ranks: List[int]
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    all_to_all_bytes: int           # one step, balanced routing
    all_to_all_bound_bytes: int     # one step, the busiest rank at the capacity bound
    all_reduce_bytes: int           # gradients handed to all-reduce (DDP, ZeRO 0-1)
    reduce_scatter_bytes: int       # gradients handed to reduce-scatter (FSDP2, ZeRO 2-3)
    all_gather_bytes: int           # parameters gathered (FSDP2 and ZeRO 3: forward and backward; ZeRO 1-2: once)
    peak_bytes: int


@dataclass
class RecomputeOption:
    """What one MoEConfig.recompute mode gives the same run: activations of the micro-batch, the largest role's peak
    and the largest micro-batch that fits."""
    activations_bytes: int
    peak_bytes: int
    max_micro_batch: int
    step_seconds: float


@dataclass
class Collectives:
    all_reduce: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0


@dataclass
class Plan:
    world_size: int
    node_size: int
    device: Device
    micro_batch: int
    tokens_per_rank: int
    roles: List[Role]
    layers: List[LayerTraffic]
    step: StepTime
    max_micro_batch: int
    activation_bytes_per_row: int
    recompute: Dict[str, RecomputeOption] = field(default_factory=dict)     # mode -> what it gives
    moe_activations: List[int] = field(default_factory=list)    # each MoE layer's share of the activations
    warnings: List[str] = field(default_factory=list)
    skews: Optional[List[LayerSkew]] = None     # with --skew: each MoE layer's busiest rank and replicas


def split_bytes(model: nn.Module) -> Tuple[int, int]:
    """(dense, expert-parallel experts') trainable parameter bytes of an unsharded model."""
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) and m.is_parallel
               for p in m.experts.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return (sum(nbytes(p) for p in trainable if id(p) not in experts),
            sum(nbytes(p) for p in trainable if id(p) in experts))


def forward_without_data(make_local_model: Callable[[], nn.Module], rows: int, seq_len: int) -> Tuple[int, float]:
    """(bytes saved for backward, forward FLOPs) of one forward + loss on `rows` rows of seq_len tokens of the
    model make_local_model() builds (its experts local: at balanced routing each rank computes as many rows as it
    routes). The model is built on the meta device, then given CPU fake tensors (torch's FakeTensorMode: shapes,
    no data), so that the forward takes the CPU kernels' paths and saves what they save."""
    with torch.device("meta"):
        model = make_local_model()
    saved: Dict[str, int] = {}
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")       # kernels without data
        model.to_empty(device="cpu")
        x_BS = torch.zeros(rows, seq_len, dtype=torch.long)
        with FlopCounterMode(display=False) as flops, saved_for_backward(model, saved):
            hf = getattr(model, "hf", None)     # moe-plugin train's HFCausalLM, which runs hf without a cache
            # without a cache HF reads the position ids to rule out packed sequences; it cannot read fake tensors and
            # would build the mask the real run skips (and repeat the kv heads for it); with one it reads nothing
            output = model(x_BS) if hf is None else hf(input_ids=x_BS, use_cache=True)
            logits = getattr(output, "logits", output)      # a Hugging Face model's output holds them
            F.cross_entropy(logits.flatten(0, -2).float(), x_BS.flatten())
    return saved["bytes"], float(flops.get_total_flops())


def moe_layer_saved_bytes(config: MoEConfig, tokens: int, dtype: torch.dtype) -> int:
    """What one MoE layer (every expert local) keeps for backward of `tokens` tokens, as forward_without_data
    counts it."""
    with torch.device("meta"):
        layer = MoELayer(config.replace(ep_size=1)).to(dtype)
    saved: Dict[str, int] = {}
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")
        layer.to_empty(device="cpu")
        with saved_for_backward(layer, saved):
            layer(torch.zeros(tokens, config.model_dim, dtype=dtype, requires_grad=True))
    return saved["bytes"]


def assemble(first: nn.Module, held: List[Tuple[List[int], StateBytes]], collectives: Collectives, rows: int,
             seq_len: int, make_local_model: Callable[[], nn.Module], world_size: int, node_size: int,
             device: Device, sharded: bool, batch_key: str, levers: str, capacity_key: str,
             root_bytes: int = 0, skew=None) -> Plan:
    """The plan of a run whose rank-0 model (unsharded) is `first` and whose roles hold `held`. batch_key,
    capacity_key: the host's names of the micro-batch and capacity_factor settings (for its errors); root_bytes:
    the trainable bytes FSDP2 gathers forward only (step_time); skew: --skew's (skew.read_skew), None for balanced
    routing."""
    dense_bytes, expert_bytes = split_bytes(first)
    moe_layers = [m for m in first.modules() if isinstance(m, MoELayer)]
    dtypes = [m.experts.parameter_dtype(torch.float32) for m in moe_layers]
    for layer in moe_layers:
        check_capacity(layer.config, rows * seq_len, capacity_key, batch_key)

    def traffic(batch: int) -> List[LayerTraffic]:
        return [layer_traffic(m.config, batch * seq_len, next(m.experts.parameters()).element_size(), node_size)
                for m in moe_layers]

    def activations_at(batch: int) -> Tuple[int, float]:
        """(bytes kept for backward, forward FLOPs) of a micro-batch of `batch` rows."""
        saved, flops = forward_without_data(make_local_model, batch, seq_len)
        return saved + sum(t.kept_bytes for t in traffic(batch)), flops

    measured: Dict[str, int] = {}       # repr(config) -> its layer's saved bytes (layers alike: measured once)

    def layer_saved(config: MoEConfig, dtype: torch.dtype) -> int:
        key = f"{config!r} {dtype}"
        if key not in measured:
            measured[key] = moe_layer_saved_bytes(config, rows * seq_len, dtype)
        return measured[key]

    def kept_apart(mode: str) -> int:
        """How much more the micro-batch keeps as configured than with every MoE layer at recompute `mode` (each
        distinct layer measured alone: linear in the rows, as the activations are)."""
        return sum(layer_saved(m.config, dtype) - layer_saved(m.config.replace(recompute=mode), dtype)
                   for m, dtype in zip(moe_layers, dtypes))

    layers = traffic(rows)
    activations, flops = activations_at(rows)
    # the bytes one more row adds (the activations are linear in the rows)
    per_row = activations - activations_at(rows - 1)[0] if rows > 1 else activations_at(2)[0] - activations
    roles = [Role(ranks, h.parameters, h.gradients, h.optimizer, activations,
                  sum(t.bytes_balanced for t in layers), sum(t.bytes_bound for t in layers),
                  collectives.all_reduce, collectives.reduce_scatter, collectives.all_gather,
                  h.parameters + h.gradients + h.optimizer + activations) for ranks, h in held]
    ep_size = max([m.config.ep_size for m in moe_layers], default=1)

    skews = layer_skews([m.config for m in moe_layers], skew, device.params,
                        [next(m.experts.parameters()).element_size() for m in moe_layers],
                        [t.rows_kept for t in layers], node_size)

    def timing_of(configs) -> StepTime:
        return step_time(device.params, world_size, node_size, flops, configs, layers, dense_bytes, expert_bytes,
                         ep_size, sharded, root_bytes, skews)

    timing = timing_of([m.config for m in moe_layers])
    fixed = max(r.parameters_bytes + r.gradients_bytes + r.optimizer_bytes for r in roles)

    def largest_batch(activations: int, per_row: int) -> int:
        room = device.memory_bytes - fixed - (activations - rows * per_row)
        return int(max(0, room // per_row)) if per_row > 0 else 0

    max_batch = largest_batch(activations, per_row)
    moe_activations = [layer_saved(m.config, dtype) + t.kept_bytes for m, dtype, t in zip(moe_layers, dtypes, layers)]
    plan = Plan(world_size, node_size, device, rows, rows * seq_len, roles, layers, timing, max_batch, per_row,
                moe_activations=moe_activations, skews=skews)
    for mode in RECOMPUTE_MODES if moe_layers else ():
        apart = kept_apart(mode)
        mode_activations, mode_per_row = activations - apart, per_row - apart // rows
        mode_timing = timing_of([m.config.replace(recompute=mode) for m in moe_layers])
        plan.recompute[mode] = RecomputeOption(mode_activations, fixed + mode_activations,
                                               largest_batch(mode_activations, mode_per_row), mode_timing.seconds)
    peak = max(r.peak_bytes for r in roles)
    if peak > device.memory_bytes:
        fits = f"the largest micro-batch that fits is {batch_key}={max_batch}" if max_batch else \
            f"not even {batch_key}=1 fits (a shorter sequence may)"
        plan.warnings.append(f"the plan needs {peak / 2**30:.1f} GiB on a rank, over the "
                             f"{device.memory_bytes / 2**30:.0f} GiB of a {device.name}: {fits}; "
                             f"other levers: {levers}")
    return plan
