"""`moe-plugin train [CONFIG.yaml] [key=value ...]`: train a small MoE transformer LM.

Legend: B batch rows per rank, S sequence length, V vocabulary.

A config has the sections model, moe, data, train, parallel and log. The defaults below are the
default experiment (configs/experiments/default.yaml spells them out; a test keeps them equal).
A run writes to log.out_dir: metrics.jsonl, summary.txt, result.json, loss.png, expert_load.png
and checkpoints/step_NNNNNN.pt. Under torchrun every rank trains on its own data shard
(DistributedDataParallel, gloo on CPU, nccl on GPU); rank 0 writes the outputs. With
parallel.ep_size > 1 the experts are spread over each block of ep_size ranks: DDP leaves them out
and parallel/expert_grads.py finishes their gradients; a checkpoint holds every expert.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import MoEConfig, field_names
from .data import VOCAB_SIZE, Data, DataConfig, make_data
from .data import check_config as check_data_config
from .layer import aux_loss
from .models import ModelConfig, TransformerLM
from .parallel.expert_grads import expert_layers, expert_parameters, hook_expert_grads
from .parallel.expert_parallel import gathered_experts
from .parallel.groups import check_sizes

MOE_KEYS_SET_ELSEWHERE = {"model_dim": "model.dim", "ep_size": "parallel.ep_size"}
DEFAULT_MOE = {"hidden_size": 256, "num_experts": 8, "top_k": 2, "capacity_factor": 1.25,
               "eval_capacity_factor": 2.0, "activation": "gelu", "aux_loss_coef": 0.01}


@dataclass
class TrainConfig:
    steps: int = 600                 # optimizer steps; the LR schedule spans them
    stop_at: Optional[int] = None    # end the run after this step as if interrupted (resume it later)
    batch_size: int = 16             # rows per rank and step
    lr: float = 3e-3                 # peak LR: linear warmup, then cosine decay to lr * min_lr_ratio
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1        # on matrices only
    grad_clip: float = 1.0           # max global gradient norm; 0: off
    seed: int = 0                    # model init and router noise
    eval_every: int = 100            # validation loss every n steps, and at step 0 and the last step
    eval_batches: int = 4
    checkpoint_every: int = 200      # 0: only at the end of the run
    keep_checkpoints: int = 2        # keep the newest n; 0: all
    resume: Optional[str] = None     # a checkpoint file, or "latest" (the newest in log.out_dir)
    device: str = "auto"             # auto (cuda when available), cpu or cuda


@dataclass
class ParallelConfig:
    ep_size: int = 1                 # expert-parallel group size


@dataclass
class LogConfig:
    name: str = "default"
    out_dir: Optional[str] = None    # null: runs/<name>
    every: int = 10                  # a metrics record every n steps
    progress: bool = True            # a progress bar on rank 0
    plots: bool = True               # loss.png and expert_load.png at the end


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: Dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MOE))  # MoEConfig fields but those above
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ---------------------------------------------------------------- config

def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The defaults, then the YAML file, then the key=value overrides; ValueError on any bad key or value."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    layers = []
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"config file {path!r} does not exist")
        layers.append(OmegaConf.load(path))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is invalid: must be key=value, e.g. train.steps=100")
    layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), *layers)
        cfg = OmegaConf.to_object(merged)
    except ConfigKeyError as error:
        raise ValueError(_unknown_key_message(error.full_key)) from None
    except OmegaConfBaseException as error:
        raise ValueError(f"{error.full_key}: {str(error).splitlines()[0]}") from None
    check_config(cfg)
    return cfg


def _valid_keys(section: Optional[str]) -> List[str]:
    if section is None:
        return [f.name for f in dataclasses.fields(ExperimentConfig)]
    if section == "moe":
        return [name for name in field_names() if name not in MOE_KEYS_SET_ELSEWHERE]
    return [f.name for f in dataclasses.fields(getattr(ExperimentConfig(), section))]


def _unknown_key_message(full_key: str) -> str:
    section, _, key = full_key.partition(".")
    where, bad, valid = ("the config", section, _valid_keys(None)) if not key else \
        (f"section {section}", key, _valid_keys(section))
    close = difflib.get_close_matches(bad, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {full_key!r}{hint}; valid keys of {where}: {', '.join(valid)}"


def moe_config(cfg: ExperimentConfig) -> MoEConfig:
    """The MoE layers' config: the moe section, with model_dim and ep_size from the model and parallel sections."""
    for key in cfg.moe:
        if key not in _valid_keys("moe"):
            message = _unknown_key_message(f"moe.{key}")
            if key in MOE_KEYS_SET_ELSEWHERE:
                message = f"moe.{key} is set by {MOE_KEYS_SET_ELSEWHERE[key]}; {message}"
            raise ValueError(message)
    try:
        return MoEConfig.from_dict({**cfg.moe, "model_dim": cfg.model.dim, "ep_size": cfg.parallel.ep_size})
    except (ValueError, TypeError) as error:
        raise ValueError(f"moe section: {error}") from None


AT_LEAST = {"model.dim": 1, "model.layers": 1, "model.heads": 1, "model.seq_len": 1, "model.ffn_hidden": 1,
            "model.moe_every": 1, "train.steps": 1, "train.batch_size": 1, "train.warmup_steps": 0,
            "train.eval_every": 1, "train.eval_batches": 1, "train.checkpoint_every": 0,
            "train.keep_checkpoints": 0, "parallel.ep_size": 1, "log.every": 1}


def check_config(cfg: ExperimentConfig) -> None:
    def value(key):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    def require(key, ok, allowed):
        if not ok:
            raise ValueError(f"{key}={value(key)!r} is invalid: must be {allowed}")

    for key, minimum in AT_LEAST.items():
        require(key, value(key) >= minimum, f">= {minimum}")
    require("model.heads", cfg.model.dim % cfg.model.heads == 0, f"a divisor of model.dim={cfg.model.dim}")
    require("train.lr", math.isfinite(cfg.train.lr) and cfg.train.lr > 0, "a positive number")
    require("train.min_lr_ratio", 0 <= cfg.train.min_lr_ratio <= 1, "between 0 and 1")
    require("train.weight_decay", cfg.train.weight_decay >= 0, ">= 0")
    require("train.grad_clip", cfg.train.grad_clip >= 0, ">= 0 (0: off)")
    require("train.stop_at", cfg.train.stop_at is None or 1 <= cfg.train.stop_at <= cfg.train.steps,
            f"null or between 1 and train.steps={cfg.train.steps}")
    require("train.device", cfg.train.device in ("auto", "cpu", "cuda"), "one of 'auto', 'cpu', 'cuda'")
    check_data_config(cfg.data)
    moe = moe_config(cfg)
    try:
        check_sizes(moe.num_experts, moe.hidden_size, moe.ep_size)
    except ValueError as error:
        raise ValueError(f"parallel.ep_size={cfg.parallel.ep_size} is invalid: {error}") from None


def to_yaml(cfg: ExperimentConfig) -> str:
    from omegaconf import OmegaConf
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# ---------------------------------------------------------------- processes

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


# ---------------------------------------------------------------- metrics

@dataclass
class Window:
    """The steps since the last metrics record, summed (over this rank).

    A layer's tokens_per_expert counts this rank's tokens for every expert (wherever the expert
    lives), so their sum over the ranks in record() is the whole load, with or without ep."""
    steps: int = 0
    loss: float = 0.0
    aux_loss: float = 0.0
    dropped_fraction: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_expert: List[List[int]] = field(default_factory=list)

    def add(self, loss: float, aux: float, stats: List[dict], tokens: int, seconds: float) -> None:
        self.steps += 1
        self.loss += loss
        self.aux_loss += aux
        self.dropped_fraction += sum(s["dropped_fraction"] for s in stats) / max(1, len(stats))
        self.tokens += tokens
        self.seconds += seconds
        loads = [s["tokens_per_expert"] for s in stats]
        self.tokens_per_expert = loads if not self.tokens_per_expert else \
            [[a + b for a, b in zip(old, new)] for old, new in zip(self.tokens_per_expert, loads)]

    def record(self, procs: Processes, step: int, lr: float) -> dict:
        """The window averaged over its steps and over the ranks (a collective: every rank calls it)."""
        loads = [n for layer in self.tokens_per_expert for n in layer]
        sums = torch.tensor([self.loss, self.aux_loss, self.dropped_fraction, self.tokens, self.seconds] + loads,
                            dtype=torch.float64, device=procs.device)
        if procs.world_size > 1:
            dist.all_reduce(sums)
        sums = sums.tolist()
        n = self.steps * procs.world_size
        seconds = sums[4] / procs.world_size
        per_layer = len(self.tokens_per_expert[0]) if self.tokens_per_expert else 0
        return {"step": step, "lr": lr, "loss": sums[0] / n, "aux_loss": sums[1] / n,
                "dropped_fraction": sums[2] / n, "tokens_per_s": sums[3] / seconds if seconds else 0.0,
                "tokens_per_expert": [[int(v) for v in sums[5 + i * per_layer:5 + (i + 1) * per_layer]]
                                      for i in range(len(self.tokens_per_expert))]}


def tensorboard_writer(log_dir: Path):
    """A torch.utils.tensorboard SummaryWriter when the tensorboard package is installed, else None."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(str(log_dir))


class MetricsLog:
    """metrics.jsonl (one JSON object per record) and TensorBoard scalars; rank 0 only."""

    def __init__(self, out_dir: Path, resumed_step: Optional[int]):
        self.path = out_dir / "metrics.jsonl"
        self.records = []
        if resumed_step is not None and self.path.exists():
            lines = self.path.read_text().splitlines()
            self.records = [r for r in map(json.loads, lines) if r["step"] <= resumed_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.file = self.path.open("a")
        self.tensorboard = tensorboard_writer(out_dir / "tensorboard")

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, float):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


# ---------------------------------------------------------------- checkpoints

def checkpoint_path(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step_{step:06d}.pt"


def checkpoints(out_dir: Path) -> List[Path]:
    return sorted((out_dir / "checkpoints").glob("step_*.pt"))


def resolve_resume(resume: str, out_dir: Path) -> Path:
    if resume == "latest":
        found = checkpoints(out_dir)
        if not found:
            raise ValueError(f"train.resume='latest' is invalid: no checkpoints in {out_dir / 'checkpoints'}")
        return found[-1]
    if not os.path.isfile(resume):
        raise ValueError(f"train.resume={resume!r} is invalid: no such file (give a checkpoint file or 'latest')")
    return Path(resume)


def expert_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """The optimizer state of this rank's experts, keyed like optimizer.state_dict()["state"], on the CPU."""
    experts = {id(p) for _, p in expert_parameters(model)}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: {key: value.cpu() for key, value in optimizer.state[p].items()}
            for i, p in enumerate(params) if id(p) in experts and p in optimizer.state}


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> dict:
    """model.state_dict() with every expert, as one process holding all experts has it (a collective)."""
    state = model.state_dict()
    for prefix, layer in expert_layers(model):
        full = gathered_experts(layer.experts, layer.groups, 0)
        for name in ("w1_EDH", "b1_EH", "w2_EHD", "b2_ED"):
            if getattr(full, name) is not None:
                state[f"{prefix}experts.{name}"] = getattr(full, name)
    return state


def load_full_state_dict(model: torch.nn.Module, state: dict) -> None:
    """Load a state dict holding every expert: each expert-parallel layer keeps its own share."""
    local = dict(state)
    for prefix, layer in expert_layers(model):
        layer.load_full_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        local.update({prefix + k: v for k, v in layer.state_dict().items()})
    model.load_state_dict(local)


def rank_state(procs: Processes, parts: Parts, window: Window) -> dict:
    state = {"data": parts.data.train.state_dict(), "torch_rng": torch.get_rng_state(),
             "python_rng": random.getstate(), "window": dataclasses.asdict(window),
             "expert_optimizer": expert_optimizer_state(parts.optimizer, parts.model)}
    if procs.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(procs.device)
    return state


