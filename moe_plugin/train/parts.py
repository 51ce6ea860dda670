"""What a run is made of: the model, its optimizer, the LR schedule and the data; and the DDP wrapping."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

import torch

from ..data import VOCAB_SIZE, Data, make_data
from ..models import TransformerLM
from ..parallel.expert_grads import hook_expert_grads
from ..parallel.fsdp import fully_shard_moe
from .config import ExperimentConfig, TrainConfig, moe_config
from .processes import Processes


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The LR multiplier after `step` optimizer steps: linear warmup, then cosine decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Parts:
    """What a checkpoint restores."""
    model: TransformerLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: Data


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Weight decay on the weight matrices only: not on norms, biases, nor the experts' stacked
    biases ([E, H], [E, D]: 2-D, but biases)."""
    def is_matrix(name: str, param: torch.nn.Parameter) -> bool:
        return param.dim() >= 2 and not name.endswith(("b1_EH", "b2_ED"))
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if is_matrix(n, p)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if not is_matrix(n, p)], "weight_decay": 0.0}]


def build(cfg: ExperimentConfig, procs: Processes) -> Parts:
    torch.manual_seed(cfg.train.seed)
    if cfg.hf is not None:
        from .hf_model import build_hf_model   # imports transformers
        model = build_hf_model(cfg).to(procs.device)
    else:
        model = TransformerLM(cfg.model, moe_config(cfg), VOCAB_SIZE).to(procs.device)
    if cfg.parallel.fsdp:   # sharded before the optimizer is built: it holds the shards
        fully_shard_moe(model)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg.train, step))
    data = make_data(cfg.data, cfg.train.batch_size, cfg.model.seq_len, cfg.train.eval_batches,
                     procs.rank, procs.world_size)
    torch.manual_seed(cfg.train.seed + 1_000_003 * (procs.rank + 1))  # router noise differs per rank
    return Parts(model, optimizer, scheduler, data)


def data_parallel(model: TransformerLM, procs: Processes) -> torch.nn.Module:
    """DDP over the world, but for the experts of expert-parallel layers (each rank holds its own; hooked instead).
    A model sharded by FSDP2 (build() with parallel.fsdp) is returned as it is."""
    from torch.distributed.fsdp import FSDPModule
    if procs.world_size == 1 or isinstance(model, FSDPModule):
        return model
    experts = hook_expert_grads(model, procs.world_size)
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(model, [name for name, _ in experts])
    return DDP(model, device_ids=[procs.device.index] if procs.device.type == "cuda" else None)
