"""Pick the fastest (parallel degree r, overlap degree d) by timing the real workload.

The first len(candidates) * trials training calls try each candidate in turn; then the ranks
add up their timings (so they agree) and keep the fastest for good.
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

log = logging.getLogger("moe_plugin")
Candidate = Tuple[int, int]


class Tuner:
    def __init__(self, candidates: List[Candidate], trials: int = 2, group=None):
        self.candidates, self.trials, self.group = list(candidates), trials, group
        self.seconds = [0.0] * len(self.candidates)
        self.calls = 0
        self.chosen: Optional[Candidate] = self.candidates[0] if len(self.candidates) == 1 else None

    def current(self) -> Candidate:
        if self.chosen is not None:
            return self.chosen
        return self.candidates[self.calls % len(self.candidates)]

    def record(self, candidate: Candidate, seconds: float) -> None:
        if self.chosen is not None:
            return
        self.seconds[self.candidates.index(candidate)] += seconds
        self.calls += 1
        if self.calls == self.trials * len(self.candidates):
            totals = torch.tensor(self.seconds, dtype=torch.float64)
            if self.group is not None:
                dist.all_reduce(totals, group=self.group)
            self.chosen = self.candidates[int(torch.argmin(totals))]
            log.info("moe_plugin: tuned (parallel r, overlap d) = %s from %s", self.chosen,
                     dict(zip(self.candidates, totals.tolist())))

    def timed(self):
        return _Timer()


class _Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
