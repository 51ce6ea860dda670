"""MoELayer: router -> plan -> dispatcher (the experts on the routed rows) -> shared expert, a drop-in for a
transformer FFN block. On eager CPU with the native kernels, and on eager CUDA with the Triton kernels, routing and
experts run as one autograd node (one_process/node_cpu.py, one_process/node_cuda.py) where it covers the configuration.

Shape legend: moe_plugin/__init__.py.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from . import dispatch
from .one_process import fused_route, node_cpu, node_cuda
from .config import AUTO, MoEConfig
from .dispatchers import Dispatcher
from .experts import RECORD, WEIGHT_NAMES, Experts, expert_record
from .guards import check_expert_sharding, check_plain_ddp
from .module_experts import ModuleExperts
from .parallel import fsdp_state_dict
from .parallel.groups import ExpertGroups, build_groups
from .parallel.tuner import OnceTuner, Tuner
from .router import Router, autocast_off, autocast_on
from .shared_expert import SharedExpert


class MoELayer(nn.Module):
    """forward(x[..., model_dim]) -> y of the same shape and dtype; under torch.autocast, of the
    autocast dtype (as nn.Linear): the expert GEMMs and the routing kernels run in it, the router in
    fp32 when fp32_router, and weight gradients come out in the parameters' dtype. Outside autocast
    the input must have the parameters' dtype.

    After each forward: .aux_loss holds aux_loss_coef * balance loss + z_loss_coef * z-loss, and
    .stats the tokens per expert, the dropped fraction and the capacity used (computed when read,
    from device tensors: the training forward itself never waits for the device).
    """

    def __init__(self, config: Union[MoEConfig, Mapping[str, Any], None] = None, ep_group=None,
                 expert: Optional[nn.Module] = None, **kwargs):
        """ep_group: a host framework's expert-parallel process group (default: built from the world), or
        ExpertGroups already built (a host that binds its group later: integrations/deepspeed/native.py).
        expert: any module mapping [rows, model_dim] to [rows, model_dim]; every expert starts as a copy
        of it and runs on the general path (module_experts.py; hidden_size and activation then unused).
        Without it the experts are the fast path's Linear -> activation -> Linear."""
        super().__init__()
        if config is None:
            config = MoEConfig(**kwargs)
        elif isinstance(config, Mapping):
            config = MoEConfig.from_dict({**config, **kwargs})
        elif kwargs:
            config = config.replace(**kwargs)
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoELayer expects an MoEConfig or a dict, got {type(config).__name__}")
        if config.redundant_experts not in (0, "auto") and config.ep_size > 1 and expert is not None:
            raise ValueError(f"MoEConfig.redundant_experts={config.redundant_experts} is invalid with expert=<a module>: "
                             f"copies send stacked expert weights; use the built-in experts or redundant_experts=0")
        self.config = config
        self.router = Router(config)
        self.groups = ep_group if isinstance(ep_group, ExpertGroups) else build_groups(
            config.num_experts, config.hidden_size, config.ep_size, config.node_size, ep_group)
        layout = self.groups.layout
        if expert is None:
            self.experts = Experts(config, layout.first_expert, layout.local_experts, layout.slices, layout.slice_index)
        else:
            self.experts = ModuleExperts(config, expert, layout.first_expert, layout.local_experts, layout.slices)
        self.shared_expert = SharedExpert(config) if config.shared_hidden_size else None
        self.tuner = self._make_tuner() if self.is_parallel else None
        self._dispatcher = self.make_dispatcher()
        self.aux_loss = torch.zeros((), device="cpu")
        self._routing = None          # (load_E, kept_E, capacity info) of the last forward, for .stats
        # persistent (CUDA graphs: a replay writes into them; nothing holds a tensor of a past replay): the last
        # forward's loads and kept rows per expert, and its aux loss's value. Plain attributes, not buffers: DDP
        # must not broadcast them and state dicts do not hold them.
        self._stats_2E = torch.zeros(2, config.num_experts, dtype=torch.long, device=self.router.weight_ED.device)
        self._stats_rows = tuple(self._stats_2E)      # its two rows, as views made once (not per forward)
        self._aux_value = torch.zeros((), device=self.router.weight_ED.device)
        self._parallel_stats: dict = {}

    def reset_parameters(self) -> None:
        """Re-draws every submodule's parameters (after building on the meta device and to_empty)."""
        for module in self.children():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        self.aux_loss = torch.zeros((), device="cpu")
        self._routing = None

    def _apply(self, fn, recurse=True):
        """The persistent stats follow the parameters' device (fresh zeros: to_empty may come from meta)."""
        super()._apply(fn, recurse)
        device = self.router.weight_ED.device
        if self._stats_2E.device != device:
            self._stats_2E = torch.zeros_like(self._stats_2E, device=device)
            self._stats_rows = tuple(self._stats_2E)
            self._aux_value = torch.zeros((), device=device)
            self._routing = None
        return self

    @property
    def aux_loss_value(self) -> torch.Tensor:
        """The last forward's aux loss, detached, in a tensor every forward writes into (a persistent buffer:
        safe to read after later calls and CUDA-graph replays, where .aux_loss is that forward's own output)."""
        return self._aux_value

    @property
    def stats(self) -> dict:
        """Tokens per expert, dropped fraction, capacity and capacity used of the last forward (plus the
        parallel degrees chosen, with expert parallelism); read from the device now, not in forward."""
        if self._routing is None:
            return dict(self._parallel_stats)
        return {**_stats(*self._routing), **self._parallel_stats}

    def __getstate__(self):
        """copy.deepcopy and pickling: the last forward's aux loss travels without its graph."""
        state = dict(self.__dict__)
        state["aux_loss"] = self.aux_loss.detach()
        state.pop("_stats_rows", None)      # views of _stats_2E: plain pickle would copy them apart; remade on load
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_stats_2E" in state:
            self._stats_rows = tuple(self._stats_2E)

    @property
    def is_parallel(self) -> bool:
        return self.groups.ep_group is not None

    def _candidates(self):
        """(r, d, a2a) settings the configuration allows; the a2a of r = 0 (no exchange) is moot."""
        cfg, layout = self.config, self.groups.layout
        degrees = [cfg.parallel] if cfg.parallel not in AUTO else self.experts.parallel_degrees(layout)
        for r in degrees:
            layout.check_degree(r)
        overlaps = [1, 2, 4] if cfg.overlap_degree in AUTO else [cfg.overlap_degree]
        two_step = 1 < self.groups.node_size < layout.ep_size
        a2as = (["flat", "2dh"] if two_step else ["flat"]) if cfg.a2a == "auto" else [cfg.a2a]
        return [(r, d, a) for r in degrees for d in overlaps for a in a2as if r != 0 or (d == 1 and a == a2as[0])]

    def redundant_experts(self):
        """MoEConfig.redundant_experts, or 0 where copies cannot work (sliced experts, parallel 0, expert modules:
        an integer is refused there by MoEConfig and __init__, "auto" makes none)."""
        cfg = self.config
        if self.groups.layout.slices > 1 or cfg.parallel == 0 or not self.experts.stacked:
            return 0
        return cfg.redundant_experts

    def _make_tuner(self):
        """Tuner (per-load, re-tuned) for "auto" (redundant_experts "auto" included); OnceTuner for "auto_once"
        and for fixed settings."""
        cfg = self.config
        if "auto_once" in (cfg.parallel, cfg.overlap_degree):
            return OnceTuner(self._candidates(), group=self.groups.ep_group)
        replicas = self.redundant_experts() == "auto"
        if "auto" in (cfg.parallel, cfg.overlap_degree, cfg.a2a) or replicas:
            shape = dict(ep_size=cfg.ep_size, node_size=self.groups.node_size, model_dim=cfg.model_dim,
                         hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                         matrices=3 if cfg.activation.startswith(("swiglu", "geglu")) else 2)
            return Tuner(self._candidates(), shape, replicas=replicas)
        return OnceTuner(self._candidates())

    def make_dispatcher(self) -> Dispatcher:
        """The layer's dispatcher for its groups and tuner: all-to-all over its expert-parallel group, or every
        expert here: the one of highest priority that applies (dispatchers/base.py)."""
        return Dispatcher.for_layer(self)

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a state dict of the layer holding all experts (ep_size 1): this rank keeps its share (of the LoRA
        adapter's factors too: add_lora first)."""
        local = self.experts.local_share(state)
        if isinstance(self.tuner, Tuner) and "tuner._extra_state" not in state:
            local["tuner._extra_state"] = self.tuner.get_extra_state()
        self.load_state_dict(with_record(local, "", self.groups.layout))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Also records which experts this rank's stacks hold (expert_record), in the state dict's metadata: the
        dict Module.state_dict keeps per module in state_dict._metadata, which torch.save and torch.load keep
        and key lists never show."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None and prefix[:-1] in metadata:
            metadata[prefix[:-1]][RECORD] = expert_record(self.groups.layout)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if not isinstance(self.tuner, Tuner):   # a tuner's dictionary, saved by a layer with one: nothing to load into
            state_dict.pop(prefix + "tuner._extra_state", None)
        place_experts(self, state_dict, prefix, local_metadata.get(RECORD))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    def set_recompute(self, mode: str) -> None:
        """Sets MoEConfig.recompute on a built layer ("none" or "experts"; see MoEConfig): from its next forward on."""
        self.config = self.config.replace(recompute=mode)      # validated
        self.experts.config = self.config

    def capacity_factor(self) -> float:
        cfg = self.config
        if not self.training and cfg.eval_capacity_factor is not None:
            return cfg.eval_capacity_factor
        return cfg.capacity_factor

    def forward(self, x: torch.Tensor, parallel: Optional[int] = None,
                overlap_degree: Optional[int] = None, sequence_T: Optional[torch.Tensor] = None,
                router_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """parallel / overlap_degree override the configured (or tuned) degrees for this call.
        aux_loss "seq" takes x's second-to-last dim as the sequence, or sequence_T: each token's
        sequence index in [0, tokens) (for sequences of different lengths). router_input (x's shape): what the
        router sees instead of x (Gemma 4 routes the residual stream and feeds the experts its normed copy)."""
        cfg = self.config
        if x.dim() < 1 or x.shape[-1] != cfg.model_dim:
            raise ValueError(f"MoELayer expects input [..., model_dim={cfg.model_dim}], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"MoELayer expects a floating-point input, got {x.dtype}")
        parallel_layer = self.is_parallel
        if parallel_layer:
            check_expert_sharding(self)
            check_plain_ddp(self)
        elif cfg.ep_size == 1 and self.training and cfg.redundant_experts not in (0, "auto") \
                and not _IDLE_COPIES_WARNED:
            _say_copies_idle(cfg.redundant_experts)
        x_TD = x.reshape(-1, cfg.model_dim)
        # the last forward's aux loss no longer holds its graph while this one builds: a graph kept alive keeps the
        # parameters' AccumulateGrad nodes on the stream that made them (CUDA-graph capture on another then fails).
        # Its value stays: a forward that activation checkpointing re-runs in backward stops once it has recomputed
        # what backward needs, before it sets .aux_loss
        self.__dict__["aux_loss"] = self.aux_loss.detach()
        autocast = autocast_on(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else self._compute_dtype(x, False)

        if router_input is not None and router_input.shape != x.shape:
            raise ValueError(f"MoELayer: router_input must have x's shape {tuple(x.shape)}, "
                             f"got {tuple(router_input.shape)}")
        routed_TD = x_TD if router_input is None else router_input.reshape(-1, cfg.model_dim)
        one_node, kernels = (None, None) if parallel_layer else _one_node(x_TD, autocast)
        weights = self.experts.weights(dtype) \
            if kernels is not None and fused_route.routed_as_configured(self, routed_TD) else None
        if weights is not None and one_node.eligible(self, x_TD, routed_TD, weights):   # one autograd node
            # under autocast (CUDA) the experts take x in the autocast dtype, the router x as given
            with autocast_off(x.device.type) if autocast else _NO_CONTEXT:
                y_TD, aux_loss, plan = one_node.moe(self, x_TD.to(dtype), None if router_input is None and not autocast
                                                    else routed_TD, weights, self.capacity_factor(), kernels)
            if self.shared_expert is not None:
                y_TD = y_TD + self.shared_expert(x_TD).to(y_TD.dtype)
        else:
            y_TD, aux_loss, plan = self._route_and_dispatch(x, x_TD, routed_TD, dtype, autocast, parallel,
                                                            overlap_degree, sequence_T)

        state = self.__dict__     # plain attributes (no parameter, buffer or module): nn.Module's __setattr__ skipped
        state["aux_loss"] = aux_loss
        if self._stats_2E.device != plan.load_E.device:     # moved by hand (not .to()): follow the input
            self._stats_2E = torch.zeros_like(self._stats_2E, device=plan.load_E.device)
            self._stats_rows = tuple(self._stats_2E)
            self._aux_value = torch.zeros((), device=plan.load_E.device)
        load_E, kept_E = self._stats_rows
        if plan.load_E is not load_E:      # the fused CUDA routing wrote them (and the aux value) in place
            load_E.copy_(plan.load_E)
            kept_E.copy_(plan.kept_E)
            self._aux_value.copy_(aux_loss.detach())
        state["_routing"] = (load_E, kept_E, plan.capacity_factor, plan.fixed, x_TD.shape[0], cfg.top_k)
        if parallel_layer:
            self._parallel_stats = self._dispatcher.stats()
        return y_TD.view(x.shape[:-1] + (cfg.model_dim,))

    def _route_and_dispatch(self, x, x_TD, routed_TD, dtype, autocast, parallel, overlap_degree, sequence_T):
        """(y_TD, aux loss, plan): the router (fused_route, or the reference), then the dispatcher."""
        cfg = self.config
        device_type = x.device.type
        if fused_route.eligible(self, routed_TD):     # eager CUDA and CPU: one autograd node
            gate_TK, aux_loss, plan = fused_route.route(self, routed_TD, self.capacity_factor(), dtype)
        else:
            gate_TK, aux_loss, plan, _ = fused_route.reference(self, routed_TD, self.capacity_factor(), dtype,
                                                               x.shape[-2] if x.dim() >= 3 else None, sequence_T)

        # the shared expert takes the input as given, under the caller's autocast (nn.Linear casts itself)
        shared = None if self.shared_expert is None else _SharedOutput(self.shared_expert, x_TD)
        x_TD = x_TD.to(dtype)
        if cfg.gate_on_input:   # the expert gets x * gate, its output is kept whole
            x_TD, gate_TK, plan = dispatch.gate_inputs(x_TD, gate_TK, plan)
        dispatcher = self._dispatcher
        if dispatcher.groups is not self.groups or dispatcher.tuner is not self.tuner:
            dispatcher = self._dispatcher = self.make_dispatcher()   # a host bound the groups after __init__
        eager = autocast and device_type in EAGER_EXPERTS_UNDER_COMPILED_AUTOCAST and \
            torch.compiler.is_compiling() and self.experts.parameter_dtype(dtype) != dtype
        # the expert path runs in dtype already (entering a disabled autocast where none is on costs host time)
        with autocast_off(device_type) if autocast else _NO_CONTEXT:
            # the shared expert runs while the first all-to-all is in flight
            args = (x_TD, gate_TK, plan, self.experts, shared, parallel, overlap_degree, self.training)
            y_TD = _eagerly(dispatcher, *args) if eager else dispatcher(*args)
        if cfg.gate_on_input and cfg.top_k > 1:
            y_TD = y_TD.view(cfg.top_k, -1, cfg.model_dim).sum(0)
        if shared is not None:
            y_TD = shared.add_to(y_TD)
        return y_TD, aux_loss, plan

    def _compute_dtype(self, x: torch.Tensor, autocast: Optional[bool] = None) -> torch.dtype:
        """The autocast dtype under autocast (autocast: whether it is on, if known); else the input's, which must be
        the parameters'."""
        if autocast_on(x.device.type) if autocast is None else autocast:
            return torch.get_autocast_dtype(x.device.type)
        param_dtype = self.experts.parameter_dtype(self.router.weight_ED.dtype)
        if x.dtype != param_dtype:
            raise TypeError(f"MoELayer got an input of dtype {x.dtype} but its parameters are {param_dtype}: "
                            f"cast the input or the layer (layer.to({x.dtype})), or run under torch.autocast")
        return x.dtype

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"model_dim={cfg.model_dim}, hidden_size={cfg.hidden_size}, num_experts={cfg.num_experts}, "
                f"top_k={cfg.top_k}, capacity_factor={cfg.capacity_factor}, router={cfg.router}, "
                f"activation={cfg.activation}")


def _one_node(x_TD: torch.Tensor, autocast: bool):
    """(module, its kernels) of the one-node path for x_TD's device and mode: node_cpu (eager CPU, the native
    kernels; not under autocast) or node_cuda (eager CUDA, the Triton kernels); (None, None) where neither
    runs."""
    native = None if autocast else node_cpu.kernels(x_TD)
    if native is not None:
        return node_cpu, native
    route = node_cuda.kernels(x_TD)
    return (node_cuda, route) if route is not None else (None, None)


# On CUDA with torch 2.11 (H200, 2026-11-28) the compiled expert path with fp32 expert weights under bf16 autocast gave
# every expert weight a wrong gradient (relative error 1.0 against eager; eager right; benchmarks/RESULTS.md): until
# a GPU run shows it right, that case runs the expert path eagerly inside the compiled graph (a graph break)
EAGER_EXPERTS_UNDER_COMPILED_AUTOCAST = ("cuda",)


_IDLE_COPIES_WARNED: list = []


def _say_copies_idle(count: int) -> None:
    """Once per process: an integer redundant_experts at ep_size 1 (accepted there, so that plans and checkpoint
    tools can rebuild a config at ep_size 1) copies nothing in training."""
    _IDLE_COPIES_WARNED.append(True)
    warnings.warn(f"moe_plugin: redundant_experts={count} does nothing at ep_size 1: every process holds every "
                  f"expert, so no rank waits on another's; copies of hot experts balance expert-parallel ranks "
                  f"(ep_size > 1)", UserWarning, stacklevel=3)


@torch._disable_dynamo     # torch.compiler.disable, with torch._dynamo imported at the first call, not with moe_plugin
def _eagerly(dispatcher, *args):
    if not _EAGER_WARNED:
        _EAGER_WARNED.append(True)
        warnings.warn("moe_plugin: under torch.compile with autocast and expert weights in another dtype, the expert "
                      "path runs eagerly (a graph break): its compiled gradients were measured wrong on CUDA with "
                      "torch 2.11. Expert weights in the autocast dtype compile whole.", RuntimeWarning, stacklevel=2)
    return dispatcher(*args)


_EAGER_WARNED: list = []
_NO_CONTEXT = contextlib.nullcontext()     # stateless: one for every call


class _SharedOutput:
    """Computes the shared expert's output when called (once; under the autocast that was on when this
    was made, as the call may come from inside the expert path), adds it to the routed output."""

    def __init__(self, shared_expert: Optional[SharedExpert], x_TD: torch.Tensor):
        self.shared_expert, self.x_TD, self.y_TD = shared_expert, x_TD, None
        device = x_TD.device.type
        self.autocast = (device, torch.get_autocast_dtype(device)) if autocast_on(device) else None

    def __call__(self) -> None:
        if self.shared_expert is not None and self.y_TD is None:
            with torch.autocast(self.autocast[0], dtype=self.autocast[1]) if self.autocast else contextlib.nullcontext():
                self.y_TD = self.shared_expert(self.x_TD)

    def add_to(self, y_TD: torch.Tensor) -> torch.Tensor:
        self()
        return y_TD if self.y_TD is None else y_TD + self.y_TD.to(y_TD.dtype)


def _stats(load_E: torch.Tensor, kept_E: torch.Tensor, capacity_factor: float, fixed: int, num_tokens: int,
           top_k: int) -> dict:
    load, kept = load_E.tolist(), int(kept_E.sum())
    largest = max(load, default=0) if num_tokens else 0
    capacity = dispatch.padded_capacity(capacity_factor, fixed, largest)
    choices, slots = num_tokens * top_k, capacity * len(load)
    return {
        "tokens_per_expert": load,
        "dropped_fraction": 1.0 - kept / choices if choices else 0.0,
        "capacity": capacity,
        "capacity_used": kept / slots if slots else 0.0,
    }


def with_record(state: Mapping[str, Any], prefix: str, layout) -> dict:
    """state as an OrderedDict whose metadata says that the layer at prefix holds this rank's own experts."""
    out = OrderedDict(state)
    out._metadata = OrderedDict({prefix[:-1]: {RECORD: expert_record(layout)}})
    return out


def _expert_keys(layer: MoELayer, state: Mapping[str, Any], prefix: str) -> list:
    """The keys of state under prefix that hold the layer's experts under its own names (stacks, LoRA factors,
    or expert modules)."""
    names = tuple(f"experts.{n}" for n in WEIGHT_NAMES) if layer.experts.stacked else ()
    starts = ("experts.lora.",) if layer.experts.stacked else ("experts.local.",)
    return [k for k in state if k.startswith(prefix) and (k[len(prefix):] in names or k[len(prefix):].startswith(starts))]


def _held(layer: MoELayer, state: Mapping[str, Any], prefix: str, keys: list, record: Optional[dict]) -> Optional[dict]:
    """What state's expert tensors hold (an expert_record): every expert when they have the whole stack's shape
    (or, for expert modules, one entry per expert), else what the record says (None: nothing known)."""
    layout = layer.groups.layout
    E = layout.num_experts
    whole = {"num_experts": E, "ep_size": 1, "ep_rank": 0, "experts": [0, E], "slices": 1, "slice": 0}
    if layer.experts.stacked:
        w1, own = state.get(prefix + "experts.w1_EDH"), layer.experts.w1_EDH
        if own.dim() == 3 and torch.is_tensor(w1):      # (ZeRO-3 leaves a partitioned parameter 1-D and empty)
            shape = (E, own.shape[1], own.shape[2] * layout.slices)
            if tuple(w1.shape) == shape != tuple(own.shape):
                return whole
    else:
        indices = {int(k[len(prefix + "experts.local."):].split(".", 1)[0]) for k in keys}
        if indices == set(range(E)) and len(layer.experts.local) != E:
            return whole
    return record


def place_experts(layer: MoELayer, state: dict, prefix: str, record: Optional[dict]) -> None:
    """Before a layer loads state (in place): its expert tensors made this rank's own, or a ValueError.

    The record (expert_record, from the state dict's metadata) or the tensors' shapes say which experts state
    holds: this rank's -> loaded as they are; every expert (a whole [num_experts, ...] stack, what one process
    holding all experts saves) or whole experts including this rank's -> this rank's share is taken; others ->
    refused. With no record and the rank's own shapes (a state dict rebuilt as a plain dict, or built by a host:
    DCP, FSDP2's set_model_state_dict, DeepSpeed's and fairseq's per-rank files) they load as this rank's own."""
    keys = _expert_keys(layer, state, prefix)
    if not keys or _placed_by_host(layer):
        return
    layout = layer.groups.layout
    mine, held = expert_record(layout), _held(layer, state, prefix, keys, record)
    fields = ("num_experts", "experts", "slices", "slice")
    if held is None or all(held.get(f) == mine[f] for f in fields):
        return
    (lo, hi), (my_lo, my_hi) = held["experts"], mine["experts"]
    if held.get("num_experts") == layout.num_experts and held.get("slices") == 1 and lo <= my_lo and my_hi <= hi:
        share = layer.experts.local_share({k[len(prefix):]: state.pop(k) for k in keys}, first=lo)
        state.update({prefix + k: v for k, v in share.items()})
        return
    part = "" if held.get("slices", 1) == 1 else f" (hidden slice {held['slice']} of {held['slices']})"
    my_part = "" if mine["slices"] == 1 else f" (hidden slice {mine['slice']} of {mine['slices']})"
    raise ValueError(
        f"MoELayer{' ' + prefix.rstrip('.') if prefix else ''}: the state dict holds experts {lo}..{hi - 1}{part} of "
        f"{held.get('num_experts')} (saved by ep_rank {held.get('ep_rank')} of ep_size {held.get('ep_size')}), but this "
        f"process (ep_rank {layout.ep_rank} of ep_size {layout.ep_size}) needs experts {my_lo}..{my_hi - 1}{my_part} of "
        f"{layout.num_experts}: a process's state dict holds only its own experts. Save on every rank and load each "
        f"rank's own file, or save moe_plugin.train.full_state_dict(model) (every expert; call it on every rank) and "
        f"load it with moe_plugin.train.load_full_state_dict(model, state)")


def _placed_by_host(layer: MoELayer) -> bool:
    """Whether a host puts each expert where it belongs in this load: torch's state-dict API on an FSDP2-sharded
    layer (parallel/fsdp_state_dict.py places every expert by its place in the whole stack), or DeepSpeed's
    engine (it reads each rank's experts from the files of their global indices)."""
    from torch.distributed.tensor import DTensor
    sharded = any(isinstance(p, DTensor) for p in layer.experts.parameters())
    return bool((sharded and fsdp_state_dict._torch_state_dict_api_frames())
                or fsdp_state_dict._frames("deepspeed.runtime.engine", "load_module_state_dict"))


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of .aux_loss over every MoELayer in model (from each layer's last forward)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoELayer)]
    total = losses[0] if losses else torch.zeros(())
    for loss in losses[1:]:
        total = total + loss.to(total.device)
    return total
