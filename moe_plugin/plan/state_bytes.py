"""What a rank holds: its parameters, their gradients and AdamW's state, counted from a built model's own tensors
(FSDP2's shards as the rank's local part); and the bytes a forward saves for backward."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict

import torch
from torch import nn

# AdamW keeps exp_avg and exp_avg_sq shaped like the parameter and a float32 scalar step per parameter tensor
ADAM_MOMENTS = 2
ADAM_STEP_BYTES = 4


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP2 DTensor's local shard; a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensor: torch.Tensor) -> int:
    tensor = local_part(tensor)
    return tensor.numel() * tensor.element_size()


@dataclass
class StateBytes:
    parameters: int
    gradients: int
    optimizer: int


def state_bytes(model: nn.Module) -> StateBytes:
    """Parameters (every one, tied ones once), gradients (the trainable ones) and AdamW's state (likewise)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return StateBytes(parameters=sum(nbytes(p) for p in params),
                      gradients=sum(nbytes(p) for p in trainable),
                      optimizer=sum(ADAM_MOMENTS * nbytes(p) + ADAM_STEP_BYTES for p in trainable))


@contextlib.contextmanager
def saved_for_backward(model: nn.Module, total: Dict[str, int]):
    """Inside the block, total["bytes"] adds up the tensors autograd saves for backward: each base tensor once
    (views of one tensor count once), the model's parameters not at all (they are counted as parameters)."""
    parameters = {id(local_part(p)) for p in model.parameters()} | {id(p) for p in model.parameters()}
    seen = {}          # id -> tensor, held so that an id is not reused while counting
    total.setdefault("bytes", 0)

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in parameters and id(base) not in seen:
            seen[id(base)] = base
            total["bytes"] += base.numel() * base.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield
