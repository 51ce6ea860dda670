"""swap_moe_blocks: every sparse-MoE block of a supported HF model becomes an HFMoEBlock on an MoELayer."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.parallel.groups import check_ep_size, check_sizes

from .block import (HFMoEBlock, RouterInputTap, RouterLogits, init_blocks_in_init_weights, router_logits_class,
                    router_logits_name)
from . import peft as peft_lora
from .writer import save_pretrained_in_hf_names
from .families import FAMILIES, Family, hf_config_of, hf_to_layer, require_families

# fields the HF weights fix: an override may not contradict them
FIXED_BY_WEIGHTS = ("model_dim", "hidden_size", "num_experts", "activation", "bias", "shared_hidden_size",
                    "shared_gate")


def moe_config(model_or_config, **overrides) -> MoEConfig:
    """The MoEConfig that computes what an HF model's (or config's) blocks compute, with overrides applied
    (a composite model: its first family's blocks; see families_in)."""
    family, hf_config = require_families(model_or_config)[0]
    return _moe_config(family, hf_config, overrides)


def _moe_config(family: Family, hf_config, overrides: Dict[str, Any]) -> MoEConfig:
    base = family.moe_config(hf_config)
    for key in FIXED_BY_WEIGHTS:
        if key in overrides and key in base and overrides[key] != base[key]:
            raise ValueError(f"swap_moe_blocks: {key}={overrides[key]!r} contradicts the {family.model_type} "
                             f"config ({key}={base[key]!r}, fixed by the HF weights)")
    return MoEConfig(**{**base, **overrides})


def swap_moe_blocks(model: nn.Module, ep_group=None, block_class: Optional[type] = None,
                    **overrides: Any) -> nn.Module:
    """Replace, in place, every sparse-MoE block of model with an HFMoEBlock computing the same thing.

    overrides: any MoEConfig field (ep_size, capacity_factor, parallel, overlap_degree, a2a, ...).
    ep_group: a host framework's expert-parallel process group (default: built from the world).
    block_class: the replacement's class (default HFMoEBlock; DeepSpeed's paths pass their subclass,
    integrations/deepspeed/hf.py). Under expert parallelism every rank must call this (it builds process
    groups); each keeps its share of the experts, and ep_size must divide the number of processes. A
    composite model (Qwen3-VL-MoE, Qwen3-Omni-MoE, ...) has its blocks swapped by the families of its
    nested text configs. Returns model.
    """
    found = require_families(model)
    swaps = []
    for family, hf_config in found:
        config = _moe_config(family, hf_config, overrides)
        hf_class = family.block_class()
        swaps += [(name, module, family, config, hf_config) for name, module in model.named_modules()
                  if isinstance(module, hf_class) and family.swaps(module)]
    if not swaps:
        names = ", ".join(f"{f.block} ({f.model_type})" for f, _ in found)
        raise ValueError(f"swap_moe_blocks: the {hf_config_of(model).model_type} model has no {names} "
                         f"(already swapped, or no MoE layer in this config)")
    if ep_group is None:   # before any block changes
        for ep_size, E, H in sorted({(c.ep_size, c.num_experts, c.hidden_size) for _, _, _, c, _ in swaps}):
            check_ep_size(ep_size, "swap_moe_blocks: ep_size", num_experts=E, hidden_size=H)
            check_sizes(E, H, ep_size, dist.get_world_size() if ep_size > 1 else None)
    for name, hf_block, family, config, hf_config in swaps:
        parent, _, attr = name.rpartition(".")
        with _whole_parameters(hf_block):
            owner = _recording_model(model, name)
            if family.in_decoder:
                _swap_in_decoder(family, config, hf_block, hf_config, type(owner), ep_group, block_class)
                continue
            adapters = peft_lora.detach_wrappers(hf_block)     # PEFT's LoRA on HF's experts moves to the new block
            frozen = not any(p.requires_grad for p in hf_block.parameters())
            block = new_block(family, config, hf_block, hf_config, router_logits_class(type(owner)), ep_group,
                              block_class)
            block.use_tap_name(router_logits_name(type(owner)))
            if frozen:      # a frozen HF block (PEFT's base model, a fine-tuning setup) stays frozen
                block.requires_grad_(False)
            peft_lora.attach_wrappers(block, adapters)
        setattr(model.get_submodule(parent), attr, block)
    _hook_new_router_logits(model)
    init_blocks_in_init_weights(model)
    if hasattr(type(model), "save_pretrained") and not peft_lora.is_peft_model(model):
        # a PreTrainedModel: its folders stay loadable by plain transformers (a PeftModel saves its adapters itself)
        model.save_pretrained = functools.partial(save_pretrained_in_hf_names, model)
    return model


def _swap_in_decoder(family: Family, config: MoEConfig, decoder: nn.Module, hf_config, owner_class: type,
                     ep_group, block_class) -> None:
    """A decoder layer holding router and experts (Gemma 4): experts becomes the HFMoEBlock, router a
    RouterInputTap handing it the router input (of HF's recorded router class when the model records it)."""
    block = new_block(family, config, decoder, hf_config, None, ep_group, block_class)
    block.hf_names_in_parent = True
    tap = (router_logits_class(owner_class, RouterInputTap) or RouterInputTap)()
    tap.__dict__["_router"] = block.moe.router
    decoder.experts, decoder.router = block, tap
    decoder.register_load_state_dict_pre_hook(functools.partial(_from_hf_names, family.model_type))


def _recording_model(model: nn.Module, block_name: str) -> nn.Module:
    """The innermost module above a block that records router logits (its router-logits tap follows that
    module's recorder), or model."""
    parts = block_name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:depth]))
        if router_logits_class(type(owner)) is not None:
            return owner
    return model


