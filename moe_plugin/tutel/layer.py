"""moe_layer: Tutel's MoE layer, with its arguments, math and state dicts, as a MoELayer.

TutelMoELayer is a MoELayer whose router is one of its gates (gates[gate_index], per call), whose per-call settings
(top_k, capacity_factor, the capacity's alignment) choose a MoEConfig for that call, and whose state dict has Tutel's
keys and layouts (names.py); forward takes Tutel's arguments and returns y with y.l_aux.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..layer import MoELayer
from . import arguments, names
from .experts import CustomExperts, FFNExperts, LlamaExperts, init_like_tutel
from .gates import build_gate


class TutelMoELayer(MoELayer):
    """Built by moe_layer (Tutel's arguments). .gates: one router per gate; .experts: our stacked experts (or the
    general path's CustomExperts); ._num_global_experts: Tutel's buffer."""

    def __init__(self, gate_type, model_dim: int, experts=None, scan_expert_func=None, result_func=None, group=None,
                 seeds=None, a2a_ffn_overlap_degree: int = 1, is_postscore: bool = True,
                 batch_prioritized_routing: bool = False, normalize_gate: bool = True, is_gshard_loss: bool = True,
                 parallel_type: str = "adaptive:1", use_2dh: bool = False, **kwargs):
        kwargs.pop("pad_samples", None)       # Tutel: deprecated, always False
        if kwargs:
            raise ValueError(f"moe_layer: unknown arguments {sorted(kwargs)}")
        for variable in ("SKIP_MOE", "SKIP_EXPERT"):
            if int(os.environ.get(variable, "0")):
                raise ValueError(f"moe_layer: the environment sets {variable}={os.environ[variable]}: Tutel's "
                                 f"profiling switch that skips the layer is not supported by the drop-in")
        if isinstance(model_dim, bool) or not isinstance(model_dim, int) or model_dim < 2 or model_dim % 2:
            raise ValueError(f"moe_layer: model_dim={model_dim!r} must be an even integer (as Tutel requires)")
        if experts is None:
            raise ValueError("moe_layer: experts is required, e.g. {'type': 'ffn', 'count_per_node': 2, "
                             "'hidden_size_per_expert': 2048}")
        expert_spec = arguments.expert_spec(experts, model_dim)
        gate_specs = arguments.gate_specs(gate_type)
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        num_global = expert_spec.num_local * world
        degree = arguments.parallel_degree(parallel_type)
        overlap = arguments.check_int(a2a_ffn_overlap_degree, "a2a_ffn_overlap_degree", 1)
        if seeds is not None and len(seeds) < 2:
            raise ValueError(f"moe_layer: seeds={seeds!r} must hold 2 or 3 seeds (gates, experts[, after]), or None")
        self._settings = dict(is_postscore=bool(is_postscore), normalize_gate=bool(normalize_gate),
                              batch_prioritized_routing=bool(batch_prioritized_routing)
                              or int(os.environ.get("BATCH_PRIO", 0)) != 0,
                              is_gshard_loss=bool(is_gshard_loss), use_2dh=bool(use_2dh), parallel=degree)
        gate_configs = [self._config_for(model_dim, num_global, world, expert_spec, spec, spec.top_k,
                                         spec.capacity_factor, arguments.alignment(overlap, 0), overlap)
                        for spec in gate_specs]
        with torch.random.fork_rng(devices=[]):      # MoELayer's own draws leave the global random state alone
            super().__init__(gate_configs[0], ep_group=group if world > 1 else None)
        self._build_experts(expert_spec, seeds, model_dim)
        self._modules.pop("router")
        routers = []
        for i, (config, spec) in enumerate(zip(gate_configs, gate_specs)):
            if seeds is not None and seeds[0] is not None:
                torch.manual_seed(seeds[0] + i)
            routers.append(build_gate(config, spec))
        self.gates = nn.ModuleList(routers)
        if seeds is not None and len(seeds) > 2 and seeds[2] is not None:
            torch.manual_seed(seeds[2])
        self.register_buffer("_num_global_experts", torch.tensor(num_global))
        self.expert_spec, self.gate_specs, self.model_dim = expert_spec, gate_specs, model_dim
        self.group, self.world_size, self.sharded_count, self.num_local_experts = group, world, 1, expert_spec.num_local
        self.a2a_ffn_overlap_degree, self.megablocks_size = overlap, 0
        self.auto_parallel = degree == "auto"       # our tuner picks the degree per load (as Tutel's own name)
        self.adaptive_degree, self._tuned_overlap = (1 if self.auto_parallel else degree), overlap
        self.result_func, self.gate_index, self._configs = result_func, 0, {}
        self.l_aux: Optional[torch.Tensor] = None
        self._register_state_dict_hook(_to_tutel_keys)
        self._register_load_state_dict_pre_hook(_from_tutel_keys, with_module=True)
        for name, param in self.get_parameter_iterator("local_experts"):
            if scan_expert_func is not None:
                scan_expert_func(name, param)
            param._tutel_expert = True

    def __getstate__(self):
        """copy.deepcopy and pickling: the last forward's l_aux travels without its graph (as MoELayer's aux_loss)."""
        state = super().__getstate__()
        if state.get("l_aux") is not None:
            state["l_aux"] = state["l_aux"].detach()
        return state

    @property
    def router(self):
        """The gate of the call in progress (the last call's between calls); MoELayer's own while it is built."""
        gates = self._modules.get("gates")
        return self._modules["router"] if gates is None else gates[self.__dict__.get("gate_index", 0)]

    @property
    def num_global_experts(self) -> int:
        return int(self._num_global_experts)

    @staticmethod
    def global_expert_count(num_local_experts: int, group=None) -> int:
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 1:
            raise ValueError(f"global_expert_count: num_local_experts={num_local_experts!r} must be an integer >= 1 "
                             f"(experts shared by several processes are not supported by the drop-in)")
        return num_local_experts * world

    def _config_for(self, model_dim, num_global, world, expert_spec, gate_spec, top_k, capacity_factor, alignment,
                    overlap):
        return arguments.layer_config(model_dim, num_global, world, expert_spec, gate_spec, top_k=top_k,
                                      capacity_factor=capacity_factor, capacity_alignment=alignment,
                                      overlap_degree=overlap, **self._settings)

    def _build_experts(self, spec, seeds, model_dim: int) -> None:
        if seeds is not None and seeds[1] is not None:
            torch.manual_seed(seeds[1])
        if spec.fast:
            init_like_tutel(self.experts, spec, model_dim)
            return
        if spec.kind == "custom":
            module = spec.module(model_dim=model_dim, num_experts_per_device=spec.num_local, sharded_count=1,
                                 **spec.options)
        else:
            module = (FFNExperts if spec.kind == "ffn" else LlamaExperts)(spec, model_dim)
        self.experts = CustomExperts(module, spec.num_local)
        self.experts.__dict__["ctx"] = self
        self._dispatcher = self.make_dispatcher()
        self.tuner = self._make_tuner() if self.is_parallel else None

    def load_full_state_dict(self, state) -> None:
        """Load a state dict in Tutel's layout holding every expert (a one-process run's, or what `moe-plugin
        checkpoint convert --from tutel ... --ranks 1` writes): this process keeps its own experts."""
        if isinstance(self.experts, CustomExperts):
            raise ValueError("TutelMoELayer.load_full_state_dict: the general path's experts (a custom module or "
                             "activation) hold a layout of their own: load each process's state dict instead")
        first, local = self.groups.layout.first_expert, self.num_local_experts
        share = {}
        for key, value in state.items():
            if key.startswith("experts."):
                flat = value.dim() == 1
                value = value.reshape(self.num_global_experts, -1) if flat else value
                value = value[first:first + local].reshape(-1) if flat else value[first:first + local]
            share[key] = value
        self.load_state_dict(share)

    def extra_repr(self) -> str:
        gates = [f"k={spec.top_k}, noise={spec.gate_noise}" for spec in self.gate_specs]
        return f"Top-K(s) = {gates}, Total-Experts = {self.num_global_experts} [managed by {self.world_size} device(s)]"

    def get_parameter_iterator(self, param_type: str):
        """Tutel's names with our parameters (weights keep our layouts: batched_fc1_w is w1_EDH, [E, D, H])."""
        if param_type == "gate":
            return iter([(f"{i}.{name}", param) for i, gate in enumerate(self.gates)
                         for name, param in _tutel_gate_names(gate)])
        if param_type == "local_experts":
            return iter(_tutel_expert_names(self))
        raise ValueError(f"get_parameter_iterator: param_type={param_type!r} is not recognized: use 'gate' or "
                         f"'local_experts'")

    def forward(self, input: torch.Tensor, gate_index: int = 0, capacity_factor: Optional[float] = None,
                top_k: Optional[int] = None, a2a_ffn_overlap_degree: Optional[int] = None, reserve_dims: int = 1,
                inequivalent_tokens: bool = False, adaptive_r: Optional[int] = None, megablocks_size: int = 0):
        if input.dim() < 2:
            raise ValueError(f"moe_layer: the input must be at least 2-D ([samples, ..., model_dim]), got shape "
                             f"{tuple(input.shape)}")
        if reserve_dims != 1:
            raise ValueError(f"moe_layer forward: reserve_dims={reserve_dims!r} is not supported (only 1: the experts "
                             f"see [rows, model_dim])")
        if inequivalent_tokens and self.world_size > 1:
            raise ValueError("moe_layer forward: inequivalent_tokens=True (capacity from the largest token count over "
                             "processes) is not supported by the drop-in with more than one process")
        if not 0 <= gate_index < len(self.gates):
            raise ValueError(f"moe_layer forward: gate_index={gate_index!r} must be in [0, {len(self.gates)})")
        if a2a_ffn_overlap_degree is not None:     # as in Tutel, it stays for later calls
            self.a2a_ffn_overlap_degree = arguments.check_int(a2a_ffn_overlap_degree, "a2a_ffn_overlap_degree", 1)
        if adaptive_r is not None:
            if adaptive_r not in (0, 1):
                raise ValueError(f"moe_layer forward: adaptive_r={adaptive_r!r} must be 0 or 1 (experts gathered, or "
                                 f"expert parallel) where every process holds whole experts")
            self.adaptive_degree, self.auto_parallel = adaptive_r, False     # a degree asked for: the tuner stops
        if megablocks_size and (self.num_local_experts <= 1 or torch.is_grad_enabled() or self.world_size > 1):
            megablocks_size = 0      # as Tutel: its inference path applies to one process, several experts, no grad
        self.megablocks_size = megablocks_size
        spec = self.gate_specs[gate_index]
        top = top_k or spec.top_k
        factor = capacity_factor or spec.capacity_factor
        align = arguments.alignment(self.a2a_ffn_overlap_degree, megablocks_size)
        key = (gate_index, top, factor, align, self.a2a_ffn_overlap_degree)
        config = self._configs.get(key)
        if config is None:
            config = self._configs[key] = self._config_for(self.model_dim, self.num_global_experts, self.world_size,
                                                           self.expert_spec, spec, top, factor, align,
                                                           self.a2a_ffn_overlap_degree)
        x = input if torch.is_autocast_enabled(input.device.type) else \
            input.to(self.experts.parameter_dtype(input.dtype))
        gate, kept = self.gates[gate_index], (self.config, self.gates[gate_index].config, self.gate_index)
        self.config, gate.config, self.gate_index = config, config, gate_index
        try:
            parallel = overlap = None
            if self.is_parallel:     # under auto_parallel the tuner's choice, timed while it searches
                parallel = None if self.auto_parallel else self.adaptive_degree
                tuned = self.auto_parallel and self.a2a_ffn_overlap_degree == self._tuned_overlap
                overlap = None if tuned else self.a2a_ffn_overlap_degree
            y = super().forward(x, parallel=parallel, overlap_degree=overlap)
        finally:
            self.config, gate.config = kept[0], kept[1]
        y = y.to(input.dtype)
        self.l_aux = y.l_aux = self.aux_loss
        return self.result_func(y) if self.result_func is not None else y


