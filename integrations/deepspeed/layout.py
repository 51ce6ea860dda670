"""The layout a DeepSpeed MoE checkpoint was written in: recorded at save, checked at load.

DeepSpeed's optimizer state fits only the layout that wrote it: at ZeRO 1-3 each data-parallel rank's file holds its
flat partition of every optimizer group (an expert group split over world / ep_size ranks), and at every stage each
expert-parallel rank's state holds the moments of its own experts. DeepSpeed checks the dense data-parallel size
only, so loading at another ep_size on the same processes went through and trained on misplaced moments (ZeRO-2,
ep_size 2 -> 1: the next step 0.93 relative off, DESIGN.md). For the engines initialize returns (MoE models),
engine.save_checkpoint writes LAYOUT_FILE into the tag folder, and engine.load_checkpoint compares it with the current
layout before DeepSpeed reads anything: an optimizer state that does not fit stops with one ValueError naming both
layouts and the way forward. Weights-only loads (load_optimizer_states=False, load_module_only=True) are not checked:
DeepSpeed moves the weights to any layout (one file per expert).

What fits: the same ZeRO stage, pipeline stages and every MoE layer's ep_size, and the same world size wherever the
optimizer state is split over data-parallel ranks (ZeRO 1-3, and bf16 at ZeRO 0: DeepSpeed's BF16_Optimizer). Plain
ZeRO 0 keeps the whole state on every rank of an expert-parallel group, so the world size may change there.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch.distributed as dist
from torch import nn

from moe_plugin import MoELayer
from moe_plugin.integrations.deepspeed.zero3 import Zero3MoE

__all__ = ["LAYOUT_FILE", "checkpoint_layout", "check_layout_on_load"]

LAYOUT_FILE = "moe_plugin_layout.json"
_WRAPPED = "_moe_plugin_layout_checked"


def checkpoint_layout(engine) -> Dict[str, Any]:
    """world_size, zero_stage, pipeline_stages and {MoE layer name: ep_size} of a DeepSpeed engine."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size
    stages = getattr(engine, "num_stages", None) or bwc_pipeline_parallel_world_size(groups.mpu)
    stage = int(engine.zero_optimization_stage())
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "zero_stage": stage,
            "pipeline_stages": int(stages), "ep_size": ep_sizes(engine.module),
            "partitioned": stage > 0 or type(engine.optimizer).__name__ == "BF16_Optimizer"}


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
    """Make engine.save_checkpoint record the layout and engine.load_checkpoint refuse an optimizer state written in
    another one (idempotent)."""
    if getattr(engine, _WRAPPED, False):
        return
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        folder = os.path.join(save_dir, str(tag if tag is not None else f"global_step{engine.global_steps}"))
        if _writer(engine):   # before DeepSpeed's save, which ends when every rank has written
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, LAYOUT_FILE), "w") as f:
                json.dump(checkpoint_layout(engine), f)
        return save(save_dir, tag, *args, **kwargs)

    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        folder = _tag_folder(load_dir, tag)
        if load_optimizer_states and not load_module_only and folder is not None:
            check_layout(folder, checkpoint_layout(engine))
        return load(load_dir, tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                    custom_load_fn=custom_load_fn)

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
    setattr(engine, _WRAPPED, True)


def _writer(engine) -> bool:
    """Rank 0, or each node's first rank where every node writes its own copy (DeepSpeed's use_node_local_storage)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        return True
    return bool(engine.use_node_local_storage()) and int(os.environ.get("LOCAL_RANK", "0")) == 0


def check_layout(folder: str, current: Dict[str, Any]) -> None:
    """ValueError unless the optimizer state in folder (a tag folder holding LAYOUT_FILE) fits current."""
    path = os.path.join(folder, LAYOUT_FILE)
    if not os.path.isfile(path):
        return   # written without moe_plugin's engine (or before this check existed): DeepSpeed's own checks only
    with open(path) as f:
        saved = json.load(f)
    if not fits(saved, current):
        raise ValueError(
            f"the optimizer state in {folder} was saved with {describe(saved)} and does not fit this run's "
            f"{describe(current)}: DeepSpeed would load it onto the wrong parameters; load the weights only with "
            f"engine.load_checkpoint(..., load_optimizer_states=False) (the optimizer's moments and step start "
            f"over), or resume with the saved layout")
