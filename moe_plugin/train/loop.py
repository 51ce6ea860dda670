"""The training loop: train(cfg) runs one experiment and writes its outputs."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..layer import aux_loss
from ..parallel.expert_grads import expert_parameters
from ..routing_monitor.alarm import RoutingAlarm
from ..routing_monitor.metrics import RoutingMonitor, scalars
from ..router import update_expert_bias
from . import plots
from .checkpoint import (check_fresh_start, check_out_dir, checkpoint_path, out_dir_of, remove_run,
                         resolve_resume, restore, save, segments_of)
from .checks import check_config, check_world
from .config import ExperimentConfig, to_yaml
from .faults import NonFiniteStep, Preempted, Signals, any_signal, step_verdict
from .hf_image import export_image_model
from .hf_model import export_hf_model
from .metrics import MetricsLog, Window
from .models import TransformerLM
from .parts import build, data_parallel
from .processes import Processes, gather, start_processes


@torch.no_grad()
def evaluate(model: TransformerLM, batches, device: torch.device) -> float:
    model.eval()
    losses = [F.cross_entropy(model(x_BS.to(device)).flatten(0, 1), y_BS.to(device).flatten()).item()
              for x_BS, y_BS in batches]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate_images(model: torch.nn.Module, batches, device: torch.device) -> Tuple[float, float]:
    """(mean loss, accuracy) over every image of the batches (the last batch may be smaller)."""
    model.eval()
    loss = correct = count = 0
    for x_BCHW, y_B in batches:
        logits_BL, y_B = model(x_BCHW.to(device)), y_B.to(device)
        loss += F.cross_entropy(logits_BL, y_B, reduction="sum").item()
        correct += int((logits_BL.argmax(-1) == y_B).sum())
        count += len(y_B)
    model.train()
    return loss / count, correct / count


def validation(model: torch.nn.Module, batches, device: torch.device, task: str) -> dict:
    if task == "image":
        loss, accuracy = evaluate_images(model, batches, device)
        return {"val_loss": loss, "val_accuracy": accuracy}
    return {"val_loss": evaluate(model, batches, device)}


@torch.no_grad()
def topic_routing(model: TransformerLM, topics: Dict[str, torch.Tensor], device: torch.device) -> dict:
    """Per topic of the synthetic corpus (per class of an image data set): tokens per expert in each MoE layer."""
    model.eval()
    routing = {}
    for topic, x_BS in topics.items():
        model(x_BS.to(device))
        routing[topic] = [layer.stats["tokens_per_expert"] for layer in model.moe_layers()]
    model.train()
    return routing


def _is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def parameter_hash(model: torch.nn.Module, skip: Sequence[str] = ()) -> str:
    """Of this rank's whole tensors (FSDP2 shards gathered first: a collective then)."""
    from torch.distributed.tensor import DTensor
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
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
        if cfg.parallel.fsdp and procs.world_size == 1:
            raise ValueError("parallel.fsdp=true is invalid with 1 process: FSDP2 shards over torchrun processes "
                             "(launch with torchrun --nproc_per_node N, N >= 2), or set parallel.fsdp=false")
        check_world(cfg, procs.world_size, "launch with torchrun --nproc_per_node N")
        result = _train(cfg, procs)
        if procs.started_group:     # every rank done before any tears its connections down (not after an error:
            dist.barrier()          # the others may never get here)
        return result
    finally:
        if procs.started_group:
            dist.destroy_process_group()


