"""The layout a DeepSpeed MoE checkpoint was written in: recorded at save, checked (and converted) at load.

DeepSpeed's optimizer state fits only the layout that wrote it: at ZeRO 1-3 each data-parallel rank's file holds its
flat partition of every optimizer group (an expert group split over world / ep_size ranks), and at every stage each
expert-parallel rank's state holds the moments of its own experts. DeepSpeed checks the dense data-parallel size
only, so loading at another ep_size on the same processes went through and trained on misplaced moments (ZeRO-2,
ep_size 2 -> 1: the next step 0.93 relative off, DESIGN.md). For the engines initialize returns (MoE models),
engine.save_checkpoint writes LAYOUT_FILE into the tag folder (the layout, and what reshard.py needs to read the
files in another one), and engine.load_checkpoint compares it with the current layout before DeepSpeed reads
anything:
- the same layout: DeepSpeed loads everything, as without moe_plugin;
- another world size, ep_size or ZeRO stage, into ZeRO 0-2 (from 0-2 in fp32, 1-2 in bf16/fp16, 3 in fp32): DeepSpeed
  loads the weights, the LR scheduler and the step counters (from ZeRO 3, whose files hold no whole model,
  reshard.load_zero3_module_state does), and reshard.py converts the optimizer state (masters, moments, step, the
  groups' settings);
- into ZeRO 3 (from 0-3 in fp32): reshard.load_into_zero3 loads everything instead of DeepSpeed;
- a PipelineModule at ZeRO 0-1 in fp32 at another number of pipeline stages, data-parallel size per stage or
  ep_size: each stage's first data-parallel rank also writes its stage's record at save (reshard_pipeline.STAGE_FILE),
  each rank compares its own stage's part of the saved layout (reshard_pipeline.this_stage), and
  reshard_pipeline.load_pipeline_checkpoint sets the weights, scheduler, counters and optimizer state from the saved
  stage that held each parameter (DeepSpeed's own load reads the files of its stage number);
- anything else: one ValueError naming both layouts and why it cannot be converted (ZeRO 3 in bf16, pipelines in
  bf16, bf16/fp16 at ZeRO 0, ...), unless DeepSpeed's own load fits it (plain ZeRO 0 keeps the whole state on every
  rank of an expert-parallel group, so the world size may change there).
Weights-only loads (load_optimizer_states=False, load_module_only=True) are DeepSpeed's own, which moves the weights
to any layout (one file per expert) but one: into ZeRO 3 from ZeRO 0-2 it fails deep inside, so check_weights_only
stops that load first. DeepSpeed's universal checkpoints ("checkpoint": {"load_universal": true}) are
refused for MoE models: they do not carry DeepSpeed MoE layers' experts.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch.distributed as dist
from torch import nn

from moe_plugin import MoELayer
from moe_plugin.integrations.deepspeed.reshard import (load_into_zero3, load_optimizer_state, load_zero3_module_state,
                                                       reshard_refusal, save_time_record)
from moe_plugin.integrations.deepspeed.reshard_pipeline import load_pipeline_checkpoint, this_stage, write_stage_record
from moe_plugin.integrations.deepspeed.zero3 import Zero3MoE

__all__ = ["LAYOUT_FILE", "checkpoint_layout", "check_layout_on_load"]

LAYOUT_FILE = "moe_plugin_layout.json"
UNIVERSAL_REFUSED = (
    "\"checkpoint\": {\"load_universal\": true} with MoE layers: DeepSpeed's universal checkpoints (ds_to_universal) "
    "do not carry DeepSpeed MoE layers' experts (DeepSpeed issue 5716); remove load_universal and load the regular "
    "checkpoint with engine.load_checkpoint(dir), which converts its optimizer state to this run's layout "
    "(world size, ep_size, ZeRO stage)")
_WRAPPED = "_moe_plugin_layout_checked"


def checkpoint_layout(engine) -> Dict[str, Any]:
    """world_size, zero_stage, pipeline_stages, {MoE layer name: ep_size} and whether the model is a PipelineModule
    (pipeline_module) of a DeepSpeed engine."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size
    stages = getattr(engine, "num_stages", None) or bwc_pipeline_parallel_world_size(groups.mpu)
    stage = int(engine.zero_optimization_stage())
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "zero_stage": stage,
            "pipeline_stages": int(stages), "ep_size": ep_sizes(engine.module),
            "partitioned": stage > 0 or type(engine.optimizer).__name__ == "BF16_Optimizer",
            "pipeline_module": isinstance(engine.module, PipelineModule)}


def ep_sizes(model: nn.Module) -> Dict[str, int]:
    """Each MoE layer's ep_size by its name: DeepSpeed MoE modules (native, ours, their ZeRO-3 form) and any other
    MoELayer."""
    from deepspeed.moe.layer import MoE as NativeMoE

    found, inside = {}, []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if isinstance(module, (NativeMoE, Zero3MoE)):
            found[name], _ = int(module.ep_size), inside.append(name + ".")
        elif isinstance(module, MoELayer):
            found[name], _ = int(module.config.ep_size), inside.append(name + ".")
    return found


def fits(saved: Dict[str, Any], current: Dict[str, Any]) -> bool:
    same = all(saved.get(key) == current[key] for key in ("zero_stage", "pipeline_stages", "ep_size"))
    partitioned = saved.get("partitioned", True) or current["partitioned"]
    return same and (not partitioned or saved.get("world_size") == current["world_size"])


