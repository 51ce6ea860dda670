"""DeepSpeed and Hugging Face MoE models: the "moe" section on an HF model, and swapped blocks the engine treats
as MoE.

DeepSpeed's engine handles expert parameters only inside instances of deepspeed.moe.layer.MoE (has_moe_layers,
the expert-data-parallel gradient reduction, ZeRO's MoE groups, the per-expert checkpoint files). DeepSpeed's paths
therefore run swapped blocks as `DeepSpeedHFMoEBlock`s, HFMoEBlocks that are also such instances: swap_for_section
builds them, and `use_deepspeed_blocks` turns the plain HFMoEBlocks of a model swapped beforehand into them
(moe_plugin's initialize does, so also the hooked deepspeed.initialize of transformers.Trainer and accelerate).
The transformers adapter itself builds plain HFMoEBlocks and never imports DeepSpeed.

`initialize` (moe_plugin.integrations.deepspeed) calls `swap_for_section` on a model with no DeepSpeed MoE layer:
a supported HF family is swapped with the section's settings, anything else is an error naming what was looked for.
"""
from __future__ import annotations

import dataclasses
import datetime
import sys
from typing import Any, Dict, List, Mapping, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin import MoEConfig
from moe_plugin.experts import WEIGHT_NAMES
from moe_plugin.integrations.deepspeed.section import check_ep_size_under_deepspeed
from moe_plugin.integrations.deepspeed.native import (MoE, NativeMoE, _expert_parallel_group, hide_from_expert_files,
                                                      unhide_from_expert_files)
from moe_plugin.integrations.transformers import FAMILIES, family_of, moe_config, swap_moe_blocks
from moe_plugin.integrations.transformers.block import HFMoEBlock

__all__ = ["DeepSpeedHFMoEBlock", "use_deepspeed_blocks", "check_section_for_model", "swap_for_section",
           "check_swapped_block", "section_overrides"]

# section keys the HF config fixes (the model's math): a section value must agree with it
FIXED_BY_MODEL = ("num_experts", "top_k", "router", "num_groups", "topk_groups", "route_scale")
CAPACITY_KEYS = ("capacity_factor", "eval_capacity_factor", "drop_tokens")
# the stacked expert tensors of the layer -> their name in one expert's entry of DeepSpeed's per-expert files
# (one expert's slice drops the E: "w1_EDH" -> "w1_DH")
PER_EXPERT = {name: name.replace("_E", "_", 1) for name in WEIGHT_NAMES}
EXPERTS_PREFIX = "deepspeed_moe.experts.deepspeed_experts."   # DeepSpeed files every key holding this per expert


class _NativeMoEBase(NativeMoE):
    """deepspeed.moe.layer.MoE without its constructor (which builds a native layer): HFMoEBlock's
    super().__init__() lands here and only initializes the nn.Module."""

    def __init__(self, *args, **kwargs):
        nn.Module.__init__(self)


