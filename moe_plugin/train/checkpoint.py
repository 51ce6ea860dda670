"""Checkpoints of a run: folders checkpoints/step_NNNNNN, sharded with torch.distributed.checkpoint.

Every process writes its own experts and its own data position, RNG states and metrics window;
the replicated tensors (everything but the experts) are written once. See moe_plugin/checkpoint.py
for how the experts are described; a checkpoint holds, under these keys:

    model.<name>                     the model, as one process holding every expert has it
    optimizer.<name>.<key>           AdamW's step, exp_avg and exp_avg_sq of each parameter
    optimizer_param_groups           the optimizer's hyperparameters (lr, betas, ...)
    scheduler                        the LR schedule's state_dict()
    rank.<r>                         process r's data position, RNG states and metrics window
    meta                             the step, the layout that wrote it and the config (also meta.json)

The folder is written as step_NNNNNN.tmp and renamed once every process has finished, so a
checkpoint that has its final name is whole, and a save that fails leaves the last good one alone.
Its last file, manifest.json (manifest.py), holds every file's size and the CRC-32s that, with the
ones torch.save writes into every tensor record, cover every byte; verify() checks them, so a
truncated, missing or altered file is found before anything is loaded. resume "auto" (and "latest")
takes the newest checkpoint that verifies.

Resuming on another layout (another number of processes and/or ep_size) restores the model and the
optimizer exactly: DCP reads each process's share of every expert from whichever files hold it.
The data rule: rank r of P processes reads its own stream, fixed by data.seed, r and P (a text file
is cut into P shards), never by ep_size. Resumed at step N, every rank continues its stream at
batch N + 1, the batch a fresh run with the same P would read at step N + 1. With the P that wrote
the checkpoint the saved stream states (and the metrics window) are restored as they were, so the
run continues bit-exactly; with another P each stream is rebuilt and advanced by N batches, and the
metrics window starts empty. A rank that did not exist in the saved run takes fresh RNG states
seeded from train.seed, its rank and N; the others keep their saved ones.
"""
from __future__ import annotations

import dataclasses
import io
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import checkpoint as sharded
from ..lora import whole_lora
from ..parallel.expert_grads import expert_layers
from ..parallel.expert_parallel import whole_experts
from . import manifest
from .config import ExperimentConfig
from .manifest import verify
from .metrics import Window
from .processes import Processes


FORMAT = "moe_plugin sharded checkpoint v1"


