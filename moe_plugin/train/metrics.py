"""Metrics: the window of steps since the last record, metrics.jsonl and TensorBoard."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

from .processes import Processes


@dataclass
class Window:
    """The steps since the last metrics record, summed (over this rank).

    A layer's tokens_per_expert counts this rank's tokens for every expert (wherever the expert
    lives), so their sum over the ranks in record() is the whole load, with or without ep.
    `tokens` counts the step's items: tokens of a language model, images of an image classifier,
    of which `correct` were classified right. `skipped` counts the steps left out for a non-finite loss or
    gradient norm (every rank skips the same ones), `skipped_in_a_row` the run of them up to the last step
    (it carries over into the next window).

    add() reads nothing from the device: each step's loss, aux loss, correct count and routing are added into
    `pending_V` there (V: [loss, aux_loss, dropped_fraction, correct, each layer's tokens_per_expert]), which
    settle() reads once, when the window is recorded or saved."""
    steps: int = 0
    loss: float = 0.0
    aux_loss: float = 0.0
    dropped_fraction: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_expert: List[List[int]] = field(default_factory=list)
    correct: int = 0
    skipped: int = 0
    skipped_in_a_row: int = 0
    pending_V: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    pending_experts: List[int] = field(default_factory=list, repr=False, compare=False)

    def skip(self) -> None:
        self.skipped += 1
        self.skipped_in_a_row += 1

    def add(self, loss: torch.Tensor, aux: torch.Tensor, routings: List[tuple], tokens: int, seconds: float,
            correct: Optional[torch.Tensor] = None) -> None:
        """One applied step: loss, aux and correct as device tensors (not read here); routings: each MoE layer's
        last forward's (load_E, kept_E, capacity_factor, fixed, num_tokens, top_k), MoELayer._routing."""
        self.steps += 1
        self.skipped_in_a_row = 0
        self.tokens += tokens
        self.seconds += seconds
        device = loss.device
        dropped = [1.0 - kept_E.sum().to(device, torch.float64) / (num_tokens * top_k) if num_tokens * top_k
                   else torch.zeros((), dtype=torch.float64, device=device)
                   for _, kept_E, _, _, num_tokens, top_k in routings]
        mean_dropped = torch.stack(dropped).mean() if dropped else torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), device=device) if correct is None else correct
        head_4 = torch.stack([loss.detach().to(torch.float64), aux.detach().to(device, torch.float64), mean_dropped,
                              correct.to(device, torch.float64)])
        step_V = torch.cat([head_4] + [r[0].to(device, torch.float64) for r in routings])
        self.pending_V = step_V if self.pending_V is None else self.pending_V + step_V
        self.pending_experts = [r[0].numel() for r in routings]

    def settle(self) -> "Window":
        """Fold the device sums into the numbers (one device read); returns self."""
        if self.pending_V is None:
            return self
        values = self.pending_V.tolist()
        self.pending_V = None
        self.loss += values[0]
        self.aux_loss += values[1]
        self.dropped_fraction += values[2]
        self.correct += int(round(values[3]))
        loads, start = [], 4
        for size in self.pending_experts:
            loads.append([int(round(v)) for v in values[start:start + size]])
            start += size
        self.tokens_per_expert = loads if not self.tokens_per_expert else \
            [[a + b for a, b in zip(old, new)] for old, new in zip(self.tokens_per_expert, loads)]
        return self

    def state(self) -> dict:
        """The settled numbers, as Window(**state) takes them (what a checkpoint keeps)."""
        self.settle()
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}

    def record(self, procs: Processes, step: int, lr: float, unit: str = "tokens") -> dict:
        """The window averaged over its steps and over the ranks (a collective: every rank calls it).
        unit "images" (an image classifier): images_per_s and the training accuracy instead of tokens_per_s."""
        self.settle()
        loads = [n for layer in self.tokens_per_expert for n in layer]
        sums = torch.tensor([self.loss, self.aux_loss, self.dropped_fraction, self.tokens, self.seconds,
                             self.correct] + loads, dtype=torch.float64, device=procs.device)
        if procs.world_size > 1:
            dist.all_reduce(sums)
        sums = sums.tolist()
        n = self.steps * procs.world_size
        if n == 0:   # every step of the window was skipped: no loss to report (plots and the summary pass it over)
            return {"step": step, "lr": lr, "skipped_steps": self.skipped}
        seconds = sums[4] / procs.world_size
        per_layer = len(self.tokens_per_expert[0]) if self.tokens_per_expert else 0
        record = {"step": step, "lr": lr, "loss": sums[0] / n, "aux_loss": sums[1] / n,
                  "dropped_fraction": sums[2] / n, f"{unit}_per_s": sums[3] / seconds if seconds else 0.0,
                  "tokens_per_expert": [[int(v) for v in sums[6 + i * per_layer:6 + (i + 1) * per_layer]]
                                        for i in range(len(self.tokens_per_expert))],
                  "skipped_steps": self.skipped}
        if unit == "images":
            record["accuracy"] = sums[5] / sums[3]
        return record


def _parse(line: str) -> Optional[dict]:
    """A record, or None for the line a killed process left half-written."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


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
            self.records = [r for r in map(_parse, lines) if r is not None and r["step"] <= resumed_step]
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