def gradient_norm(model: TransformerLM, procs: Processes, ep_size: int) -> torch.Tensor:
    """The norm of the whole model's gradient (the same on every rank).

    Under expert parallelism each rank holds other experts: their squares are summed over the world,
    where world_size / ep_size ranks hold each expert with the same gradient. Under FSDP2 every
    gradient element lives on one rank: the squares of the local shards are summed over the world."""
    if _is_sharded(model):
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        square = torch.nn.utils.get_total_norm(grads).square()
        dist.all_reduce(square)
        return square.sqrt()
    experts = {id(p): p for _, p in expert_parameters(model)}
    if not experts:
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    shared = [p.grad for p in model.parameters() if id(p) not in experts and p.grad is not None]
    grads = [p.grad for p in experts.values() if p.grad is not None]  # a sliced expert's b2 lives in slice 0
    expert_square = torch.nn.utils.get_total_norm(grads).square()
    dist.all_reduce(expert_square)
    replicas = procs.world_size // ep_size
    return (torch.nn.utils.get_total_norm(shared).square() + expert_square / replicas).sqrt()


def clip_gradients(model: TransformerLM, max_norm: float, procs: Processes, ep_size: int,
                   norm: torch.Tensor = None) -> torch.Tensor:
    """Scale the gradients down to the global norm max_norm (clip_grad_norm_ over every rank's share);
    returns the norm (gradient_norm() unless given)."""
    norm = gradient_norm(model, procs, ep_size) if norm is None else norm
    if _is_sharded(model):
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))   # as clip_grads_with_norm_
    else:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def _resume_path(cfg: ExperimentConfig, out_dir: Path, procs: Processes, say) -> Optional[Path]:
    """train.resume resolved by rank 0 (it reads every file of the checkpoint it picks) and sent to all, after
    rank 0 has checked that the run replaces nothing in out_dir unasked (log.overwrite), and removed what it
    replaces."""
    answer = [None]
    if procs.rank == 0:
        try:
            check_out_dir(cfg)
            path = resolve_resume(cfg.train.resume, out_dir, say) if cfg.train.resume else None
            if path is None and cfg.train.resume == "auto":
                check_fresh_start(cfg)
            if path is None:
                remove_run(out_dir)   # a fresh run replaces what out_dir holds (checked above: asked for, or leftovers)
            answer = [("ok", path)]
        except ValueError as error:
            answer = [("error", str(error))]
    if procs.world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise ValueError(value)
    return value