def _whole_parameters(module: nn.Module):
    """A context in which the parameters of a module built under deepspeed.zero.Init (HF's from_pretrained at
    ZeRO stage 3: partitioned, each with a ds_id) are whole (a collective); nothing for any other module."""
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(partitioned)


def new_block(family: Family, config: MoEConfig, hf_block: nn.Module, hf_config, tap_class, ep_group=None,
              block_class: Optional[type] = None):
    """An HFMoEBlock holding hf_block's weights (this rank's share under expert parallelism); on the meta
    device when hf_block is there (to_empty, then init_weights() or reset_parameters() or a load fill it)."""
    state = hf_block.state_dict()
    reference = state[family.weights[1].hf[0]]           # the routed experts' dtype and device
    own_bias = any(m.layer == "router.expert_bias_E" and all(n in state for n in m.hf) for m in family.weights)
    with torch.device("meta") if reference.is_meta else contextlib.nullcontext():
        layer = MoELayer(config, ep_group=ep_group)
    for part in (layer.router, layer.experts, layer.shared_expert):
        if part is not None:             # reset_parameters draws as HF's _init_weights draws the block
            part.init_std = float(hf_config.initializer_range)
    layer.router.fixed_bias = own_bias
    if not reference.is_meta:
        _load_hf_tensors(layer, family, state)
    layer.to(device=reference.device)
    for param in layer.parameters():
        param.data = param.data.to(reference.dtype)
    block = (block_class or HFMoEBlock)(layer, family.model_type, tap_class() if tap_class else None,
                                          family.jitter_noise(hf_config))
    block.returns_tuple = family.returns_tuple
    if not family.in_decoder:   # (in_decoder: hooked on the decoder layer, whose prefix HF's names start from)
        block.register_load_state_dict_pre_hook(functools.partial(_from_hf_names, family.model_type))   # picklable
    return block.train(hf_block.training)


def _from_hf_names(model_type: str, owner: nn.Module, state: Dict[str, torch.Tensor], prefix: str, *args) -> None:
    """load_state_dict takes the block in HF's names and layouts too (an unswapped model's state_dict(),
    hf_state_dict's output): the HF tensors load into the layer (this rank's share of the experts) and
    stand in the state under the layer's own names. owner: the block, or (Gemma 4) the decoder layer holding it."""
    family = FAMILIES[model_type]
    block, layer_prefix = (owner, f"{prefix}moe.") if isinstance(owner, HFMoEBlock) else \
        (owner.experts, f"{prefix}experts.moe.")
    keys = [f"{prefix}{name}" for m in family.weights for name in m.hf]
    if not all(f"{prefix}{name}" in state for m in family.weights if not m.optional for name in m.hf):
        return
    keys = [key for key in keys if key in state]
    _load_hf_tensors(block.moe, family, {key[len(prefix):]: state.pop(key) for key in keys})
    state.update({f"{layer_prefix}{key}": tensor for key, tensor in block.moe.state_dict().items()})


def _load_hf_tensors(layer: MoELayer, family: Family, hf_state: Dict[str, torch.Tensor]) -> None:
    """An HF block's tensors (names relative to the block, every expert) into the layer (this rank's share);
    entries of the layer's state that no HF tensor maps to (none today) keep the layer's own values."""
    own = {k: v for k, v in layer.state_dict().items() if not k.startswith("experts.")}
    layer.load_full_state_dict({**own, **hf_to_layer(family, hf_state, layer.config.num_experts)})


def _hook_new_router_logits(model: nn.Module) -> None:
    """HF hooks its output recorders once, on the first forward that records: if that already
    happened, hook the new blocks' router logits the same way."""
    from transformers.utils.output_capturing import install_output_capuring_hook
    if not any(getattr(m, "_output_capturing_hooks_installed", False) for m in model.modules()):
        return
    for module in model.modules():
        if isinstance(module, RouterLogits) and not module._forward_hooks:
            install_output_capuring_hook(module, "router_logits", module.index)
