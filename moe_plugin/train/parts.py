"""What a run is made of: the model, its optimizer, the LR schedule and the data; and the DDP wrapping."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List

import torch
from torch import nn

from .data import VOCAB_SIZE, Data, make_data
from .models import TransformerLM
from ..experts import BIAS_NAMES
from ..parallel.ddp import ddp_moe
from ..parallel.fsdp import fully_shard_moe
from .config import ExperimentConfig, TrainConfig, moe_config
from .hf_image import build_image_model
from .hf_model import build_hf_model
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
    """Weight decay on the weight matrices only: not on norms, biases, the experts' stacked
    biases ([E, H], [E, D]: 2-D, but biases), nor Swinv2's attention temperatures (logit_scale, [heads, 1, 1])."""
    def is_matrix(name: str, param: torch.nn.Parameter) -> bool:
        return param.dim() >= 2 and not name.endswith(BIAS_NAMES + ("logit_scale",))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]   # frozen (lora): no optimizer state
    return [{"params": [p for n, p in named if is_matrix(n, p)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if not is_matrix(n, p)], "weight_decay": 0.0}]


def materialize_from_meta(make: Callable[[], TransformerLM], device: torch.device) -> TransformerLM:
    """make() on the meta device, then to_empty on device and every module's reset_parameters() in the order
    TransformerLM's construction draws them, from the RNG state make() started with: make()'s weights."""
    rng = torch.get_rng_state()
    with torch.device("meta"):
        model = make()
    model.to_empty(device=device)
    torch.set_rng_state(rng)
    for module in _construction_order(model):
        if hasattr(module, "reset_parameters") and any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
    for module in model.modules():   # TransformerLM's own initialization (models/transformer.py), again
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


def _construction_order(model: TransformerLM) -> List[nn.Module]:
    """A block's FFN is built before the block (it is an argument of Block)."""
    order = [model.token_embedding, model.position_embedding]
    for block in model.blocks:
        order += [*block.ffn.modules(), block.attn_norm, *block.attn.modules(), block.ffn_norm]
    order += [model.norm] + ([model.head] if model.head is not None else [])
    owners = {m for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    assert owners <= set(order), "a TransformerLM module with parameters is missing from the order"
    return order


def build_model(cfg: ExperimentConfig) -> nn.Module:
    """The run's model, unsharded, on the default device (moe-plugin plan builds it under torch.device("meta"))."""
    if cfg.data.task == "image":
        return build_image_model(cfg)
    if cfg.hf is not None:
        return build_hf_model(cfg)
    return TransformerLM(cfg.model, moe_config(cfg), VOCAB_SIZE)


def build(cfg: ExperimentConfig, procs: Processes) -> Parts:
    torch.manual_seed(cfg.train.seed)
    if cfg.parallel.fsdp and cfg.hf is None and cfg.data.task != "image":
        model = materialize_from_meta(lambda: build_model(cfg), procs.device)
    else:
        model = build_model(cfg).to(procs.device)
    if cfg.parallel.fsdp:   # sharded before the optimizer is built: it holds the shards
        fully_shard_moe(model)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg.train, step))
    data = make_data(cfg.data, cfg.train.batch_size, cfg.model.seq_len, cfg.train.eval_batches,   # seq_len: lm
                     procs.rank, procs.world_size)
    torch.manual_seed(cfg.train.seed + 1_000_003 * (procs.rank + 1))  # router noise differs per rank
    return Parts(model, optimizer, scheduler, data)


def data_parallel(model: TransformerLM, procs: Processes) -> torch.nn.Module:
    """DDP over the world, but for the experts of expert-parallel layers (each rank holds its own; hooked instead).
    The gradients are views into DDP's buckets (gradient_as_bucket_view): no second copy of the dense gradients,
    as moe-plugin plan counts them. A model sharded by FSDP2 (build() with parallel.fsdp) is returned as it is."""
    from torch.distributed.fsdp import FSDPModule
    if procs.world_size == 1 or isinstance(model, FSDPModule):
        return model
    return ddp_moe(model, device_ids=[procs.device.index] if procs.device.type == "cuda" else None,
                   gradient_as_bucket_view=True)
