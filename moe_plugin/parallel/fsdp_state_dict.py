"""torch's state-dict API (torch.distributed.checkpoint.state_dict: get/set_model_state_dict, get/set_optimizer_
state_dict, get/set_state_dict; what Accelerate's FSDP2 save and load, HF Trainer's checkpoints and DCP loops
call) for expert-parallel layers sharded by fully_shard_moe.

Legend: E experts, E_local per rank, P ranks holding the same experts (the layer's expert-data group).

That API keys every tensor by name alone. Under fully_shard_moe each rank's experts are FSDP2 DTensors over
its P expert-data ranks only, [E_local, ...], and the ranks of an ep group hold other experts under the same
names: a DCP checkpoint written from them keeps one rank's experts for all (measured: rank 0 came back with
rank 1's, off by 0.68). Within that API only, each expert tensor, the parameter and every optimizer state of
its shape, is shown as what it is: this rank's piece of the whole [E, ...] stack, a DTensor over the 2-D
(ep, expert-data) mesh, Shard(0) over ep. DCP then writes each expert once and reshards on load (another world
or ep size); full state dicts gather every expert; what is loaded goes back into the FSDP2 shards.

Optimizer states are reached through hooks on the optimizer, put there by a global step pre-hook at its first
step (torch's API steps a fresh optimizer once before reading it). Hidden-sliced experts (ep_size > E) and
expert modules (the general path) have no such 2-D form: a full state dict of sliced stacks is gathered here,
anything else is refused with a clear error.
"""
from __future__ import annotations

import sys
from itertools import chain
from typing import Dict

import torch
import torch.distributed as dist

from ..experts import RECORD
from .expert_parallel import whole_experts
from .groups import ep_blocks

FORM = "_moe_plugin_global_form"
_MESHES: Dict[tuple, object] = {}
_STEP_HOOK = None


class _GlobalForm:
    """How one FSDP2-sharded expert parameter [E_local, ...] sits in the whole stack [E, ...] (held by the
    parameter as FORM)."""

    def __init__(self, param, mesh, num_experts: int):
        from torch.distributed.tensor import Shard
        self.mesh, self.placements = mesh, (Shard(0), param.placements[0])
        self.shape = torch.Size((num_experts, *param.shape[1:]))
        self.stride = _contiguous(self.shape)
        self.shard_mesh, self.shard_placements = param.device_mesh, param.placements
        self.shard_shape, self.shard_stride = param.shape, param.stride()

    def whole(self, tensor, full: bool = False):
        """A DTensor like the parameter (its shard, or an optimizer state of its shape) as a piece of [E, ...];
        with full, the whole [E, ...] itself (a collective over the layer's ranks)."""
        from torch.distributed.tensor import DTensor, Replicate
        piece = DTensor.from_local(tensor.to_local(), self.mesh, self.placements, run_check=False, shape=self.shape,
                                   stride=self.stride)
        if not full:
            return piece
        # one mesh dim at a time: torch 2.11 fails to gather both at once over this (transposed) rank layout
        piece = piece.redistribute(self.mesh, (self.placements[0], Replicate()))
        return piece.redistribute(self.mesh, (Replicate(), Replicate())).to_local()

    def shard(self, value):
        """A value loaded for the parameter back as a DTensor like it: a piece of [E, ...] on the 2-D mesh (what
        whole() gave and DCP filled), the whole [E, ...] spread over the expert-data ranks (torch's full-state
        loads), or the parameter's own form."""
        from torch.distributed.tensor import DTensor
        if isinstance(value, DTensor) and value.device_mesh is self.mesh:
            local = value.to_local()
        elif value.shape == self.shard_shape:
            return value
        elif value.shape == self.shape:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            local = self._my_piece(full)
        else:
            raise ValueError(f"a state-dict entry of shape {tuple(value.shape)} cannot load into an expert tensor "
                             f"of shape {tuple(self.shard_shape)} on this rank (the whole stack is "
                             f"{tuple(self.shape)})")
        return DTensor.from_local(local, self.shard_mesh, self.shard_placements, run_check=False,
                                  shape=self.shard_shape, stride=self.shard_stride)

    def _my_piece(self, full):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        return full[tuple(slice(o, o + s) for s, o in zip(shape, offset))].contiguous()


def _contiguous(shape) -> tuple:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def register(layer, device_type: str) -> None:
    """After fully_shard_moe has sharded layer (ep_size > 1): hooks that answer torch's state-dict API."""
    layer.register_state_dict_post_hook(_model_state_dict_hook)
    layer.register_load_state_dict_pre_hook(_model_load_hook)
    layout = layer.groups.layout
    if not layer.experts.stacked or layout.slices > 1:
        return
    mesh = _two_d_mesh(layer, device_type)
    for param in layer.experts.parameters():
        setattr(param, FORM, _GlobalForm(param, mesh, layout.num_experts))
    _install_step_hook()


def _two_d_mesh(layer, device_type: str):
    """The (ep, expert-data) DeviceMesh of the layer's ranks: column j holds ep group j (groups.ep_blocks), so
    rank = j * ep_size + i at (i, j); built from the layer's own groups."""
    from torch.distributed.device_mesh import DeviceMesh
    groups = layer.groups
    key = (groups.ep_group, groups.expert_data_group)   # the groups themselves: an id could be reused
    if key not in _MESHES:
        ep_size = dist.get_world_size(groups.ep_group)
        ranks = torch.tensor(ep_blocks(dist.get_world_size(), ep_size)).t()
        _MESHES[key] = DeviceMesh.from_group([groups.ep_group, groups.expert_data_group], device_type, mesh=ranks,
                                             mesh_dim_names=("ep", "expert_data"))
    return _MESHES[key]


