"""ZeRO stage 3 with MoE layers, through DeepSpeed's own constrained ZeRO-3 (the one AutoEP uses).

DeepSpeed 0.19.8 refuses every deepspeed.moe.layer.MoE at stage 3 (engine._validate_zero3_moe_compatibility) and
treats only AutoEP's layers as MoE there. So at stage 3 `to_zero3` turns our layers into plain modules with the same
weights and forward (an HF block becomes its HFMoEBlock, the native-API layer a `Zero3MoE`), and

- tags their expert parameters as AutoEP tags its own: ds_zero_placement_family "autoep_expert",
  ds_zero_partition_group_name "ep_size_<ep>" and the expert-data-parallel group as
  ds_zero_partition_process_group. DeepSpeed's partitioner then splits them over that group (dense parameters over
  the data-parallel group), and its stage-3 optimizer averages, clips and checkpoints them as AutoEP's experts;
- flags the layers as ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules): their parameters are gathered
  once when the layer starts, so ranks that route to different experts (or to none) make the same collectives;
- at ep_size > 1, has the engine's 16-bit state dict (what HF Trainer's save_model and save_16bit_model write)
  hold every expert: DeepSpeed gathers each parameter over its partition group only, i.e. one expert-parallel
  rank's experts.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

import deepspeed
from deepspeed.moe.layer import MoE as NativeMoE
from deepspeed.moe.utils import is_moe_param
from deepspeed.utils import groups, set_z3_leaf_modules

from moe_plugin.integrations.deepspeed.native import MoE, _expert_parallel_group
from moe_plugin.parallel.expert_grads import expert_layers
from moe_plugin.parallel.expert_parallel import whole_experts

__all__ = ["Zero3MoE", "check_zero3_config", "gather_every_expert_on_16bit_save", "to_zero3", "zero_stage"]

EXPERT_FAMILY = "autoep_expert"   # DeepSpeed's placement family for parameters split over an expert-data group


class Zero3MoE(nn.Module):
    """moe_plugin.integrations.deepspeed.MoE as it runs under ZeRO stage 3: the same attributes, weights and
    forward(x, used_token=None) -> (output, l_aux, exp_counts), without the deepspeed.moe.layer.MoE base class."""

    forward = NativeMoE.forward


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    return ds_config.get("zero_optimization", {}).get("stage", 0)


def check_zero3_config(ds_config: Mapping[str, Any], mpu: Any = None) -> None:
    """Stage-3 options DeepSpeed's constrained ZeRO-3 refuses for expert placement, refused here by their key."""
    zero = ds_config.get("zero_optimization", {})
    refused = {"zero_optimization.zero_hpz_partition_size": (zero.get("zero_hpz_partition_size", 1), 1),
               "zero_optimization.zero_quantized_gradients": (zero.get("zero_quantized_gradients", False), False),
               "sequence_parallel_size": (ds_config.get("sequence_parallel_size", 1), 1)}
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        refused["sequence_parallel_size"] = (mpu.get_sequence_parallel_world_size(), 1)
    for key, (value, allowed) in refused.items():
        if value not in (allowed, None):
            raise ValueError(f"DeepSpeed config {key}={value!r} is not supported with MoE layers at "
                             f"zero_optimization.stage 3: DeepSpeed places expert parameters (split over their "
                             f"expert-data-parallel group) only without it; allowed: {allowed!r} (or stage 1/2)")


def hf_support():
    """hf.py, DeepSpeed's side of Hugging Face models (DeepSpeedHFMoEBlock, the section's swap), loaded on use."""
    from moe_plugin.integrations.deepspeed import hf   # needs transformers (optional)
    return hf