def save_checkpoint(path: Path, state: dict, keep: int) -> None:
    """Atomically: write a temporary file beside it, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_path = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(handle, "wb") as file:
        torch.save(state, file)
    os.replace(tmp_path, path)
    if keep:
        for old in checkpoints(path.parent.parent)[:-keep]:
            old.unlink()


# ---------------------------------------------------------------- training

def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The LR multiplier after `step` optimizer steps: linear warmup, then cosine decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: TransformerLM, batches, device: torch.device) -> float:
    model.eval()
    losses = [F.cross_entropy(model(x_BS.to(device)).flatten(0, 1), y_BS.to(device).flatten()).item()
              for x_BS, y_BS in batches]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def topic_routing(model: TransformerLM, topics: Dict[str, torch.Tensor], device: torch.device) -> dict:
    """Per topic of the synthetic corpus: tokens per expert in each MoE layer."""
    model.eval()
    routing = {}
    for topic, x_BS in topics.items():
        model(x_BS.to(device))
        routing[topic] = [layer.stats["tokens_per_expert"] for layer in model.moe_layers()]
    model.train()
    return routing


def parameter_hash(model: torch.nn.Module, skip: Sequence[str] = ()) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if name in skip:
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(cfg: ExperimentConfig) -> dict:
    """Run one experiment. Returns its result (rank 0 also writes it to log.out_dir/result.json)."""
    check_config(cfg)
    procs = start_processes(cfg.train.device)
    try:
        ep_size = cfg.parallel.ep_size
        if procs.world_size % ep_size:
            raise ValueError(f"parallel.ep_size={ep_size} is invalid: must divide the number of processes, "
                             f"{procs.world_size} (launch with torchrun --nproc_per_node N, N a multiple of {ep_size})")
        return _train(cfg, procs)
    finally:
        if procs.started_group:
            dist.destroy_process_group()


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
    model = TransformerLM(cfg.model, moe_config(cfg), VOCAB_SIZE).to(procs.device)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg.train, step))
    data = make_data(cfg.data, cfg.train.batch_size, cfg.model.seq_len, cfg.train.eval_batches,
                     procs.rank, procs.world_size)
    torch.manual_seed(cfg.train.seed + 1_000_003 * (procs.rank + 1))  # router noise differs per rank
    return Parts(model, optimizer, scheduler, data)


def data_parallel(model: TransformerLM, procs: Processes) -> torch.nn.Module:
    """DDP over the world, but for the experts of expert-parallel layers (each rank holds its own; hooked instead)."""
    if procs.world_size == 1:
        return model
    experts = hook_expert_grads(model, procs.world_size)
    DDP = torch.nn.parallel.DistributedDataParallel
    DDP._set_params_and_buffers_to_ignore_for_model(model, [name for name, _ in experts])
    return DDP(model, device_ids=[procs.device.index] if procs.device.type == "cuda" else None)


def clip_gradients(model: TransformerLM, max_norm: float, procs: Processes, ep_size: int) -> torch.Tensor:
    """clip_grad_norm_ by the norm of the whole model's gradient; returns that norm.

    Under expert parallelism each rank holds other experts: their squares are summed over the world,
    where world_size / ep_size ranks hold each expert with the same gradient."""
    experts = {id(p): p for _, p in expert_parameters(model)}
    if not experts:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    shared = [p.grad for p in model.parameters() if id(p) not in experts and p.grad is not None]
    grads = [p.grad for p in experts.values() if p.grad is not None]  # a sliced expert's b2 lives in slice 0
    expert_square = torch.nn.utils.get_total_norm(grads).square()
    dist.all_reduce(expert_square)
    replicas = procs.world_size // ep_size
    norm = (torch.nn.utils.get_total_norm(shared).square() + expert_square / replicas).sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def save(parts: Parts, procs: Processes, cfg: ExperimentConfig, out_dir: Path, step: int, window: Window) -> None:
    """A collective: the experts are gathered, every rank hands over its data position, RNG states,
    metrics window and its experts' optimizer state; rank 0 writes."""
    model_state = full_state_dict(parts.model)
    ranks = gather(procs, rank_state(procs, parts, window))
    if procs.rank == 0:
        state = {"step": step, "world_size": procs.world_size, "model": model_state,
                 "optimizer": parts.optimizer.state_dict(), "scheduler": parts.scheduler.state_dict(),
                 "ranks": ranks, "config": dataclasses.asdict(cfg)}
        save_checkpoint(checkpoint_path(out_dir, step), state, cfg.train.keep_checkpoints)


def restore(parts: Parts, procs: Processes, path: Path, ep_size: int) -> Tuple[int, Window]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["world_size"] != procs.world_size:
        raise ValueError(f"train.resume={str(path)!r} is invalid: it was written by {state['world_size']} "
                         f"processes, this run has {procs.world_size}")
    saved_ep_size = state["config"]["parallel"]["ep_size"]
    if saved_ep_size != ep_size:
        raise ValueError(f"train.resume={str(path)!r} is invalid: it was written with parallel.ep_size="
                         f"{saved_ep_size}, this run has parallel.ep_size={ep_size}")
    mine = state["ranks"][procs.rank]
    load_full_state_dict(parts.model, state["model"])
    state["optimizer"]["state"].update(mine.get("expert_optimizer", {}))  # rank 0 saved its own experts' state
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.data.train.load_state_dict(mine["data"])
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["python_rng"])
    if "cuda_rng" in mine and procs.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda_rng"], procs.device)
    return state["step"], Window(**mine["window"])