moe_layer = TutelMoELayer    # as in Tutel, the class itself: moe_layer(...) builds one, isinstance(m, moe_layer) finds it


def _tutel_gate_names(gate):
    if gate.projector is None:
        return [("wg.weight", gate.weight_ED)]
    return [("temperature", gate.log_scale), ("sim_matrix", gate.weight_ED),
            ("cosine_projector.weight", gate.projector.weight), ("cosine_projector.bias", gate.projector.bias)]


def _tutel_expert_names(layer):
    experts = layer.experts
    if isinstance(experts, CustomExperts):
        return list(experts.module.named_parameters())
    if layer.expert_spec.kind == "llama_ffn":
        return [("W_fc1", experts.w1_EDH), ("W_fc3", experts.w2_EHD)]
    pairs = [("batched_fc1_w", experts.w1_EDH), ("batched_fc2_w", experts.w2_EHD)]
    if experts.b1_EH is not None:
        pairs += [("batched_fc1_bias", experts.b1_EH), ("batched_fc2_bias", experts.b2_ED)]
    return pairs


def _to_tutel_keys(layer, state, prefix, local_metadata):
    """state_dict hook: our keys under prefix -> Tutel's (names.py)."""
    ours = {key[len(prefix):]: state.pop(key) for key in list(state) if key.startswith(prefix)}
    out = {"_num_global_experts": ours.pop("_num_global_experts")}     # in Tutel's order: experts, then gates
    expert_keys = [key for key in ours if key.startswith("experts.")]
    if isinstance(layer.experts, CustomExperts):
        out.update({"experts." + key[len("experts.module."):]: ours.pop(key) for key in expert_keys})
    else:
        out.update(names.experts_to_tutel({key: ours.pop(key) for key in expert_keys},
                                          layer.expert_spec.kind == "llama_ffn"))
    for i in range(len(layer.gates)):
        gate = {"router." + key[len(f"gates.{i}."):]: ours.pop(key) for key in list(ours)
                if key.startswith(f"gates.{i}.")}
        gate.pop("router.expert_bias_E", None)         # always 0 here: the drop-in has no balancing bias
        out.update(names.gate_to_tutel(gate, i))
    ours.pop("tuner._extra_state", None)       # the tuner's timings: not Tutel's, re-measured after loading
    if ours:
        raise ValueError(f"TutelMoELayer.state_dict: keys {sorted(ours)} have no Tutel counterpart")
    state.update({prefix + key: value for key, value in out.items()})
    return state