class DeepSpeedHFMoEBlock(HFMoEBlock, _NativeMoEBase):
    """An HFMoEBlock that DeepSpeed's engine treats as a native MoE layer.

    Its expert parameters carry allreduce=False and group_name "ep_size_<ep>" (reduced over DeepSpeed's
    expert-data-parallel group, left out of the data-parallel allreduce). Its state dict names each local
    expert's tensors `deepspeed_moe.experts.deepspeed_experts.<i>.<w1_DH|w2_HD|...>` so that
    engine.save_checkpoint writes DeepSpeed's per-expert files; the engine takes every other key holding
    "expert" for an expert tensor, so those (the expert bias) are written with "Expert" instead. PEFT's LoRA on
    the HF-named experts keeps PEFT's keys (experts.lora_A...) in a model's state dict, where PEFT's adapter save
    finds them and the engine leaves them out of its model file (at ep_size > 1 every expert's factors, gathered
    over the expert-parallel group: every rank must take that state dict); the block's own state dict (what the engine
    files per expert) holds each local expert's slice of them as `<that prefix><i>.peft.<PEFT's key>`. Loading
    undoes all of it. block.moe.state_dict() keeps the layer's own names.
    """

    def __init__(self, moe, family: str, router_logits=None, jitter_noise: float = 0.0):
        super().__init__(moe, family, router_logits, jitter_noise)
        self._join_deepspeed()

    def _join_deepspeed(self) -> None:
        """The native layer's attributes, the expert flags and the state-dict hooks (the HFMoEBlock's own kept)."""
        config = self.moe.config
        self.num_experts = config.num_experts
        self.ep_size = config.ep_size
        self.num_local_experts = self.moe.groups.layout.local_experts
        self.expert_group_name = f"ep_size_{config.ep_size}"
        self.use_residual = False
        self.enable_expert_tensor_parallelism = False
        carried = self._modules.get("experts")    # PEFT's LoRA on the experts by HF's names: per local expert too
        for param in [*self.moe.experts.parameters(), *(() if carried is None else carried.parameters())]:
            param.allreduce = False
            param.group_name = self.expert_group_name
        if not self.__dict__.get("_deepspeed_names_hooked"):   # once, should the block turn plain and back again
            self.register_state_dict_post_hook(_to_deepspeed_names)
            self.register_load_state_dict_pre_hook(_from_deepspeed_names)
            self._deepspeed_names_hooked = True

    def _bind_groups(self) -> None:
        """MoE.set_deepspeed_parallelism's last step: DeepSpeed's expert and expert-data groups made (the block's
        layer got its expert-parallel group when swapped; there is no native layer to bind)."""
        _expert_parallel_group(self.ep_size)

    def check_swapped_block(self, name: str, section: Mapping[str, Any]) -> None:
        """swap_moe_layers' check of a block swapped before initialize: it must already have the section's
        settings (check_swapped_block below)."""
        check_swapped_block(name, self, section)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by the engine: DeepSpeed's expert groups exist and hold the ranks the layer exchanges with."""
        if self.moe.groups.layout.slices > 1:
            raise ValueError(f"ep_size={self.ep_size} > num_experts={self.num_experts} (experts sliced over "
                             f"processes) is not supported under DeepSpeed, whose checkpoints hold whole experts; "
                             f"use an ep_size that divides num_experts")
        MoE.set_deepspeed_parallelism(self, use_data_before_expert_parallel_)
        if self.moe.is_parallel:
            ours = dist.get_process_group_ranks(self.moe.groups.ep_group)
            theirs = dist.get_process_group_ranks(_expert_parallel_group(self.ep_size))
            if ours != theirs:
                raise ValueError(f"the MoE layer exchanges tokens with ranks {ours}, but DeepSpeed's expert-parallel "
                                 f"group {self.expert_group_name} of this rank is {theirs}; swap the blocks with "
                                 f"ep_size={self.ep_size} and no ep_group (consecutive ranks, as DeepSpeed)")


def use_deepspeed_blocks(model: nn.Module) -> nn.Module:
    """Make every plain HFMoEBlock in model (swap_moe_blocks' and upcycle's) a DeepSpeedHFMoEBlock, in place: the
    same layer, parameters and hooks, now a native MoE layer to DeepSpeed's engine. Returns model."""
    for module in model.modules():
        if isinstance(module, HFMoEBlock) and not isinstance(module, DeepSpeedHFMoEBlock):
            module.__class__ = DeepSpeedHFMoEBlock
            module._join_deepspeed()
    return model


def _to_deepspeed_names(block: DeepSpeedHFMoEBlock, state: Dict[str, Any], prefix: str, local_metadata) -> None:
    if not isinstance(block, DeepSpeedHFMoEBlock):   # made a plain HFMoEBlock for ZeRO-3 (zero3.to_zero3)
        return
    peft = {key: state.pop(key) for key in [k for k in state if k.startswith(f"{prefix}experts.")]}
    for name, per_expert in PER_EXPERT.items():
        stacked = state.pop(f"{prefix}moe.experts.{name}", None)
        if stacked is not None:
            for i in range(block.num_local_experts):
                state[f"{prefix}{EXPERTS_PREFIX}{i}.{per_expert}"] = stacked[i]
    hide_from_expert_files(state, prefix, EXPERTS_PREFIX)
    if prefix:
        # PEFT's LoRA on the HF-named experts, in a model's state dict (PEFT's and HF's saves, DeepSpeed's model
        # file): PEFT's names, which PEFT's save selects and DeepSpeed's engine leaves out of its model file. With
        # expert parallelism every expert's factors, gathered (all ranks take it, as FSDP's full state dict), except
        # for the engine's model file, which only data-parallel rank 0 takes and which drops them
        if block.moe.is_parallel and peft and not _in_engine_model_file():
            _every_rank_takes_it(block)
            peft = {key: _peft_gathered(key, value, block) for key, value in peft.items()}
        state.update(peft)
        return
    # the block's own state dict, which DeepSpeed's engine files per expert: one slice per local expert
    for key, value in peft.items():
        for i, piece in enumerate(_peft_per_expert(key, value, block.num_local_experts)):
            state[f"{EXPERTS_PREFIX}{i}.{PEFT_PART}{key[len('experts.'):]}"] = piece


