"""Checkpoints: checkpoints/step_NNNNNN.pt in the run's folder, written atomically by rank 0."""
from __future__ import annotations

import dataclasses
import os
import random
import tempfile
from pathlib import Path
from typing import List, Tuple

import torch

from ..parallel.expert_grads import expert_layers, expert_parameters
from ..parallel.expert_parallel import gathered_experts
from .config import ExperimentConfig
from .metrics import Window
from .parts import Parts
from .processes import Processes, gather


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
