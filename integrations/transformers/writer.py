"""The transformers writer: a swapped model's tensors in HF names and layouts (hf_state_dict), the save_pretrained
swap_moe_blocks installs, and write_folder, which saves an HF model given its state into a folder atomically.
export.py (export_hf) picks what to write; this file only writes."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_plugin.parallel.expert_parallel import whole_experts

from .block import HFMoEBlock, hf_key
from .families import FAMILIES, layer_to_hf, require_families


@torch.no_grad()
def full_layer_state(block: HFMoEBlock) -> Dict[str, torch.Tensor]:
    """The block's MoELayer state with every expert (a collective over its expert-parallel group)."""
    layer = block.moe
    state = {name: _whole(tensor) for name, tensor in layer.state_dict().items()
             if not (layer.is_parallel and name.startswith("experts."))}
    if layer.is_parallel:
        state.update({f"experts.{name}": tensor for name, tensor in whole_experts(layer).items()})
    return state


def hf_tensors(block: HFMoEBlock, layer_state: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """The block's tensors in its HF block's names and layouts, every expert: from layer_state (its MoELayer's
    state, whole) or else from the block (a collective under expert parallelism); the choice bias only when the
    HF block has one (LFM2-MoE's is optional)."""
    state = full_layer_state(block) if layer_state is None else dict(layer_state)
    if not block.moe.router.fixed_bias:
        state.pop("router.expert_bias_E", None)
    return layer_to_hf(FAMILIES[block.family], state)


def _layer_entries(state: Mapping[str, torch.Tensor], block_name: str) -> Dict[str, torch.Tensor]:
    prefix = f"{block_name}.moe."
    return {key[len(prefix):]: tensor for key, tensor in state.items() if key.startswith(prefix)}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard (a DTensor) as the whole tensor (a collective over its mesh); other tensors as they are."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def hf_state_dict(model: nn.Module, state: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """model.state_dict() (or state, a state dict of model) in the HF names and layouts of its family, every
    expert included. A block's entries come from state when it holds the block's layer whole (the layer's own
    names, experts not spread over processes: e.g. the gathered state HF Trainer passes on one rank under FSDP2
    or ZeRO-3), else from the block itself (a collective under expert parallelism: every rank must call it)."""
    require_families(model)
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, HFMoEBlock)}
    state = model.state_dict() if state is None else state
    hf_state = {name: _whole(tensor) for name, tensor in state.items()
                if not any(name.startswith(f"{b}.") for b in blocks)}
    for name, block in blocks.items():
        given = _layer_entries(state, name)
        whole = holds_every_expert(block, given)
        layer_state = {key: _whole(tensor) for key, tensor in given.items()} if whole else None
        for key, tensor in hf_tensors(block, layer_state).items():
            hf_state[hf_key(name, block, key)] = tensor.contiguous()
    return hf_state


def holds_every_expert(block: HFMoEBlock, layer_state: Mapping[str, torch.Tensor]) -> bool:
    """Whether layer_state (the block's MoELayer entries) holds the layer whole: in its own names (not
    DeepSpeed's per-expert ones) with every expert, e.g. the full state dict HF Trainer gathers under FSDP2."""
    w2 = layer_state.get("experts.w2_EHD")
    config = block.moe.config
    return w2 is not None and tuple(w2.shape[:2]) == (config.num_experts, config.hidden_size)


def save_pretrained_in_hf_names(model: nn.Module, save_directory, *args, state_dict=None, **kwargs):
    """A swapped model's save_pretrained (swap_moe_blocks installs it on the model): HF's own, writing the
    blocks in HF names and layouts, so that plain transformers' from_pretrained loads the folder (HF Trainer
    saves through it). With the experts spread over processes a single rank cannot write them all (Trainer
    calls save_pretrained on one rank only) unless state_dict holds every expert (the full state dict Trainer
    gathers under fully_shard_moe): else it writes the swapped names and warns; use export_hf."""
    hf_save = type(model).save_pretrained
    given = {} if state_dict is None else state_dict
    if any(block.moe.is_parallel and not holds_every_expert(block, _layer_entries(given, name))
           for name, block in model.named_modules() if isinstance(block, HFMoEBlock)):
        warnings.warn("save_pretrained of a model whose experts are spread over processes writes this rank's "
                      "share in moe_plugin's names, which plain transformers cannot load; call "
                      "moe_plugin.integrations.transformers.export_hf(model, directory) on every rank for an "
                      "HF checkpoint", stacklevel=2)
        return hf_save(model, save_directory, *args, state_dict=state_dict, **kwargs)
    return hf_save(model, save_directory, *args, state_dict=hf_state_dict(model, state_dict), **kwargs)


def write_folder(fresh: nn.Module, state: Mapping[str, torch.Tensor], directory: Path,
                 extra: Optional[Mapping[str, Any]] = None) -> None:
    """fresh (an HF model built on the meta device) given state and saved with save_pretrained, plus the extra
    files (name -> a dict for .json, else tensors for safetensors), atomically: written beside and renamed."""
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k not in _tied_keys(fresh)]
    if missing or unexpected:
        raise RuntimeError(f"export_hf: the state does not match {type(fresh).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        fresh.save_pretrained(tmp)
        for name, content in (extra or {}).items():
            if name.endswith(".json"):
                (tmp / name).write_text(json.dumps(content, indent=1) + "\n")
            else:
                from safetensors.torch import save_file
                save_file({k: v.detach().cpu() for k, v in content.items()}, str(tmp / name))
        _replace_dir(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
