"""A DeepSpeed MoE checkpoint's optimizer state, loaded in another layout (world size, ep_size, ZeRO stage): at ZeRO
0-2 from ZeRO 0-2 in fp32, ZeRO 1-2 in bf16 or fp16, ZeRO 3 in fp32; at ZeRO 3 (fp32, no offload) from ZeRO 0-3 in
fp32.

DeepSpeed's own load fits only the saved layout (layout.py). Where the layouts differ, layout.py lets DeepSpeed load
what moves by itself (the weights, one file per expert; the LR scheduler; global_steps, global_samples,
skipped_steps) and then `load_optimizer_state` rebuilds this rank's optimizer state from the saved files: for each of
its parameters, the fp32 master weight and every optimizer state tensor (Adam's exp_avg, exp_avg_sq, step) as the
saved run held it, put together from the saved ranks' pieces. Each rank reads only the pieces of its own parameters
(files opened with mmap: untouched bytes are not read), one parameter at a time: no process holds the whole model.

Where the saved pieces are:
- ZeRO 0 (a torch optimizer): each expert-parallel rank's expp_rank_<e>_mp_rank_00_optim_states.pt holds the state
  of every parameter in that rank's order, which LAYOUT_FILE records by name ("optimizer_names"); no separate
  master weights (the weights are the masters in fp32).
- ZeRO 1/2: each rank's zero_pp_rank_<r>_mp_rank_00_optim_states.pt holds, per optimizer group, its flat partition
  of the masters and of each state tensor, and where each parameter's piece sits in it ("param_slice_mappings").
  A dense group is split over all ranks, an expert group over its expert-data-parallel ranks; a parameter is its
  pieces in rank order. bf16 runs keep the same fp32 masters and moments in bf16_zero_pp_rank_<r>_..., fp16 runs in
  the same files as fp32 ones, beside their loss scaler (the same on every rank); their 16-bit weights (DeepSpeed
  loads them from the model files) are the masters cast, as at save.
- ZeRO 3: each rank's zero_pp_rank_<r>_mp_rank_00_optim_states.pt holds, per group, its flat partition of the
  masters ("fp32_flat_groups") and of each state tensor: ceil(numel / ranks) elements of each parameter, in the order
  of the rank's model file's "param_shapes", over the ranks "ds_zero_partition_groups" records (all ranks for a dense
  group, the expert-data-parallel ones for an expert group). Its model files hold no weights, so
  load_zero3_module_state sets them to the masters (and the buffers, scheduler and counters) instead of DeepSpeed.
An expert tensor (stacked, experts first) moves between ep_sizes by whole experts: the current rank's experts are
cut from the saved ranks that held them.

Into ZeRO 3 (load_into_zero3), DeepSpeed's own load is not called: each parameter put together as above is cut into
this rank's ZeRO-3 partition and written into the optimizer's flat sub-group partitions, the weights' partitions set
to the masters (ZeRO 0's masters: its weights, from its model files); the rest of the engine's state comes from the
saved model file. A PipelineModule's checkpoints convert in reshard_pipeline.py (ZeRO 0-1 in fp32).

Not converted (layout.py stops with its error, naming why): ZeRO 3 with offload, ZeRO 3 in bf16/fp16, a ZeRO-0
checkpoint of Hugging Face blocks into ZeRO 3, pipelines in bf16, bf16 or fp16 at ZeRO 0, a change of precision,
layers of different ep_sizes in one model, experts kept as one module each (their names change with ep_size) when
ep_size changes.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.integrations.deepspeed.native import DeepSpeedMoELayer, _from_native_names
from moe_plugin.integrations.deepspeed.zero3 import Zero3MoE

__all__ = ["reshard_refusal", "load_optimizer_state", "load_zero3_module_state", "load_into_zero3", "save_time_record",
           "ReadCounter"]

MASTER = "fp32"     # the key of the master weights beside the optimizer's own state keys


class ReadCounter:
    """Bytes of saved tensors this process copied (benchmarks read it)."""
    bytes = 0


def save_time_record(engine) -> Dict[str, Any]:
    """What LAYOUT_FILE records at save for a later conversion: the optimizer's parameter names in order (ZeRO 0,
    whose files key state by position) and each expert parameter's local shape."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    record: Dict[str, Any] = {"experts": {n: list(getattr(p, "ds_shape", p.shape))   # ZeRO 3: p.shape is (0,)
                                          for n, p in engine.module.named_parameters()
                                          if getattr(p, "allreduce", True) is False},
                              "dtype": _precision(engine)}
    if engine.zero_optimization_stage() == 0 and isinstance(engine.optimizer, torch.optim.Optimizer):
        record["optimizer_names"] = [[names.get(id(p)) for p in group["params"]]
                                     for group in engine.optimizer.param_groups]
    return record