def _from_tutel_keys(layer, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: Tutel's keys under prefix -> ours, checked as Tutel checks them."""
    tutel = {key[len(prefix):]: state.pop(key) for key in list(state) if key.startswith(prefix)}
    if "_num_global_experts" not in tutel:
        warnings.warn("TutelMoELayer: loading a state dict without _num_global_experts (Tutel's legacy format)")
        tutel["_num_global_experts"] = layer._num_global_experts.clone()
    elif int(tutel["_num_global_experts"]) != layer.num_global_experts:
        raise ValueError(f"TutelMoELayer.load_state_dict: the state holds {int(tutel['_num_global_experts'])} global "
                         f"experts, this layer {layer.num_global_experts}")
    ours = {"_num_global_experts": tutel.pop("_num_global_experts")}
    for i in range(len(layer.gates)):
        gate = {key: tutel.pop(key) for key in list(tutel) if key.startswith(f"gates.{i}.")}
        if gate:
            ours.update({f"gates.{i}." + key[len("router."):]: value
                         for key, value in names.gate_to_moe(gate, i).items()})
    expert_keys = [key for key in tutel if key.startswith("experts.")]
    if isinstance(layer.experts, CustomExperts):
        own = dict(layer.experts.module.named_parameters())
        for key in expert_keys:
            value = tutel.pop(key)
            name = key[len("experts."):]
            ours["experts.module." + name] = value.view(own[name].shape) \
                if name in own and value.numel() == own[name].numel() else value
    elif expert_keys:
        experts = {key: tutel.pop(key) for key in expert_keys}
        if layer.expert_spec.kind == "llama_ffn" and all(key in experts for key in names.LLAMA_KEYS):
            experts = names.llama_shapes(experts, layer.num_local_experts, layer.model_dim)
        ours.update(names.experts_to_moe(experts))
    if isinstance(layer.tuner, nn.Module) and type(layer.tuner).get_extra_state is not nn.Module.get_extra_state:
        ours["tuner._extra_state"] = layer.tuner.get_extra_state()
    ours.update(tutel)       # anything left is reported by load_state_dict as unexpected
    state.update({prefix + key: value for key, value in ours.items()})
