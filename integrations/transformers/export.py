"""export_hf: a swapped or upcycled model back to a folder that plain transformers loads (HF names and layouts).
It picks the writer: upcycle_export for an upcycled dense model, else the swapped blocks' HF tensors (writer.py)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch
import torch.distributed as dist
from torch import nn

from .upcycle_export import export_upcycled, is_upcycled
from .writer import hf_state_dict, write_folder


def export_hf(model: nn.Module, directory: Union[str, os.PathLike]) -> Path:
    """Write model (swapped or not) as an HF checkpoint: config and weights, every expert, HF layouts.

    `AutoModelForCausalLM.from_pretrained(directory)` loads it with plain transformers. Under expert
    parallelism every rank must call it; global rank 0 writes. The folder is written atomically.
    An upcycled dense model (upcycle.py) is written by upcycle_export.export_upcycled.
    """
    if is_upcycled(model):
        return export_upcycled(model, directory)
    state = hf_state_dict(model)
    directory = Path(directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with torch.device("meta"):
            fresh = type(model)(model.config)          # the original HF class: only the blocks were swapped
        write_folder(fresh, state, directory)
    if dist.is_initialized():
        dist.barrier()
    return directory