def _train(cfg: ExperimentConfig, procs: Processes) -> dict:
    from tqdm import tqdm

    is_main = procs.rank == 0
    out_dir = Path(cfg.log.out_dir or os.path.join("runs", cfg.log.name))
    resume_path = resolve_resume(cfg.train.resume, out_dir) if cfg.train.resume else None
    parts = build(cfg, procs)
    model, optimizer, scheduler, data = parts.model, parts.optimizer, parts.scheduler, parts.data
    step, window = restore(parts, procs, resume_path, cfg.parallel.ep_size) if resume_path else (0, Window())
    if is_main and resume_path is None:
        for old in checkpoints(out_dir):  # a fresh run replaces an old run's checkpoints
            old.unlink()
    wrapped = data_parallel(model, procs)

    log = None
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
        log = MetricsLog(out_dir, step if resume_path else None)
    if step == 0:
        val_loss = evaluate(model, data.val, procs.device)
        if log:
            log.write({"step": 0, "val_loss": val_loss})

    last = cfg.train.stop_at or cfg.train.steps
    bar = tqdm(total=last, initial=step, unit="step", disable=not (is_main and cfg.log.progress),
               dynamic_ncols=True, file=sys.stderr)
    start = time.perf_counter()
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    while step < last:
        step += 1
        tick = time.perf_counter()
        x_BS, y_BS = (t.to(procs.device) for t in data.train.next())
        logits_BSV = wrapped(x_BS)
        lm_loss = F.cross_entropy(logits_BSV.flatten(0, 1), y_BS.flatten())
        router_loss = aux_loss(model)
        optimizer.zero_grad(set_to_none=True)
        (lm_loss + router_loss).backward()
        if cfg.train.grad_clip:
            clip_gradients(model, cfg.train.grad_clip, procs, cfg.parallel.ep_size)
        optimizer.step()
        scheduler.step()
        window.add(lm_loss.item(), router_loss.item(), [layer.stats for layer in model.moe_layers()],
                   tokens_per_step, time.perf_counter() - tick)

        is_eval = step % cfg.train.eval_every == 0 or step == last
        if step % cfg.log.every == 0 or is_eval:
            record = window.record(procs, step, optimizer.param_groups[0]["lr"])
            window = Window()
            if is_eval:
                record["val_loss"] = evaluate(model, data.val, procs.device)
            if log:
                log.write(record)
            bar.set_postfix_str(f"loss {record['loss']:.3f} tok/s {record['tokens_per_s']:.0f} "
                                f"drop {record['dropped_fraction']:.1%}", refresh=False)
        bar.update(1)
        if step == last or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
            save(parts, procs, cfg, out_dir, step, window)
    bar.close()

    experts = [name for name, _ in expert_parameters(model)]
    hashes = gather(procs, (parameter_hash(model), parameter_hash(model, skip=experts)))
    routing = topic_routing(model, data.topics, procs.device)  # every rank runs the same topic rows
    if not is_main:
        return {}
    log.close()
    result = _result(cfg, procs, log.records, hashes, time.perf_counter() - start, out_dir)
    result["topic_routing"] = routing
    (out_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    from . import plots
    if cfg.log.plots:
        plots.save_plots(log.records, out_dir, routing)
    summary = plots.summary(cfg.log.name, result, log.records, routing)
    (out_dir / "summary.txt").write_text(summary)
    print(summary, end="")
    return result


def _result(cfg: ExperimentConfig, procs: Processes, records: List[dict], hashes: List[Tuple[str, str]],
            seconds: float, out_dir: Path) -> dict:
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    train_records = [r for r in records if "loss" in r]
    return {"name": cfg.log.name, "out_dir": str(out_dir), "plots": cfg.log.plots, "world_size": procs.world_size,
            "steps": records[-1]["step"], "seconds": seconds,
            "tokens": records[-1]["step"] * cfg.train.batch_size * cfg.model.seq_len * procs.world_size,
            "val_loss_first": val[0][1], "val_loss_last": val[-1][1],
            "loss_first": train_records[0]["loss"] if train_records else None,
            "loss_last": train_records[-1]["loss"] if train_records else None,
            "param_sha256_per_rank": [full for full, _ in hashes],
            "shared_param_sha256_per_rank": [shared for _, shared in hashes]}


# ---------------------------------------------------------------- command line

def split_arguments(arguments: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """[CONFIG.yaml] and key=value overrides, in any order."""
    paths = [a for a in arguments if "=" not in a]
    if len(paths) > 1:
        raise ValueError(f"expected one config file and key=value overrides, got files {paths}")
    return (paths[0] if paths else None), [a for a in arguments if "=" in a]


def add_arguments(parser) -> None:
    parser.add_argument("arguments", nargs="*", metavar="CONFIG.yaml | key=value",
                        help="an experiment config (default: the built-in configs/experiments/default.yaml) "
                             "and overrides such as moe.num_experts=16 train.steps=200")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")


def main(args) -> int:
    try:
        cfg = load_config(*split_arguments(args.arguments))
    except ValueError as error:
        print(f"moe-plugin train: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    try:
        train(cfg)
    except ValueError as error:  # a user error found once the processes are known (ep_size, resume)
        print(f"moe-plugin train: {error}", file=sys.stderr)
        return 2
    return 0