def _train(cfg: ExperimentConfig, procs: Processes) -> dict:
    from tqdm import tqdm

    is_main = procs.rank == 0
    out_dir = out_dir_of(cfg)

    def say(message: str) -> None:
        if is_main:
            print(f"moe-plugin train: {message}", file=sys.stderr, flush=True)

    resume_path = _resume_path(cfg, out_dir, procs, say)
    parts = build(cfg, procs)
    model, optimizer, data = parts.model, parts.optimizer, parts.data
    step, window = restore(parts, procs, cfg, resume_path) if resume_path else (0, Window())
    earlier = segments_of(resume_path) if resume_path else []   # what the run did before this segment
    first_step = step
    wrapped = data_parallel(model, procs)
    if cfg.train.compile:    # reduce-overhead: CUDA graphs (the MoE layers read nothing back; README)
        wrapped = torch.compile(wrapped, mode=cfg.train.compile)
    monitor = RoutingMonitor(model)      # each MoE layer's routing per record (rank 0 writes it; every rank reads)
    alarm = RoutingAlarm(cfg.log.alarm_min_share, cfg.log.alarm_max_dropped, cfg.log.alarm_windows,
                         cfg.log.alarm_max_rank_load) if cfg.log.routing_alarm else None

    log = None
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
        log = MetricsLog(out_dir, step if resume_path else None)
    task = cfg.data.task
    if step == 0:
        val = validation(model, data.val, procs.device, task)
        if log:
            log.write({"step": 0, **val})

    last = cfg.train.stop_at or cfg.train.steps
    bar = tqdm(total=last, initial=step, unit="step", disable=not (is_main and cfg.log.progress),
               dynamic_ncols=True, file=sys.stderr)
    start = time.perf_counter()
    unit, items_per_step = ("images", cfg.train.batch_size) if task == "image" else \
        ("tokens", cfg.train.batch_size * cfg.model.seq_len)
    saves = []

    def segments_to(step: int) -> List[dict]:
        """The run's segments up to `step`: the earlier ones and this one so far (zero-step segments left out)."""
        done = step - first_step
        this = [{"steps": done, "processes": procs.world_size, "items": done * items_per_step * procs.world_size,
                 "seconds": time.perf_counter() - start}] if done or not earlier else []
        return earlier + this

    with Signals() as signals:
        while step < last:
            step += 1
            window, stop = _step(cfg, procs, parts, wrapped, window, step, signals, items_per_step)
            is_eval = step % cfg.train.eval_every == 0 or step == last
            if step % cfg.log.every == 0 or is_eval:
                record = window.record(procs, step, optimizer.param_groups[0]["lr"], unit)
                window = Window(skipped_in_a_row=window.skipped_in_a_row)
                routing = monitor.read()
                record.update(scalars(routing))
                for message in alarm.check(routing) if alarm is not None else []:
                    say(message)
                if is_eval:
                    record.update(validation(model, data.val, procs.device, task))
                if log:
                    log.write(record)
                bar.set_postfix_str(_progress(record, unit), refresh=False)
            bar.update(1)
            if stop or step == last or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                saves.append(save(parts, procs, cfg, out_dir, step, window, segments_to(step)))
                stop = stop or any_signal(procs, signals, procs.device)   # a signal during the save: stop with it
            if stop and step < last:
                bar.close()
                if log:
                    log.close()
                preempted = Preempted(step, checkpoint_path(out_dir, step), saves[-1]["seconds"], signals.received)
                say(str(preempted))
                raise preempted
    bar.close()

    experts = [name for name, _ in expert_parameters(model)]
    hashes = gather(procs, (parameter_hash(model), parameter_hash(model, skip=experts)))
    routing = topic_routing(model, data.topics, procs.device) if model.moe_layers() else {}  # same rows everywhere
    if task == "image":   # an HF image classifier: its folder (every rank: experts gathered)
        export_image_model(model, out_dir / "hf_model")
    elif cfg.hf is not None:   # an HF architecture: a folder plain transformers loads (every rank: experts gathered)
        export_hf_model(model, out_dir / "hf_model", cfg)
    if not is_main:
        return {}
    log.close()
    result = _result(cfg, procs, log.records, hashes, segments_to(step), out_dir)
    result["checkpoint_seconds"] = [t["seconds"] for t in saves]
    result["checksum_seconds"] = [t["checksum_seconds"] for t in saves]
    result["topic_routing"] = routing
    result["hf_model"] = cfg.hf is not None
    (out_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    if cfg.log.plots:
        start = (cfg.lora.checkpoint if cfg.lora is not None else None) or \
            (cfg.upcycle.checkpoint if cfg.upcycle is not None else None)    # the run this one goes on from
        before = plots.run_records(start) if start is not None else []
        plots.save_plots(log.records, out_dir, routing, task, before)
    summary = plots.summary(cfg.log.name, result, log.records, routing) + _faults_summary(result)
    (out_dir / "summary.txt").write_text(summary)
    print(summary, end="")
    return result


def _step(cfg: ExperimentConfig, procs: Processes, parts, wrapped: torch.nn.Module, window: Window, step: int,
          signals: Signals, items_per_step: int) -> Tuple[Window, bool]:
    """One optimizer step, unless the loss, aux loss or gradient norm is non-finite on any rank (then nothing
    is applied: train.nonfinite says whether to skip it or stop). Returns (window, whether to stop now)."""
    model, optimizer, data = parts.model, parts.optimizer, parts.data
    tick = time.perf_counter()
    x, y = (t.to(procs.device) for t in data.train.next())   # x_BS, y_BS tokens; or x_BCHW, y_B images
    logits = wrapped(x)                                        # logits_BSV; or logits_BL
    task_loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
    correct = (logits.argmax(-1) == y).sum() if cfg.data.task == "image" else None   # read when recorded
    router_loss = aux_loss(model)
    optimizer.zero_grad(set_to_none=True)
    (task_loss + router_loss).backward()
    norm = gradient_norm(model, procs, cfg.parallel.ep_size)
    nonfinite, stop = step_verdict(procs, task_loss, router_loss, norm, signals)
    if nonfinite:
        optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()   # the LR schedule follows the step number, skipped or not
        window.skip()
        what = " and ".join(nonfinite) + (" are" if len(nonfinite) > 1 else " is")
        if cfg.train.nonfinite == "stop":
            raise NonFiniteStep(f"step {step}: the {what} not finite (NaN or inf) on at least one rank; nothing "
                                f"of this step was applied and the last checkpoint is as it was (train.nonfinite="
                                f"stop; train.nonfinite=skip skips such steps)")
        if window.skipped_in_a_row >= cfg.train.max_skipped:
            raise NonFiniteStep(f"step {step}: the {what} not finite (NaN or inf): {window.skipped_in_a_row} "
                                f"steps in a row skipped, train.max_skipped={cfg.train.max_skipped}; nothing of "
                                f"them was applied and the last checkpoint is as it was")
        return window, stop
    if cfg.train.grad_clip:
        clip_gradients(model, cfg.train.grad_clip, procs, cfg.parallel.ep_size, norm)
    optimizer.step()
    update_expert_bias(model)
    parts.scheduler.step()
    window.add(task_loss, router_loss, [layer._routing for layer in model.moe_layers()], items_per_step,
               time.perf_counter() - tick, correct)
    return window, stop


def _progress(record: dict, unit: str) -> str:
    if "loss" not in record:
        return f"{record['skipped_steps']} steps skipped (non-finite)"
    accuracy = f"acc {record['accuracy']:.1%} " if "accuracy" in record else ""
    return (f"loss {record['loss']:.3f} {accuracy}{unit[:3]}/s {record[unit + '_per_s']:.0f} "
            f"drop {record['dropped_fraction']:.1%}")


def _faults_summary(result: dict) -> str:
    saves, sums = result["checkpoint_seconds"], result["checksum_seconds"]
    lines = [f"skipped steps (non-finite loss, aux loss or gradient norm): {result['skipped_steps']}"]
    if saves:
        lines.append(f"checkpoints written: {len(saves)}, {sum(saves) / len(saves):.3f} s each on average, "
                     f"of which checksums {100 * sum(sums) / max(sum(saves), 1e-12):.1f}%")
    return "\n".join(lines) + "\n"


def _result(cfg: ExperimentConfig, procs: Processes, records: List[dict], hashes: List[Tuple[str, str]],
            segments: List[dict], out_dir: Path) -> dict:
    """The run's result. Its steps, items (tokens or images), processes and seconds are the whole run's, summed
    over its segments (each start and resume; `segments` lists them): `world_size` is this segment's processes,
    `processes` each segment's."""
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    train_records = [r for r in records if "loss" in r]
    image = cfg.data.task == "image"
    unit = "images" if image else "tokens"
    val_accuracy = [r["val_accuracy"] for r in records if "val_accuracy" in r]
    accuracy = {"val_accuracy_first": val_accuracy[0], "val_accuracy_last": val_accuracy[-1]} if image else {}
    return {"name": cfg.log.name, "task": cfg.data.task, "out_dir": str(out_dir), "plots": cfg.log.plots,
            "world_size": procs.world_size, "steps": records[-1]["step"],
            "seconds": sum(s["seconds"] for s in segments if s["seconds"] is not None),
            "seconds_complete": all(s["seconds"] is not None for s in segments),
            unit: sum(s["items"] for s in segments), "processes": [s["processes"] for s in segments],
            "segments": segments,
            "val_loss_first": val[0][1], "val_loss_last": val[-1][1], **accuracy,
            "loss_first": train_records[0]["loss"] if train_records else None,
            "loss_last": train_records[-1]["loss"] if train_records else None,
            "skipped_steps": sum(r.get("skipped_steps", 0) for r in records),
            "param_sha256_per_rank": [full for full, _ in hashes],
            "shared_param_sha256_per_rank": [shared for _, shared in hashes]}
