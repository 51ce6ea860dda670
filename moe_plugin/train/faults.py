"""What a run survives: preemption signals and non-finite steps.

SIGTERM (what SLURM, Kubernetes and spot instances send before the kill; torchrun forwards it to its
ranks) and SIGUSR1 (SLURM's `--signal=USR1@SECONDS`) only set a flag. At the end of the step every rank
learns whether any rank got one, in the same all-reduce that makes every rank agree on a non-finite
loss, aux loss or gradient norm; then all ranks write one checkpoint and stop with Preempted, and
`moe-plugin train` exits with PREEMPTED_EXIT_CODE. A signal that arrives during a save changes nothing
in the save: it is noticed when the save is done, and that checkpoint is the one the run stops with.
"""
from __future__ import annotations

import signal
import threading
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .processes import Processes

PREEMPTED_EXIT_CODE = 75    # EX_TEMPFAIL (sysexits.h): stopped on purpose after a checkpoint; resume to go on
NONFINITE_EXIT_CODE = 3     # train.nonfinite stopped the run; the last good checkpoint is left as it was
SIGNALS = ("SIGTERM", "SIGUSR1")
QUANTITIES = ("loss", "aux loss", "gradient norm")


class Preempted(Exception):
    """The run stopped on a signal after writing the checkpoint `path` at `step`."""

    def __init__(self, step: int, path, seconds: float, signal_name: Optional[str]):
        self.step, self.path, self.seconds, self.signal_name = step, path, seconds, signal_name
        by = signal_name or "a signal to another rank"
        super().__init__(f"preempted by {by}: stopped after step {step} with checkpoint {path} (written in "
                         f"{seconds:.2f} s); run the same command with train.resume=auto to go on")


class NonFiniteStep(RuntimeError):
    """train.nonfinite stopped the run: a non-finite loss, aux loss or gradient norm (never applied)."""


class Signals:
    """`with Signals() as signals:` SIGTERM and SIGUSR1 set signals.received (the signal's name) instead of
    ending the process; the previous handlers come back on exit. Outside the main thread nothing is installed."""

    def __enter__(self) -> "Signals":
        self.received: Optional[str] = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                number = getattr(signal, name)
                self.previous[number] = signal.signal(number, self._note)
        return self

    def _note(self, number, _frame) -> None:
        self.received = signal.Signals(number).name

    def __exit__(self, *_) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def _any(procs: Processes, flags_F: torch.Tensor) -> List[bool]:
    """Each flag, true if it is true on any rank (one all-reduce)."""
    flags_F = flags_F.to(torch.float32)
    if procs.world_size > 1:
        dist.all_reduce(flags_F, op=dist.ReduceOp.MAX)
    return [bool(v) for v in flags_F.tolist()]


def step_verdict(procs: Processes, loss: torch.Tensor, aux: torch.Tensor, norm: torch.Tensor,
                 signals: Signals) -> Tuple[List[str], bool]:
    """(which of loss, aux loss, gradient norm were non-finite on any rank; whether any rank got a signal):
    the same answer on every rank."""
    device = loss.device
    values = [torch.as_tensor(v, device=device).detach() for v in (loss, aux, norm)]
    flags_F = torch.stack([~torch.isfinite(v).all() for v in values] +
                          [torch.tensor(signals.received is not None, device=device)])
    *bad, stop = _any(procs, flags_F)
    return [name for name, is_bad in zip(QUANTITIES, bad) if is_bad], stop


def any_signal(procs: Processes, signals: Signals, device: torch.device) -> bool:
    """Whether any rank got a signal by now (a collective)."""
    return _any(procs, torch.tensor([signals.received is not None], device=device))[0]