def same(saved: Dict[str, Any], current: Dict[str, Any]) -> bool:
    return all(saved.get(key) == current[key] for key in ("world_size", "zero_stage", "pipeline_stages", "ep_size"))


def describe(layout: Dict[str, Any]) -> str:
    sizes = sorted(set(layout.get("ep_size", {}).values()))
    ep = f"ep_size {sizes[0]}" if len(sizes) == 1 else f"ep_size by layer {layout.get('ep_size')}"
    return (f"world size {layout.get('world_size')}, {ep}, ZeRO stage {layout.get('zero_stage')}, "
            f"{layout.get('pipeline_stages')} pipeline stage(s)")


def _tag_folder(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
    return os.path.join(load_dir, str(tag))


def check_layout_on_load(engine) -> None:
    """Make engine.save_checkpoint record the layout and engine.load_checkpoint convert an optimizer state written in
    another one (reshard.py), or refuse it where it cannot (idempotent)."""
    if getattr(engine, _WRAPPED, False):
        return
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        folder = os.path.join(save_dir, str(tag if tag is not None else f"global_step{engine.global_steps}"))
        record = {**checkpoint_layout(engine), **save_time_record(engine)}
        if _writer(engine):   # before DeepSpeed's save, which ends when every rank has written
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, LAYOUT_FILE), "w") as f:
                json.dump(record, f)
        write_stage_record(engine, folder, record)
        return save(save_dir, tag, *args, **kwargs)

    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        folder = _tag_folder(load_dir, tag)
        if engine.load_universal_checkpoint() and ep_sizes(engine.module):
            raise ValueError(UNIVERSAL_REFUSED)
        saved, current = None, {**checkpoint_layout(engine), **save_time_record(engine)}
        if load_optimizer_states and not load_module_only and folder is not None:
            saved = check_layout(folder, current)
        elif folder is not None:
            check_weights_only(folder, current)
        if saved is not None and saved.get("stages"):
            return load_pipeline_checkpoint(engine, folder, saved, current, load_lr_scheduler_states)
        if saved is not None and current["zero_stage"] == 3:
            return folder, load_into_zero3(engine, folder, saved, current, load_lr_scheduler_states)
        if saved is not None and saved["zero_stage"] == 3:
            result = folder, load_zero3_module_state(engine, folder, saved, current, load_lr_scheduler_states)
        else:
            result = load(load_dir, tag, load_module_strict=load_module_strict,
                          load_optimizer_states=load_optimizer_states and saved is None,
                          load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                          custom_load_fn=custom_load_fn)
        if saved is not None:
            load_optimizer_state(engine, folder, saved, current)
        return result

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
    setattr(engine, _WRAPPED, True)


def _writer(engine) -> bool:
    """Rank 0, or each node's first rank where every node writes its own copy (DeepSpeed's use_node_local_storage)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        return True
    return bool(engine.use_node_local_storage()) and int(os.environ.get("LOCAL_RANK", "0")) == 0


def _saved_layout(folder: str) -> Optional[Dict[str, Any]]:
    """The layout in folder's LAYOUT_FILE; None without one (written without moe_plugin's engine, or before it)."""
    path = os.path.join(folder, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _weights_only_fails(saved: Dict[str, Any], current: Dict[str, Any]) -> bool:
    """Whether DeepSpeed's own weights-only load fails between these layouts: into ZeRO 3 from ZeRO 0-2 (it asks for
    per-rank ZeRO-3 files the checkpoint lacks)."""
    return current["zero_stage"] == 3 and saved.get("zero_stage") != 3


def check_weights_only(folder: str, current: Dict[str, Any]) -> None:
    """A weights-only load into ZeRO 3 of a ZeRO 0-2 checkpoint, which DeepSpeed's own load fails deep inside (it
    asks for per-rank ZeRO-3 files the checkpoint lacks): a ValueError naming both layouts and the load that works."""
    saved = _saved_layout(folder)
    if saved is None or not _weights_only_fails(saved, current):
        return
    raise ValueError(f"the checkpoint in {folder} was saved with {describe(saved)}; a weights-only load "
                     f"(load_optimizer_states=False or load_module_only=True) into this run's {describe(current)} "
                     f"is not converted: load it with its optimizer state (the default, converted into ZeRO 3), or "
                     f"at ZeRO stage {saved.get('zero_stage')}")


def check_layout(folder: str, current: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """None where DeepSpeed may load the optimizer state in folder (a tag folder holding LAYOUT_FILE) as it is; the
    saved layout where reshard.py converts it to current; otherwise a ValueError naming both layouts and why."""
    saved = _saved_layout(folder)
    if saved is None:
        return None   # written without moe_plugin's engine (or before this check existed): DeepSpeed's own checks
    saved = this_stage(folder, saved, current)
    if same(saved, current):
        return None
    why = reshard_refusal(saved, current)
    if why is None:
        return saved
    if fits(saved, current):
        return None
    weights_only = "" if _weights_only_fails(saved, current) else (
        "load the weights only with engine.load_checkpoint(..., load_optimizer_states=False) (the optimizer's "
        "moments and step start over), or ")
    raise ValueError(
        f"the optimizer state in {folder} was saved with {describe(saved)} and does not fit this run's "
        f"{describe(current)}, and it cannot be converted: {why}; {weights_only}resume with the saved layout")
