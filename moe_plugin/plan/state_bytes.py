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


def held_nbytes(tensor: torch.Tensor) -> int:
    """The bytes a rank allocates for its part of a tensor: FSDP2 keeps every rank's shard padded to ceil(rows /
    ranks) rows of the sharded dim (its parameter and its gradient; AdamW's moments follow the unpadded shard)."""
    from torch.distributed.tensor import DTensor, Shard
    if isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tensor.dim() > 0 and \
            [type(p) for p in tensor.placements] == [Shard] and tensor.placements[0].dim == 0:
        rows, ranks = tensor.shape[0], tensor.device_mesh.size()
        return -(-rows // ranks) * (tensor.numel() // rows if rows else 0) * tensor.element_size()
    return nbytes(tensor)


@dataclass
class StateBytes:
    parameters: int
    gradients: int
    optimizer: int


def state_bytes(model: nn.Module) -> StateBytes:
    """Parameters (every one, tied ones once), gradients (the trainable ones) and AdamW's state (likewise)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return StateBytes(parameters=sum(held_nbytes(p) for p in params),
                      gradients=sum(held_nbytes(p) for p in trainable),
                      optimizer=sum(ADAM_MOMENTS * nbytes(p) + ADAM_STEP_BYTES for p in trainable))


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of the memory a tensor lives in (views of one tensor share it)."""
    return tensor.untyped_storage()._cdata


@contextlib.contextmanager
def saved_for_backward(model: nn.Module, total: Dict[str, int]):
    """Inside the block, total["bytes"] adds up the memory of the tensors autograd saves for backward: each storage
    once, the model's parameters' not at all (they are counted as parameters)."""
    seen = {storage_key(local_part(p)) for p in model.parameters()} | {storage_key(p) for p in model.parameters()}
    held = []          # the saved tensors, kept alive so that no storage is freed and its key reused while counting
    total.setdefault("bytes", 0)

    def pack(tensor):
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            held.append(tensor)
            total["bytes"] += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield
