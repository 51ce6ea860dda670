"""export_hf: a swapped model back to a folder that plain transformers loads (HF names and layouts)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Union

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.parallel.expert_parallel import gathered_experts

from .block import HFMoEBlock
from .families import layer_to_hf, require_family

EXPERT_TENSORS = ("w1_EDH", "b1_EH", "w2_EHD", "b2_ED")


@torch.no_grad()
def full_layer_state(block: HFMoEBlock) -> Dict[str, torch.Tensor]:
    """The block's MoELayer state with every expert (a collective over its expert-parallel group)."""
    layer = block.moe
    state = layer.state_dict()
    if layer.is_parallel:
        full = gathered_experts(layer.experts, layer.groups, 0)
        state.update({f"experts.{n}": getattr(full, n) for n in EXPERT_TENSORS if getattr(full, n) is not None})
    return state


@torch.no_grad()
def hf_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """model.state_dict() in the HF names and layouts of its family, every expert included (a collective
    under expert parallelism: every rank must call it)."""
    family = require_family(model)
    state = {}
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, HFMoEBlock)}
    for name, tensor in model.state_dict().items():
        if not any(name.startswith(f"{b}.") for b in blocks):
            state[name] = tensor
    for name, block in blocks.items():
        for key, tensor in layer_to_hf(family, full_layer_state(block)).items():
            state[f"{name}.{key}"] = tensor.contiguous()
    return state


def export_hf(model: nn.Module, directory: Union[str, os.PathLike]) -> Path:
    """Write model (swapped or not) as an HF checkpoint: config and weights, every expert, HF layouts.

    `AutoModelForCausalLM.from_pretrained(directory)` loads it with plain transformers. Under expert
    parallelism every rank must call it; global rank 0 writes. The folder is written atomically.
    """
    state = hf_state_dict(model)
    directory = Path(directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with torch.device("meta"):
            fresh = type(model)(model.config)          # the original HF class: only the blocks were swapped
        missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if k not in _tied_keys(fresh)]
        if missing or unexpected:
            raise RuntimeError(f"export_hf: the state does not match {type(model).__name__}: missing {missing}, "
                               f"unexpected {unexpected}")
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            fresh.save_pretrained(tmp)
            _replace_dir(tmp, directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return directory


def _tied_keys(model: nn.Module):
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if getattr(model.config, "tie_word_embeddings", False) else set()


def _replace_dir(new: Path, target: Path) -> None:
    """Move the finished folder into place; an old one is swapped out first, then removed."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old.{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old)
