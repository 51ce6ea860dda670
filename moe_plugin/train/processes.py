"""The processes of a run: one, or the ranks of a torchrun launch."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist


@dataclass
class Processes:
    rank: int
    world_size: int
    device: torch.device
    started_group: bool


def start_processes(device_choice: str) -> Processes:
    """One process (world size 1), or one rank of a torchrun launch (WORLD_SIZE etc. in the environment)."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' is invalid: no CUDA device is available")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    started = world_size > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    return Processes(rank, world_size, device, started)


def gather(procs: Processes, obj: Any) -> List[Any]:
    if procs.world_size == 1:
        return [obj]
    objects = [None] * procs.world_size
    dist.all_gather_object(objects, obj)
    return objects