PEFT_PART = "peft."   # an expert's slice of PEFT's factors in DeepSpeed's per-expert files: <EXPERTS_PREFIX><i>.peft.<key>


def _peft_per_expert(key: str, value: torch.Tensor, experts: int) -> List[torch.Tensor]:
    """PEFT's ParamWrapper factors (lora_A [Q*E, I] expert-major, lora_B [O, Q*E] expert-minor) -> E slices
    ([Q, I], [O, Q])."""
    kind = key.split(".")[-3] if key.endswith(".weight") else None
    if kind not in ("lora_A", "lora_B") or value.dim() != 2 or value.shape[kind == "lora_B"] % experts:
        raise ValueError(f"DeepSpeed's per-expert checkpoint files cannot hold {key!r} (shape {tuple(value.shape)}) "
                         f"of PEFT's adapter on the experts: only LoRA's lora_A / lora_B factors of "
                         f"{experts} local experts can be split per expert")
    if kind == "lora_A":
        return list(value.reshape(experts, -1, value.shape[1]).unbind(0))
    return list(value.reshape(value.shape[0], -1, experts).unbind(2))


def _peft_kind(key: str, value: torch.Tensor, experts: int) -> str:
    kind = key.split(".")[-3] if key.endswith(".weight") else None
    if kind not in ("lora_A", "lora_B") or value.dim() != 2 or value.shape[kind == "lora_B"] % experts:
        raise ValueError(f"the expert-parallel swapped block cannot gather or share out {key!r} (shape "
                         f"{tuple(value.shape)}) of PEFT's adapter on the experts: only LoRA's lora_A / lora_B "
                         f"factors of {experts} experts are held per expert")
    return kind


def _in_engine_model_file() -> bool:
    """Whether DeepSpeed's engine asks for the model's state dict (module_state_dict: its model file, taken on
    data-parallel rank 0 only, with every key holding "expert" left out)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "module_state_dict" and \
                frame.f_globals.get("__name__", "").startswith("deepspeed."):
            return True
        frame = frame.f_back
    return False


GATHER_WAIT_S = 300.0   # how long a rank's state dict waits on a gloo group for the other ranks to take theirs


def _every_rank_takes_it(block: DeepSpeedHFMoEBlock) -> None:
    """On a gloo expert-parallel group, a clear error instead of a hang when some rank does not take the model's
    state dict (PEFT's save_pretrained called on rank 0 only). Other backends have no timed barrier: there such a
    call waits until the process group's own timeout."""
    group = block.moe.groups.ep_group
    if dist.get_backend(group) != "gloo":
        return
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=GATHER_WAIT_S))
    except RuntimeError as error:
        raise ValueError(f"moe_plugin: with ep_size={block.ep_size} a model's state dict gathers every expert's PEFT "
                         f"LoRA factors over the expert-parallel group, so every rank of it must take the state dict "
                         f"at once (trainer.save_model and accelerate's get_state_dict do); call PEFT's "
                         f"save_pretrained(path, is_main_process=rank == 0) on every rank, not on rank 0 only. "
                         f"Not every rank came within {GATHER_WAIT_S:g} s: {error}") from error


def _peft_gathered(key: str, value_local: torch.Tensor, block: DeepSpeedHFMoEBlock) -> torch.Tensor:
    """PEFT's factor of this rank's experts (lora_A [Q*L, I] expert-major, lora_B [O, Q*L] expert-minor) -> every
    expert's ([Q*E, I], [O, Q*E]: HF's layout, what PEFT on the unswapped model holds), all-gathered over the
    block's expert-parallel group (rank r holds experts r*L .. r*L+L-1). Every rank of the group must take it."""
    L = block.num_local_experts
    kind = _peft_kind(key, value_local, L)
    group = block.moe.groups.ep_group
    value_local = value_local.detach().contiguous()
    pieces = [torch.empty_like(value_local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, value_local, group=group)
    if kind == "lora_A":
        return torch.cat(pieces, 0)
    O = value_local.shape[0]
    return torch.cat([piece.reshape(O, -1, L) for piece in pieces], 2).reshape(O, -1)


def _peft_local_share(key: str, value: torch.Tensor, block: DeepSpeedHFMoEBlock, local: torch.Tensor) -> torch.Tensor:
    """The inverse of _peft_gathered on this rank: its experts' share of every expert's factor."""
    E, L = block.num_experts, block.num_local_experts
    kind = _peft_kind(key, value, E)
    first = block.moe.groups.layout.first_expert
    if kind == "lora_A":
        share = value.reshape(E, -1, value.shape[1])[first:first + L]
    else:
        share = value.reshape(value.shape[0], -1, E)[:, :, first:first + L]
    return share.reshape(local.shape)


def _peft_stacked(key: str, pieces: List[torch.Tensor]) -> torch.Tensor:
    """The inverse of _peft_per_expert."""
    if key.split(".")[-3] == "lora_A":
        return torch.cat(pieces, 0)
    return torch.stack(pieces, 2).reshape(pieces[0].shape[0], -1)


def _from_deepspeed_names(block: DeepSpeedHFMoEBlock, state: Dict[str, Any], prefix: str, *args) -> None:
    if not isinstance(block, DeepSpeedHFMoEBlock):
        return
    unhide_from_expert_files(state, prefix)
    for name, per_expert in PER_EXPERT.items():
        keys = [f"{prefix}{EXPERTS_PREFIX}{i}.{per_expert}" for i in range(block.num_local_experts)]
        if all(key in state for key in keys):
            state[f"{prefix}moe.experts.{name}"] = torch.stack([state.pop(key) for key in keys])
    first = f"{prefix}{EXPERTS_PREFIX}0.{PEFT_PART}"
    for rest in [k[len(first):] for k in state if k.startswith(first)]:
        keys = [f"{prefix}{EXPERTS_PREFIX}{i}.{PEFT_PART}{rest}" for i in range(block.num_local_experts)]
        if all(key in state for key in keys):
            state[f"{prefix}experts.{rest}"] = _peft_stacked(rest, [state.pop(key) for key in keys])
    if prefix and block.moe.is_parallel:   # every expert's PEFT factors (a gathered state dict): this rank's share
        for key in [k for k in state if k.startswith(f"{prefix}experts.")]:
            local = _local_tensor(block, key[len(prefix):])
            value = state[key]
            if local is not None and torch.is_tensor(value) and value.dim() == 2 and value.shape != local.shape \
                    and value.numel() == local.numel() * block.ep_size:
                state[key] = _peft_local_share(key, value, block, local)


def _local_tensor(block: nn.Module, name: str):
    try:
        return block.get_parameter(name)
    except AttributeError:
        return None


def check_section_for_model(model: nn.Module, section: Mapping[str, Any]) -> MoEConfig:
    """The MoEConfig a "moe" section gives a model with no DeepSpeed MoE layer (before anything starts).

    The model must be of a supported HF family, the backend "tutel", and the keys the HF config fixes must
    agree with it; anything else is an error naming what was looked for.
    """
    family = family_of(model)
    if family is None:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        found = f"model_type={model_type!r}" if config is not None else "no Hugging Face config"
        raise ValueError(f"DeepSpeed config has a \"moe\" section, but the model ({type(model).__name__}, {found}) "
                         f"has no MoE block the adapter recognises: it looked for deepspeed.moe.layer.MoE layers and "
                         f"for the sparse-MoE blocks of the Hugging Face families {', '.join(FAMILIES)} (by "
                         f"model.config.model_type); build the model with one of them, or remove the \"moe\" section")
    if section["backend"] != "tutel":
        raise ValueError(f"DeepSpeed config \"moe.backend\"={section['backend']!r} needs deepspeed.moe.layer.MoE "
                         f"layers; the {family.model_type} model's Hugging Face MoE blocks run on backend \"tutel\" "
                         f"(or on DeepSpeed's AutoEP: an \"expert_parallel\" section instead of \"moe\")")
    config = moe_config(model, **section_overrides(section))
    _check_fixed(section, config, f"the {family.model_type} model's Hugging Face config")
    if config.num_experts % config.ep_size:   # DeepSpeed's checkpoints hold whole experts: no hidden slicing
        allowed = [d for d in range(1, config.num_experts + 1) if config.num_experts % d == 0]
        raise ValueError(f"DeepSpeed config \"moe.ep_size\"={config.ep_size} is invalid for the {family.model_type} "
                         f"model's {config.num_experts} experts: must divide them, one of {allowed}")
    return config


def section_overrides(section: Mapping[str, Any]) -> Dict[str, Any]:
    """The MoEConfig fields a "moe" section sets on an HF model (the keys FIXED_BY_MODEL are checked, not set).

    Capacity as for native layers: drop_tokens false is dropless; capacity_factor (DeepSpeed's default 1.0 when
    only drop_tokens true is given) turns dropping on. Without either the model stays dropless, as in HF.
    """
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    out = {}
    for key, value in section.items():
        if key == "backend" or key in FIXED_BY_MODEL or key in CAPACITY_KEYS:
            continue
        if key not in fields:
            raise ValueError(f"DeepSpeed config \"moe.{key}\" does not apply to Hugging Face MoE models; "
                             f"remove it")
        out[key] = value
    drop = section.get("drop_tokens", "capacity_factor" in section or "eval_capacity_factor" in section)
    if drop:
        out["capacity_factor"] = float(section.get("capacity_factor", 1.0))
        out["eval_capacity_factor"] = float(section.get("eval_capacity_factor", out["capacity_factor"]))
    elif "drop_tokens" in section:
        out["capacity_factor"], out["eval_capacity_factor"] = 0.0, 0.0
    return out


def _check_fixed(section: Mapping[str, Any], config: MoEConfig, what: str) -> None:
    for key in FIXED_BY_MODEL:
        if key in section and section[key] != getattr(config, key):
            raise ValueError(f"DeepSpeed config \"moe.{key}\"={section[key]!r} contradicts {what} "
                             f"({key}={getattr(config, key)!r}); leave the key out or set it to {getattr(config, key)!r}")


def swap_for_section(model: nn.Module, section: Mapping[str, Any]) -> Tuple[nn.Module, Dict[int, List[nn.Parameter]]]:
    """Swap a supported HF model's MoE blocks with the section's settings (torch.distributed initialized).

    Returns the model and {id(old HF parameter): [the new parameters made from it]} (as swap_moe_layers).
    """
    ep_size = check_section_for_model(model, section).ep_size
    check_ep_size_under_deepspeed(ep_size, "DeepSpeed config \"moe.ep_size\"")
    family = family_of(model)
    old_blocks = {name: m for name, m in model.named_modules() if isinstance(m, family.block_class())}
    # a model built under deepspeed.zero.Init (HF's from_pretrained at stage 3): swap_moe_blocks gathers its blocks
    swap_moe_blocks(model, ep_group=_expert_parallel_group(ep_size) if ep_size > 1 else None,
                    block_class=DeepSpeedHFMoEBlock, **section_overrides(section))
    replaced: Dict[int, List[nn.Parameter]] = {}
    for name, old in old_blocks.items():
        new = model.get_submodule(name).moe
        old_params = dict(old.named_parameters())
        for weights in family.weights:
            for hf_name in weights.hf:
                if hf_name in old_params:
                    replaced[id(old_params.pop(hf_name))] = [new.get_parameter(weights.layer)]
        for param in old_params.values():   # none in the families today: dropped from the optimizer
            replaced[id(param)] = []
    return model, replaced


def check_swapped_block(name: str, block: DeepSpeedHFMoEBlock, section: Mapping[str, Any]) -> None:
    """A block swapped before initialize must already have the section's settings."""
    if section["backend"] != "tutel":
        raise ValueError(f"DeepSpeed config \"moe.backend\"={section['backend']!r}, but block {name!r} is moe_plugin's "
                         f"layer (swapped Hugging Face block); use backend \"tutel\"")
    what = f"block {name!r}, swapped before initialize with"
    _check_fixed(section, block.moe.config, what)
    config = block.moe.config
    effective = {"eval_capacity_factor": config.capacity_factor if config.eval_capacity_factor is None
                 else config.eval_capacity_factor}
    for key, value in section_overrides(section).items():
        has = effective.get(key, getattr(config, key))
        if has != value:
            raise ValueError(f"DeepSpeed config \"moe\" sets {key}={value!r}, but {what} {key}={has!r}; swap "
                             f"with the section's settings or leave the swap to initialize")