def _precision(engine) -> str:
    return "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"


def reshard_refusal(saved: Dict[str, Any], current: Dict[str, Any]) -> Optional[str]:
    """Why the optimizer state saved in one layout cannot be converted to the other; None when it can."""
    if current.get("zero_stage") not in (0, 1, 2, 3):
        return f"this run's ZeRO stage is {current.get('zero_stage')} (converted: into 0, 1, 2, 3)"
    if saved.get("zero_stage") not in (0, 1, 2, 3):
        return f"the saved ZeRO stage is {saved.get('zero_stage')} (converted: 0, 1, 2, 3)"
    for layout, whose in ((saved, "the saved"), (current, "this run's")):
        if layout["zero_stage"] == 3 and layout.get("dtype") != "fp32":
            return (f"{whose} ZeRO stage is 3 in {layout.get('dtype') or 'an unrecorded precision'} (converted: "
                    f"fp32)")
    for layout, whose in ((saved, "the saved"), (current, "this run's")):
        if layout.get("pipeline_stages") != 1 and not saved.get("stages"):   # stages: reshard_pipeline.this_stage
            return saved.get("pipeline_refusal") or (f"{whose} layout has {layout.get('pipeline_stages')} pipeline "
                                                     f"stages (converted: 1)")
        dtype = layout.get("dtype")
        if dtype not in ("fp32", "bf16", "fp16"):
            return (f"{whose} precision is {dtype or 'not recorded'} (converted: fp32, and bf16 and fp16 at ZeRO 1 "
                    f"and 2)")
        if dtype != "fp32" and layout.get("zero_stage") == 0:
            return (f"{whose} precision is {dtype} at ZeRO stage 0, where DeepSpeed's FP16_Optimizer keeps its own "
                    f"unrecorded flat masters (converted: fp32, and bf16 and fp16 at ZeRO 1 and 2)")
        if len(set(layout["ep_size"].values())) > 1:
            return f"{whose} MoE layers have different ep_sizes {layout['ep_size']} (converted: one ep_size)"
        if layout.get("zero_stage") == 0 and "optimizer_names" not in layout:
            return f"{whose} ZeRO-0 optimizer is not a torch optimizer"
    if saved["dtype"] != current["dtype"]:
        return f"the saved precision is {saved['dtype']}, this run's {current['dtype']} (converted: the same precision)"
    if set(saved["experts"]) != set(current["experts"]):
        return (f"the expert parameters' names differ ({sorted(set(saved['experts']) ^ set(current['experts']))[:3]}"
                f"...): experts kept as one module each change names with ep_size")
    ep_saved, ep_now = _ep(saved), _ep(current)
    for name, shape in current["experts"].items():
        held = saved["experts"][name]
        if ep_saved != ep_now and (held[0] * ep_saved != shape[0] * ep_now or held[1:] != shape[1:]):
            return (f"expert parameter {name!r} holds {held} per rank at ep_size {ep_saved} and {shape} at "
                    f"{ep_now}: not whole experts stacked first")
    return None


def _ep(layout: Dict[str, Any]) -> int:
    return next(iter(layout["ep_size"].values()), 1)