def _model_state_dict_hook(layer, state, prefix, local_metadata) -> None:
    frames = _torch_state_dict_api_frames()
    if not frames:
        return
    full = _full_state_dict(frames, "_get_model_state_dict")
    if full and _frames("accelerate.utils.fsdp_utils", "save_fsdp_model"):
        raise ValueError(
            f"Accelerate's FULL_STATE_DICT checkpoint of {prefix.rstrip('.') or 'an MoELayer'} (ep_size="
            f"{layer.config.ep_size}, sharded by fully_shard_moe; HF Trainer's resume checkpoints with fsdp_config "
            f"state_dict_type FULL_STATE_DICT) would save, but Accelerate resumes it with torch's broadcast_from_rank0 "
            f"load, which cannot put back experts that differ from rank to rank. Use state_dict_type "
            f"SHARDED_STATE_DICT (Accelerate's FSDP2 default): it saves and resumes exactly at any ep_size. "
            f"trainer.save_model and export_hf write full HF folders either way")
    forms = {name: getattr(param, FORM, None) for name, param in layer.experts.named_parameters()}
    if forms and None not in forms.values():
        for name, form in forms.items():
            state[prefix + "experts." + name] = form.whole(state[prefix + "experts." + name], full)
        local_metadata.pop(RECORD, None)    # the experts are no longer this rank's stacks: each has its place
        return
    loading = any(f.f_code.co_name.startswith(("set_", "_load")) for f in frames)
    if not loading and full and layer.experts.stacked:
        state.update({prefix + "experts." + name: tensor for name, tensor in whole_experts(layer).items()})
        local_metadata.pop(RECORD, None)
        return
    _refuse(layer, prefix)


def _model_load_hook(layer, state, prefix, *args) -> None:
    if not _torch_state_dict_api_frames():
        return
    forms = {name: getattr(param, FORM, None) for name, param in layer.experts.named_parameters()}
    if not forms or None in forms.values():
        _refuse(layer, prefix)
    for name, form in forms.items():
        key = prefix + "experts." + name
        if key in state:
            state[key] = form.shard(state[key])


def _install_step_hook() -> None:
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _STEP_HOOK = register_optimizer_step_pre_hook(_hook_optimizer)


def _hook_optimizer(optimizer, args, kwargs) -> None:
    """Global step pre-hook: once per optimizer, the state-dict hooks if it holds sharded expert tensors."""
    if getattr(optimizer, "_moe_plugin_state_dict_hooks", False):
        return
    optimizer._moe_plugin_state_dict_hooks = True
    if any(hasattr(p, FORM) for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(_optimizer_state_dict_hook)
        optimizer.register_load_state_dict_pre_hook(_optimizer_load_hook)


def _forms_by_key(optimizer, state_dict) -> dict:
    """{state key: _GlobalForm} for the state dict's expert parameters (keys in group order, as
    Optimizer.load_state_dict pairs them: indices, or names from torch's API)."""
    keys = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
    params = chain.from_iterable(group["params"] for group in optimizer.param_groups)
    return {key: getattr(p, FORM) for key, p in zip(keys, params) if hasattr(p, FORM)}


def _optimizer_state_dict_hook(optimizer, state_dict):
    frames = _torch_state_dict_api_frames()
    if not frames:
        return None
    from torch.distributed.tensor import DTensor
    full = _full_state_dict(frames, "_get_optim_state_dict")
    states = state_dict["state"]
    for key, form in _forms_by_key(optimizer, state_dict).items():
        if key in states:   # a new dict: the packed state holds the optimizer's own per-parameter dicts
            states[key] = {name: form.whole(v, full) if isinstance(v, DTensor) and v.shape == form.shard_shape
                           else v for name, v in states[key].items()}
    return state_dict


def _optimizer_load_hook(optimizer, state_dict):
    if not _torch_state_dict_api_frames():
        return None
    state_dict = dict(state_dict, state=dict(state_dict["state"]))
    states = state_dict["state"]
    for key, form in _forms_by_key(optimizer, state_dict).items():
        if key in states:
            states[key] = {name: form.shard(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                           for name, v in states[key].items()}
    return state_dict


def _torch_state_dict_api_frames() -> list:
    return _frames("torch.distributed.checkpoint.state_dict")


def _frames(module: str, function: str = None) -> list:
    """The frames on the stack running code of module (and that function)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == module and function in (None, frame.f_code.co_name):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _full_state_dict(frames: list, function: str) -> bool:
    """Whether torch's API is making a full state dict (its options, as the frame of function holds them)."""
    info = next((f.f_locals.get("info") for f in frames if f.f_code.co_name == function), None)
    return bool(getattr(info, "full_state_dict", False))


def _refuse(layer, prefix: str) -> None:
    what = "expert modules (the general path)" if not layer.experts.stacked else \
        "hidden-sliced experts (ep_size > num_experts)"
    raise ValueError(
        f"torch.distributed.checkpoint.state_dict (get_model_state_dict / get_state_dict / set_model_state_dict, "
        f"which Accelerate's FSDP2 save and load and HF Trainer's checkpoints call) cannot hold the {what} of "
        f"{prefix.rstrip('.') or 'an MoELayer'} (ep_size={layer.config.ep_size}, sharded by fully_shard_moe) in "
        f"a sharded state dict or load them: they have no whole-stack form there, and each rank holds other "
        f"experts under the same names. A full state dict (full_state_dict=True, what Trainer's save_model "
        f"gathers) of stacked experts works. Save and resume with moe_plugin.checkpoint: "
        f"save(sharded_state(model, optimizer), path) and load(sharded_state(model, optimizer, writing=False), "
        f"path); write an HF folder with moe_plugin.integrations.transformers.export_hf(model, dir) on every rank")