def checkpoint_path(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step_{step:06d}"


def checkpoints(out_dir: Path) -> List[Path]:
    """The finished checkpoints of a run, oldest first."""
    return sorted(p for p in (out_dir / "checkpoints").glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def remove_checkpoints(out_dir: Path) -> None:
    """Every checkpoint of a run, and the remains of unfinished saves."""
    for path in (out_dir / "checkpoints").glob("step_*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def out_dir_of(cfg: ExperimentConfig) -> Path:
    return Path(cfg.log.out_dir or Path("runs") / cfg.log.name)


def _out_dir_setting(cfg: ExperimentConfig) -> str:
    return f"log.out_dir={cfg.log.out_dir!r}" if cfg.log.out_dir else \
        f"log.out_dir=null ({out_dir_of(cfg)}, from log.name={cfg.log.name!r})"


def held_run(out_dir: Path) -> List[str]:
    """What out_dir holds of a run: its checkpoint folders (finished or not) and metrics.jsonl, by name."""
    held = sorted(p.name for p in (out_dir / "checkpoints").glob("step_*"))
    return held + (["metrics.jsonl"] if (out_dir / "metrics.jsonl").exists() else [])


def check_out_dir(cfg: ExperimentConfig) -> None:
    """ValueError when a fresh run (train.resume null) would replace the run in log.out_dir (its checkpoints,
    metrics.jsonl), unless log.overwrite=true says to. Reads the folder only: what `moe-plugin train` checks
    before any process starts; rank 0 checks again before anything is written. A run with train.resume set
    continues (check_fresh_start: when auto finds nothing to resume)."""
    out_dir = out_dir_of(cfg)
    if cfg.log.overwrite or cfg.train.resume is not None:
        return
    held = held_run(out_dir)
    if held:
        names = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(f"{_out_dir_setting(cfg)} holds another run ({names}): add train.resume=auto to continue "
                         f"it, log.overwrite=true to replace it (its checkpoints are deleted), or give another "
                         f"log.out_dir")


def check_fresh_start(cfg: ExperimentConfig) -> None:
    """ValueError when train.resume=auto found no whole checkpoint, and starting fresh would delete finished
    checkpoint folders that fail their check (damaged, or written without a manifest), unless log.overwrite=true.
    The remains of unfinished saves (.tmp, .old) and metrics.jsonl are a fresh start's to replace."""
    out_dir = out_dir_of(cfg)
    finished = [path.name for path in checkpoints(out_dir)]
    if finished and not cfg.log.overwrite:
        raise ValueError(f"train.resume={cfg.train.resume!r} found no whole checkpoint in {out_dir / 'checkpoints'}, "
                         f"and starting fresh there would delete {', '.join(finished)}: add log.overwrite=true to "
                         f"start fresh anyway, resume one by name (train.resume=FOLDER), or give another "
                         f"log.out_dir")


def remove_run(out_dir: Path) -> None:
    """What a fresh run replaces: every checkpoint of the run in out_dir and the remains of unfinished saves, and
    its metrics.jsonl."""
    remove_checkpoints(out_dir)
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)


def step_of(path: Path) -> int:
    return int(path.name[5:].split(".")[0])


def resolve_resume(resume: str, out_dir: Path, log: Callable[[str], None] = lambda _: None) -> Optional[Path]:
    """The checkpoint to resume from: "auto" (the newest whole one in out_dir, or None: start fresh), "latest"
    (the same, but none is an error) or a folder (which must verify). Every checkpoint passed over is logged."""
    if resume in ("auto", "latest"):
        leftovers = (out_dir / "checkpoints").glob("step_*")
        candidates = sorted((p for p in leftovers if p.is_dir() and p.name[5:].split(".")[0].isdigit()),
                            key=lambda p: (step_of(p), p.name), reverse=True)
        for path in candidates:
            problem = verify(path)
            if problem is None:
                log(f"train.resume={resume}: resuming from {path}")
                return path
            log(f"train.resume={resume}: skipping {path.name}: {problem}")
        if resume == "latest":
            raise ValueError(f"train.resume='latest' is invalid: no {'whole ' if candidates else ''}checkpoints in "
                             f"{out_dir / 'checkpoints'} (train.resume=auto starts fresh then)")
        log(f"train.resume=auto: no whole checkpoint in {out_dir / 'checkpoints'}, starting fresh")
        return None
    path = Path(resume)
    if path.is_file():
        raise ValueError(f"train.resume={resume!r} is invalid: it is a file, and a checkpoint is a folder "
                         f"(checkpoints/step_NNNNNN); a full state-dict file from `moe-plugin checkpoint convert` "
                         f"becomes one with `moe-plugin checkpoint convert FILE FOLDER`")
    if not path.is_dir():
        raise ValueError(f"train.resume={resume!r} is invalid: no such file (give a checkpoint folder, 'auto' "
                         f"or 'latest')")
    if not any((path / name).exists() for name in (manifest.NAME, "meta.json", ".metadata")):
        raise ValueError(f"train.resume={resume!r} is invalid: {str(path)!r} is not a checkpoint of `moe-plugin "
                         f"train`: it has no meta.json")
    problem = verify(path)
    if problem is not None:
        raise ValueError(f"train.resume={resume!r} is invalid: the checkpoint is damaged: {problem}")
    return path


def read_meta(path: Path) -> dict:
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{str(path)!r} is not a checkpoint of `moe-plugin train`: it has no meta.json")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} has format {meta.get('format')!r}; this version reads {FORMAT!r}")
    return meta


@torch.no_grad()
def full_state_dict(model: torch.nn.Module) -> dict:
    """model.state_dict() with every expert, as one process holding all experts has it (a collective).
    FSDP2 shards are gathered first (an expert's over the ranks holding it, then over its ep group)."""
    layers = list(expert_layers(model))
    gathered = {f"{prefix}experts.{name}" for prefix, _ in layers for name in sharded.EXPERT_NAMES}
    state = {k: whole(v) for k, v in model.state_dict().items() if k not in gathered}   # experts: below, once
    for prefix, layer in layers:
        state.update({f"{prefix}experts.{name}": tensor for name, tensor in whole_experts(layer).items()})
        state.update({f"{prefix}experts.{name}": tensor for name, tensor in whole_lora(layer).items()})
    return state


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP2 shard) gathered into the tensor it shards (a collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def load_full_state_dict(model: torch.nn.Module, state: dict) -> None:
    """Load a state dict holding every expert (full_state_dict's, or one process's model.state_dict()): each
    expert-parallel layer keeps its own share. A model sharded by FSDP2 (fully_shard_moe) loads through torch's
    set_model_state_dict(full_state_dict=True), which hands each rank its shard (parallel/fsdp_state_dict.py)."""
    from torch.distributed.tensor import DTensor
    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        extra = {k: v for k, v in model.state_dict().items() if k.endswith("._extra_state") and k not in state}
        set_model_state_dict(model, {**state, **extra}, options=StateDictOptions(full_state_dict=True))
        return
    local = dict(state)
    for prefix, layer in expert_layers(model):
        layer.load_full_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        local.update({prefix + k: v for k, v in layer.state_dict().items()})
    model.load_state_dict(local)


def pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def rank_state(procs: Processes, parts: Any, window: Window) -> dict:
    """What this process alone holds of a run (parts: the run's train.parts.Parts): data position, RNGs, window."""
    state = {"data": parts.data.train.state_dict(), "torch_rng": torch.get_rng_state(),
             "python_rng": random.getstate(), "window": window.state()}
    if procs.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(procs.device)
    return state


def _barrier(procs: Processes) -> None:
    if procs.world_size > 1:
        dist.barrier()


def save(parts: Any, procs: Processes, cfg: ExperimentConfig, out_dir: Path, step: int,
         window: Window, segments: Optional[List[dict]] = None) -> Dict[str, float]:
    """A collective: each process writes its share into step_NNNNNN.tmp; rank 0 writes manifest.json, renames
    the folder into place, then removes checkpoints beyond train.keep_checkpoints. segments: what each segment of
    the run up to this step did (see segments_of), kept in the meta.
    Returns {"seconds": the whole save, "checksum_seconds": writing the manifest (0 but on rank 0)}."""
    start = time.perf_counter()
    final = checkpoint_path(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if procs.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(procs)
    meta = {"format": FORMAT, "step": step, "world_size": procs.world_size, "ep_size": cfg.parallel.ep_size,
            "config": dataclasses.asdict(cfg), "segments": segments or []}
    state = sharded.sharded_state(parts.model, parts.optimizer, writing=True)
    state.update({"meta": json.dumps(meta), "scheduler": pack(parts.scheduler.state_dict()),
                  "optimizer_param_groups": pack([{k: v for k, v in group.items() if k != "params"}
                                                  for group in parts.optimizer.param_groups]),
                  f"rank.{procs.rank}": pack(rank_state(procs, parts, window))})
    sharded.save(state, tmp)
    summed = 0.0
    if procs.rank == 0:   # every process has written its shards (dcp.save ends with a collective)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        summed = time.perf_counter()
        manifest.write(tmp)
        summed = time.perf_counter() - summed
        sharded.replace_folder(tmp, final)
        if cfg.train.keep_checkpoints:
            done = [path for path in checkpoints(out_dir) if step_of(path) <= step]   # not a newer damaged one
            for old in done[:-cfg.train.keep_checkpoints]:
                shutil.rmtree(old)
    _barrier(procs)
    return {"seconds": time.perf_counter() - start, "checksum_seconds": summed}


def segments_of(path: Path) -> List[dict]:
    """The segments of the run that led to a checkpoint (each start or resume up to the save that the next one
    resumed from), oldest first: {"steps", "processes", "items" (tokens or images), "seconds"}. A checkpoint
    written without them (before they were kept, or by save() called without) gives one segment of its step and
    layout, its time unknown (None)."""
    meta = read_meta(path)
    if meta.get("segments") or not meta["step"]:
        return meta.get("segments", [])
    steps, processes = meta["step"], meta["world_size"]
    cfg = meta["config"]
    per_step = cfg["train"]["batch_size"] * (1 if cfg["data"]["task"] == "image" else cfg["model"]["seq_len"])
    return [{"steps": steps, "processes": processes, "items": steps * per_step * processes, "seconds": None}]


def restore(parts: Any, procs: Processes, cfg: ExperimentConfig, path: Path) -> Tuple[int, Window]:
    """Load a checkpoint written by any number of processes and ep_size (a collective); returns (step, window)."""
    try:
        meta = read_meta(path)
    except ValueError as error:
        raise ValueError(f"train.resume={str(path)!r} is invalid: {error}") from None
    step, saved_world = meta["step"], meta["world_size"]
    mine = f"rank.{procs.rank}" if procs.rank < saved_world else None
    state = sharded.sharded_state(parts.model, parts.optimizer, writing=False)
    state.update({"scheduler": b"", "optimizer_param_groups": b""}, **({mine: b""} if mine else {}))
    try:
        sharded.load(state, path)
    except ValueError as error:
        raise ValueError(f"train.resume={str(path)!r} is invalid: {error}") from None
    for group, saved in zip(parts.optimizer.param_groups, unpack(state["optimizer_param_groups"])):
        group.update(saved)
    parts.scheduler.load_state_dict(unpack(state["scheduler"]))

    ranks = unpack(state[mine]) if mine else None
    if saved_world == procs.world_size:
        parts.data.train.load_state_dict(ranks["data"])
        window = Window(**ranks["window"])
    else:
        for _ in range(step):
            parts.data.train.next()
        window = Window()
    if ranks is not None:
        torch.set_rng_state(ranks["torch_rng"])
        random.setstate(ranks["python_rng"])
        if "cuda_rng" in ranks and procs.device.type == "cuda":
            torch.cuda.set_rng_state(ranks["cuda_rng"], procs.device)
    else:
        torch.manual_seed(cfg.train.seed + 1_000_003 * (procs.rank + 1) + 7919 * step)
        random.seed(f"{cfg.train.seed}/{procs.rank}/{step}")
    return step, window