def to_zero3(model: nn.Module) -> nn.Module:
    """Make every MoE layer of ours in model run under ZeRO stage 3 (see the module doc), in place.

    Call before deepspeed.initialize, after torch.distributed starts. Plain HFMoEBlocks (swap_moe_blocks') are
    placed as DeepSpeed's blocks are (hf.use_deepspeed_blocks first). Returns model."""
    hf = hf_support()
    DeepSpeedHFMoEBlock, HFMoEBlock = hf.DeepSpeedHFMoEBlock, hf.HFMoEBlock
    hf.use_deepspeed_blocks(model)
    layers = [m for m in model.modules() if isinstance(m, (DeepSpeedHFMoEBlock, MoE))]
    native = [name for name, m in model.named_modules()
              if isinstance(m, NativeMoE) and not isinstance(m, (DeepSpeedHFMoEBlock, MoE))]
    if native:
        raise ValueError(f"DeepSpeed's native MoE layers ({', '.join(native[:3])}) do not run under "
                         f"zero_optimization.stage 3 (DeepSpeed refuses them); set \"moe\": {{\"backend\": \"tutel\"}} "
                         f"to run them as moe_plugin's layer, or use stage 0, 1 or 2")
    for layer in layers:
        _place_experts(layer)
        layer.__class__ = HFMoEBlock if isinstance(layer, DeepSpeedHFMoEBlock) else Zero3MoE
        if not layer.__dict__.get("_input_grad_hooked"):
            layer.register_forward_pre_hook(_input_needs_grad)
            layer._input_grad_hooked = True
    if any(isinstance(m, (HFMoEBlock, Zero3MoE)) for m in model.modules()):
        set_z3_leaf_modules(model, [HFMoEBlock, Zero3MoE])
    return model


def _input_needs_grad(layer: nn.Module, args):
    """DeepSpeed reduces a ZeRO-3 leaf module's gradients in a full backward hook, which fires as soon as the
    outputs' gradients exist when no input requires grad: before the layer's own backward gives its parameters
    theirs (AccumulateGrad then fails on a re-partitioned parameter). A layer that trains below frozen modules (LoRA
    on the experts, the rest frozen) gets an input that requires grad."""
    if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor) \
            or not args[0].is_floating_point() or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) \
            or not any(p.requires_grad for p in layer.parameters()):
        return None
    return (args[0].detach().requires_grad_(True), *args[1:])


def _place_experts(layer: nn.Module) -> None:
    name = layer.expert_group_name
    _expert_parallel_group(layer.ep_size)   # DeepSpeed's expert and expert-data groups exist
    expert_data_group = groups._get_expert_data_parallel_group(name)
    for param_name, param in layer.named_parameters():
        if not is_moe_param(param):
            continue
        if hasattr(param, "ds_id") and layer.ep_size > 1:
            raise ValueError(f"expert parameter {param_name!r} was partitioned over all ranks by deepspeed.zero.Init; "
                             f"with ep_size={layer.ep_size} it must be split over its expert-data-parallel group: "
                             f"build the model outside deepspeed.zero.Init (ZeRO-3 partitions it in initialize)")
        param.ds_zero_placement_family = EXPERT_FAMILY
        param.ds_zero_partition_group_name = name
        param.ds_zero_partition_process_group = expert_data_group


def gather_every_expert_on_16bit_save(engine) -> None:
    """Make engine._zero3_consolidated_16bit_state_dict (HF Trainer's save_model, save_16bit_model; every rank
    calls it) hold every expert of each expert-parallel layer on rank 0, not only rank 0's (stacked experts; the
    general path's expert modules stay rank 0's)."""
    layers = [(prefix, layer) for prefix, layer in expert_layers(engine.module)
              if layer.experts.stacked]
    if not layers:
        return
    consolidated = engine._zero3_consolidated_16bit_state_dict

    def with_every_expert(*args, **kwargs):
        state = consolidated(*args, **kwargs)
        for prefix, layer in layers:
            with deepspeed.zero.GatheredParameters(list(layer.experts.parameters())):
                whole = whole_experts(layer)   # a collective over the expert-parallel group
            if state is not None:
                state.update({f"{prefix}experts.{name}": tensor.cpu() for name, tensor in whole.items()})
        return state

    engine._zero3_consolidated_16bit_state_dict = with_every_expert