class SavedState:
    """The saved run's optimizer state, one parameter at a time, from a tag folder written in layout `saved`."""

    def __init__(self, folder: str, saved: Dict[str, Any]):
        self.folder, self.saved = folder, saved
        self.world, self.ep, self.stage = saved["world_size"], _ep(saved), saved["zero_stage"]
        self._files: Dict[str, Any] = {}
        self._prefix = "bf16_" if saved["dtype"] == "bf16" else ""   # bf16_zero_pp_rank_<r>_...: DeepSpeed's name
        self.model = self._load("zero_pp_rank_0_mp_rank_00_model_states.pt" if self.stage == 3
                                else "mp_rank_00_model_states.pt")
        if self.stage == 0:
            self._position = {name: (g, i) for g, names in enumerate(saved["optimizer_names"])
                              for i, name in enumerate(names)}
            return
        self._group = {name: g for g, shapes in enumerate(self.model["param_shapes"]) for name in shapes}
        self._shape = {name: tuple(shape) for shapes in self.model["param_shapes"] for name, shape in shapes.items()}
        if self.stage == 3:
            self._offset = self._zero3_offsets()

    def _zero3_offsets(self) -> Dict[str, int]:
        """Where each parameter's piece starts in its ZeRO-3 group's flat partition: every rank of the group holds
        ceil(numel / ranks) elements of each parameter, in the group's order."""
        optim = self._load("zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        if len(optim["fp32_flat_groups"]) != len(self.model["param_shapes"]):
            raise ValueError(f"{self.folder}: {len(optim['fp32_flat_groups'])} ZeRO-3 sub-groups for "
                             f"{len(self.model['param_shapes'])} groups of parameters: sub_group_size split a group "
                             f"(converted: one sub-group per optimizer group)")
        offsets = {}
        for g, shapes in enumerate(self.model["param_shapes"]):
            count, offset = optim["ds_zero_partition_groups"][g]["partition_count"], 0
            for name, shape in shapes.items():
                offsets[name] = offset
                offset += -(-_numel(shape) // count)
        return offsets

    def param_groups(self) -> List[Dict[str, Any]]:
        """The saved optimizer's groups (their settings: lr as the scheduler last set it, betas, eps, ...)."""
        if self.stage == 0:
            return self._load("expp_rank_0_mp_rank_00_optim_states.pt")["optimizer"]["param_groups"]
        if self.stage == 3:
            optim = self._load("zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
            return optim["optimizer_state_dict"]["param_groups"]
        optim = self._load(f"{self._prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        return optim["base_optimizer_state"]["param_groups"]

    def loss_scale_state(self) -> Dict[str, Any]:
        """ZeRO 1/2's loss scaler and what DeepSpeed's own load restores with it (the same on every rank)."""
        optim = self._load(f"{self._prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        return {key: optim[key] for key in ("loss_scaler", "dynamic_loss_scale", "overflow")}

    def expert_file(self, layer: int, expert: int) -> Dict[str, torch.Tensor]:
        """Global expert `expert` of MoE layer `layer` (ZeRO 0-2: DeepSpeed's one file per expert, native names)."""
        return self._load(f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt")

    def close(self) -> None:
        """Let go of the mapped files (their pages count in the process's resident memory while mapped)."""
        self._files.clear()

    def _load(self, name: str):
        if name not in self._files:
            self._files[name] = torch.load(os.path.join(self.folder, name), map_location="cpu", mmap=True,
                                           weights_only=False)
        return self._files[name]

    def held(self, name: str, ep_rank: int, keys=None) -> Dict[str, torch.Tensor]:
        """Parameter name as the saved run's expert-parallel rank ep_rank held it (a dense one: whole): its state
        tensors by key (MASTER too at ZeRO 1-3; at ZeRO 3 only those in keys, unless None)."""
        expert = name in self.saved["experts"]
        if self.stage == 0:
            state = self._load(f"expp_rank_{ep_rank if expert else 0}_mp_rank_00_optim_states.pt")["optimizer"]
            g, i = self._position[name]
            index = state["param_groups"][g]["params"][i]
            return {key: _read(value) for key, value in state["state"][index].items()}
        g = self._group[name]
        ranks = [r for r in range(self.world) if r % self.ep == ep_rank] if expert and self.ep > 1 \
            else list(range(self.world))
        if self.stage == 3:
            return self._zero3_held(name, g, ranks, keys)
        pieces: Dict[str, List[torch.Tensor]] = {}
        step = None
        for r in ranks:
            optim = self._load(f"{self._prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
            if len(optim["partition_count"]) <= g or optim["partition_count"][g] != len(ranks):
                raise ValueError(f"{self.folder}: optimizer group {g} of rank {r} is split over "
                                 f"{optim['partition_count'][g]} ranks, not {len(ranks)}: the files are not those of "
                                 f"the layout recorded beside them")
            base = optim["base_optimizer_state"]["state"].get(g, {})
            step = base.get("step", step)
            where = optim["param_slice_mappings"][g].get(name)
            if where is None:
                continue
            flats = {MASTER: optim["single_partition_of_fp32_groups"][g],
                     **{k: v for k, v in base.items() if torch.is_tensor(v) and v.dim() == 1}}
            for key, flat in flats.items():
                pieces.setdefault(key, []).append(_read(flat.narrow(0, where.start, where.numel)))
        out = {key: torch.cat(parts).view(self._shape[name]) for key, parts in pieces.items()}
        if step is not None:
            out["step"] = _read(step)
        return out

    def _zero3_held(self, name: str, g: int, ranks: List[int], keys) -> Dict[str, torch.Tensor]:
        numel = _numel(self._shape[name])
        part = -(-numel // len(ranks))
        pieces: Dict[str, List[torch.Tensor]] = {}
        step = None
        for r in ranks:
            optim = self._load(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
            if optim["ds_zero_partition_groups"][g]["partition_ranks"] != ranks:
                raise ValueError(f"{self.folder}: ZeRO-3 group {g} of rank {r} is split over "
                                 f"{optim['ds_zero_partition_groups'][g]['partition_ranks']}, not {ranks}: the files "
                                 f"are not those of the layout recorded beside them")
            base = optim["optimizer_state_dict"]["state"].get(g, {})
            step = base.get("step", step)
            flats = {MASTER: optim["fp32_flat_groups"][g],
                     **{k: v for k, v in base.items() if torch.is_tensor(v) and v.dim() == 1}}
            for key, flat in flats.items():
                if keys is None or key in keys:
                    pieces.setdefault(key, []).append(_read(flat.narrow(0, self._offset[name], part)))
        out = {key: torch.cat(parts)[:numel].view(self._shape[name]) for key, parts in pieces.items()}
        if step is not None:
            out["step"] = _read(step)
        return out

    def local(self, name: str, ep_rank: int, ep_size: int, keys=None) -> Dict[str, torch.Tensor]:
        """Parameter name as this run's expert-parallel rank ep_rank of ep_size holds it."""
        if name not in self.saved["experts"] or ep_size == self.ep:
            return self.held(name, ep_rank, keys)
        per_saved = self.saved["experts"][name][0]
        per_now = per_saved * self.ep // ep_size
        first, last = ep_rank * per_now, (ep_rank + 1) * per_now
        parts: Dict[str, List[torch.Tensor]] = {}
        for saved_rank in range(first // per_saved, (last - 1) // per_saved + 1):
            held = self.held(name, saved_rank, keys)
            start = max(first - saved_rank * per_saved, 0)
            stop = min(last - saved_rank * per_saved, per_saved)
            for key, value in held.items():
                parts.setdefault(key, []).append(value if value.dim() == 0 else value[start:stop])
        return {key: values[0] if values[0].dim() == 0 else torch.cat(values) for key, values in parts.items()}


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= int(size)
    return n


def _read(tensor: torch.Tensor) -> torch.Tensor:
    ReadCounter.bytes += tensor.numel() * tensor.element_size()
    return tensor.clone()


def load_optimizer_state(engine, folder: str, saved: Dict[str, Any], current: Dict[str, Any]) -> None:
    """Set every optimizer state tensor and master weight of this rank's parameters from the checkpoint in folder
    (written in layout saved, which reshard_refusal accepted for this run's layout current), after DeepSpeed loaded
    the weights."""
    source = SavedState(folder, saved)
    write_optimizer_state(engine.optimizer, local_state(engine, source, current), source, saved["dtype"])
    source.close()
    if dist.is_initialized():
        dist.barrier()


def write_optimizer_state(optimizer, local, source: SavedState, dtype: str) -> None:
    """Each parameter's state, local(param) (its master under MASTER), and the saved groups' settings into a ZeRO
    0-2 optimizer (fp16's loss scaler too)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
        _into_zero12(optimizer, local)
        _set_group_settings(optimizer.optimizer, source.param_groups())
        if dtype == "fp16":
            for key, value in source.loss_scale_state().items():
                setattr(optimizer, key, value)
    elif isinstance(optimizer, torch.optim.Optimizer):
        _set_group_settings(optimizer, source.param_groups())
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = local(param)
                state.pop(MASTER, None)
                optimizer.state[param] = {key: value.to(param.device) for key, value in state.items()}
    else:
        raise ValueError(f"cannot convert the optimizer state into a {type(optimizer).__name__}")


def local_state(engine, source, current: Dict[str, Any]):
    """param -> its state tensors (and MASTER, but at ZeRO 0) as the saved run held them, cut for this rank's
    experts (whole: not yet cut into this rank's ZeRO partition). source: a SavedState, or any reader with its
    local(name, ep_rank, ep_size)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    ep_size, ep_rank = _ep(current), _ep_rank(current)

    def local(param: nn.Parameter) -> Dict[str, torch.Tensor]:
        state = source.local(names[id(param)], ep_rank if getattr(param, "allreduce", True) is False else 0,
                             ep_size)
        shape = tuple(getattr(param, "ds_shape", param.shape))   # ZeRO 3: param.shape is (0,)
        if tuple(state["exp_avg"].shape) != shape:
            raise ValueError(f"parameter {names[id(param)]!r}: the checkpoint gives {tuple(state['exp_avg'].shape)}"
                             f", this run holds {shape}")
        return state
    return local


def _ep_rank(current: Dict[str, Any]) -> int:
    from deepspeed.utils import groups
    ep_size = _ep(current)
    return groups._get_expert_parallel_rank(f"ep_size_{ep_size}") if ep_size > 1 else 0


# what DeepSpeed's load_checkpoint keeps out of the client state it returns
_DEEPSPEED_KEYS = ("module", "buffer_names", "optimizer", "lr_scheduler", "sparse_tensor_module_names",
                   "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                   "data_sampler", "random_ltd", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
                   "shared_params", "ds_config", "ds_version", "checkpoint_parallel_dimensions")


def load_zero3_module_state(engine, folder: str, saved: Dict[str, Any], current: Dict[str, Any],
                            load_lr_scheduler_states: bool = True) -> Dict[str, Any]:
    """What DeepSpeed's load gives a ZeRO 0-2 engine, from a ZeRO-3 checkpoint (whose weights are only in its
    ranks' partitions; DeepSpeed's load looks for a whole model file): each parameter of this rank set to its fp32
    master, the buffers, the LR scheduler, global_steps, global_samples, skipped_steps. Returns the client state."""
    source = SavedState(folder, saved)
    ep_size, ep_rank = _ep(current), _ep_rank(current)
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            rank = ep_rank if getattr(param, "allreduce", True) is False else 0
            master = source.local(name, rank, ep_size, keys=(MASTER,))[MASTER]
            if tuple(master.shape) != tuple(param.shape):
                raise ValueError(f"parameter {name!r}: the checkpoint gives {tuple(master.shape)}, this run holds "
                                 f"{tuple(param.shape)}")
            param.copy_(master)
    client_state = _load_module_state(engine, source.model, load_lr_scheduler_states)
    source.close()
    return client_state


def _load_module_state(engine, model: Dict[str, Any], load_lr_scheduler_states: bool) -> Dict[str, Any]:
    """What DeepSpeed's load restores beside the parameters and the optimizer, from the saved model file model:
    the buffers, the LR scheduler, global_steps, global_samples, skipped_steps. Returns the client state."""
    buffers = dict(engine.module.named_buffers())
    with torch.no_grad():
        for name in model.get("buffer_names", []):
            buffers[name].copy_(_saved_buffer(model["module"], name, buffers[name]))
    return load_engine_state(engine, model, load_lr_scheduler_states)


def load_engine_state(engine, model: Dict[str, Any], load_lr_scheduler_states: bool) -> Dict[str, Any]:
    """The LR scheduler, global_steps, global_samples and skipped_steps from the saved model file model. Returns
    the client state."""
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(model["lr_scheduler"])
    engine.global_steps, engine.skipped_steps = model["global_steps"], model["skipped_steps"]
    engine.global_samples = model.get("global_samples", engine.global_steps * engine.train_batch_size())
    return {key: value for key, value in model.items() if key not in _DEEPSPEED_KEYS}


def _saved_buffer(module: Dict[str, Any], name: str, buffer: torch.Tensor) -> torch.Tensor:
    """Buffer name in a saved module state: at ZeRO 0-2 a layer's balancing bias is written as router.Expert_bias_E
    when it is on and not at all when it is off (it loads as zeros; native.py's _to_native_names)."""
    folder, _, leaf = name.rpartition(".")
    hidden = f"{folder}.{leaf.replace('expert', 'Expert')}" if folder else leaf.replace("expert", "Expert")
    if name in module or hidden in module:
        return module[name] if name in module else module[hidden]
    if leaf == "expert_bias_E":
        return torch.zeros_like(buffer)
    raise ValueError(f"buffer {name!r} is not in the checkpoint's model file")


def load_into_zero3(engine, folder: str, saved: Dict[str, Any], current: Dict[str, Any],
                    load_lr_scheduler_states: bool = True) -> Dict[str, Any]:
    """engine.load_checkpoint for a ZeRO-3 engine, from a checkpoint written in layout saved (ZeRO 0-3, fp32), which
    reshard_refusal accepted for this run's layout current: DeepSpeed's own load reads only its own layout's
    partitions. Each parameter's fp32 master, exp_avg and exp_avg_sq are cut into this rank's partition of them
    (ceil(numel / ranks) elements over the parameter's partition group, zero-padded at the end) and written into the
    optimizer's flat sub-group partitions, the weights' partitions set to the masters; then the groups' settings,
    buffers, LR scheduler and counters. Returns the client state."""
    optimizer = engine.optimizer
    if optimizer.offload_optimizer or optimizer.offload_param:
        raise ValueError("loading a checkpoint of another layout into ZeRO 3 with offload_optimizer or offload_param "
                         "is not converted (converted: ZeRO 3 without offload)")
    source = SavedState(folder, saved)
    local = local_state(engine, source, current)
    if source.stage == 0:
        local = _with_zero0_masters(engine, local, _zero0_weights(engine, source, current))
    optimizer.checkpoint_event_prologue()   # every parameter partitioned: only ds_tensor holds its values
    for sub_group in range(len(optimizer.fp16_groups)):
        _into_zero3_sub_group(optimizer, sub_group, local)
    _set_group_settings(optimizer.optimizer, source.param_groups())
    client_state = _load_module_state(engine, source.model, load_lr_scheduler_states)
    source.close()
    if optimizer.persistent_parameters:   # as DeepSpeed's own load: dropped, then gathered from the new partitions
        optimizer.persistent_parameters[0].partition(optimizer.persistent_parameters)
    optimizer.checkpoint_event_epilogue()
    if dist.is_initialized():
        dist.barrier()
    return client_state


def _with_zero0_masters(engine, local, weights: Dict[str, torch.Tensor]):
    """local with each parameter's master added: a ZeRO-0 run's fp32 weights are its masters."""
    names = {id(p): n for n, p in engine.module.named_parameters()}

    def with_master(param: nn.Parameter) -> Dict[str, torch.Tensor]:
        state = local(param)
        master = weights[names[id(param)]]
        if master.shape != state["exp_avg"].shape:
            raise ValueError(f"parameter {names[id(param)]!r}: the checkpoint's model files give "
                             f"{tuple(master.shape)}, its optimizer state {tuple(state['exp_avg'].shape)}")
        return {**state, MASTER: _read(master)}
    return with_master


def _zero0_weights(engine, source: SavedState, current: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """This rank's parameters by name (unread: mapped), whole (expert tensors: this rank's experts), from a ZeRO-0
    checkpoint's model files: the module file (dense weights, the router as gate.wg.weight) and one file per global
    expert, put back into the parameters' names as the layers' own load_state_dict hook does (native.py)."""
    layers = [module for module in engine.module.modules() if isinstance(module, Zero3MoE)]
    if len(layers) != len(current["ep_size"]):
        raise ValueError("a ZeRO-0 checkpoint loads into ZeRO 3 in another layout for DeepSpeed MoE layers "
                         "(moe_plugin.integrations.deepspeed.MoE, or a \"moe\" section over them) only, not for "
                         "Hugging Face MoE blocks")
    state = dict(source.model["module"])
    ep_rank = _ep_rank(current)
    experts = ".deepspeed_moe.experts.deepspeed_experts."   # DeepSpeed's key of one expert's tensors
    for layer_id, layer in enumerate(layers):   # DeepSpeed numbers the MoE layers in module order
        for i in range(layer.num_local_experts):
            expert = ep_rank * layer.num_local_experts + i
            for key, tensor in source.expert_file(layer_id, expert).items():
                state[key.replace(f"{experts}{expert}.", f"{experts}{i}.")] = tensor
    for prefix, module in engine.module.named_modules():
        if isinstance(module, DeepSpeedMoELayer):
            _from_native_names(module, state, f"{prefix}.")
    return state


def _into_zero3_sub_group(optimizer, sub_group: int, local) -> None:
    """One ZeRO-3 sub-group's flat partitions (masters, each state tensor): its parameters' pieces one after the
    other, each param.partition_numel() long (DeepSpeed's set_grad_positions)."""
    master_flat = optimizer.fp32_partitioned_groups_flat[sub_group]
    state_flat: Dict[str, torch.Tensor] = {}
    steps, offset = set(), 0
    for param in optimizer.fp16_groups[sub_group]:
        state = local(param)
        steps.add(float(state.pop("step")))
        numel = param.partition_numel()
        rank = optimizer._get_param_partition_rank(param)
        for key, whole in state.items():
            flat = master_flat if key == MASTER else state_flat.setdefault(key, torch.zeros_like(master_flat))
            flat.data.narrow(0, offset, numel).copy_(_partition_of(whole, rank, numel))
        offset += numel
    if len(steps) > 1:
        raise ValueError(f"ZeRO-3 sub-group {sub_group}: the checkpoint's parameters were saved at different steps "
                         f"{steps}")
    if steps:
        optimizer.optimizer.state[master_flat] = {"step": torch.tensor(steps.pop()), **state_flat}
    bit16_flat = optimizer.fp16_partitioned_groups_flat[sub_group]
    bit16_flat.data.copy_(master_flat.data)
    partitions = optimizer.fp16_partitioned_groups[sub_group]
    for partition, values in zip(partitions, optimizer.unflatten(bit16_flat, partitions)):
        partition.data = values.data


def _partition_of(whole: torch.Tensor, rank: int, numel: int) -> torch.Tensor:
    """Rank rank's numel elements of whole, flattened and zero-padded to a multiple of numel (ZeRO 3's split)."""
    piece = whole.reshape(-1)[rank * numel:(rank + 1) * numel]
    return torch.cat([piece, piece.new_zeros(numel - piece.numel())])


def _set_group_settings(optimizer: torch.optim.Optimizer, saved: List[Dict[str, Any]]) -> None:
    """Each group's settings as saved (DeepSpeed's own load restores them with the state: the LR scheduler sets lr
    only at its next step)."""
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this run's "
                         f"{len(optimizer.param_groups)}: not the same model and optimizer")
    for group, saved_group in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in saved_group.items() if key not in ("params", "name", "moe")})


def _into_zero12(optimizer, local) -> None:
    """Each group's flat partition of masters and state tensors, filled from the parameters' pieces on this rank
    (ZeRO 1/2's optimizer, or BF16_Optimizer: bf16 at ZeRO 1 with fp32 gradient accumulation; the same files)."""
    bit16_groups = getattr(optimizer, "bit16_groups", None) or optimizer.bf16_groups
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_groups_flat_partition
    for g, params in enumerate(bit16_groups):
        master_flat = masters[g]
        state_flat: Dict[str, torch.Tensor] = {}
        steps = set()
        for param in params:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                continue
            state = local(param)
            steps.add(float(state.pop("step")))
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            for key, value in state.items():
                flat = master_flat if key == MASTER else state_flat.setdefault(key, torch.zeros_like(master_flat))
                flat.data.narrow(0, hp.start, hp.numel).copy_(value.reshape(-1).narrow(0, lp.start, lp.numel))
        if len(steps) > 1:
            raise ValueError(f"optimizer group {g}: the checkpoint's parameters were saved at different steps {steps}")
        if state_flat:
            optimizer.optimizer.state[master_flat] = {"step": torch.tensor(steps.pop()), **state_flat}
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()   # safe_get_full_optimizer_state reads it before a step
