"""Choose the parallel degree r, overlap degree d and all-to-all algorithm of each expert-parallel call.

Tuner (parallel / overlap_degree / a2a "auto"): a dictionary from the step's load to the fastest
setting, filled online and re-tuned as the load drifts (Tutel, section 3.3).
- Key: a half-octave bucket of the largest expert's kept rows (the capacity used), read from
  route_counts' gathered counts, which every rank holds: the ranks agree without a word.
- Timing: each call is timed from the start of its expert path to the end of that path's backward
  (the forward part plus the backward part: clock marks at its entry and exit, a hook on the output's
  gradient, and a multi-grad hook that waits for x's, the gate's and the weights' gradients). The
  time rides to the other ranks on a later forward's route_counts all-gather (read one forward after
  it ends, when its events are complete; shared on the next), so the max over ranks costs no
  collective and no host synchronization of its own. Every rank sees the same times: same decisions.
- Search per key: the candidates in the cost model's order (the nearest known key's choice first),
  without those the model puts past `prune_same_r` x the best of the same r; a setting's first call
  ever is dropped (warm-up: a new communicator's first use); the first is timed `trials` times, each
  other one gets one probe call and its other trials only if the probe is within `reject` x the best
  median; medians are kept; those the cost model puts past `prune` x the best one measured so far are
  skipped. The next setting is called as soon as this one's calls are issued; while the last times
  are on their way, the best setting so far runs. The choice is re-timed every
  `retune_every` calls of its key, or when its median over the last `trials` calls drifts past
  `drift` from the one it won with.
- Replicas (MoEConfig.redundant_experts "auto", parallel/replicas.py): a setting is (r, d, a2a, R), R the most
  copies of hot experts. At a new key the layer offers the replica counts worth timing at that load (`copies`: 0,
  the cost model's count, the count that levels the ranks); every r >= 1 setting is tried with each, the copies
  first (the cost model does not rank R), and the fastest is kept like any other setting. A flat load offers only 0.
- Persistence: the dictionary is the module's extra state, tagged (ep_size, node_size, dims, dtype).

OnceTuner (parallel / overlap_degree "auto_once"): times every candidate during the first calls
(forward only), adds the times over ranks and keeps the fastest for good.

Legend: W ranks, E experts.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import cost_model

log = logging.getLogger("moe_plugin")
Setting = tuple          # (parallel r, overlap d, a2a), and the replica count R when the tuner chooses it
NOT_MEASURED = -1


def load_key(counts_WE: torch.Tensor) -> int:
    """0 for no rows, else 1 + floor(2 log2(rows of the largest expert)): buckets of a half octave."""
    largest = int(counts_WE.sum(0).max()) if counts_WE.numel() else 0
    return 0 if largest <= 0 else 1 + int(math.floor(2 * math.log2(largest)))


def key_rows(key: int) -> float:
    """A load typical of a key (the lower end of its bucket)."""
    return 0.0 if key <= 0 else 2.0 ** ((key - 1) / 2)


def as_dict(setting: Optional[Setting]) -> Optional[dict]:
    if setting is None:
        return None
    return {"parallel": setting[0], "overlap_degree": setting[1], "a2a": setting[2],
            **({"redundant_experts": setting[3]} if len(setting) > 3 else {})}


def model_seconds(setting: Setting, rows: float, shape: dict) -> float:
    """The cost model's time of one call, forward + backward, when the largest expert gets `rows` rows
    (the slowest rank gets that for each of its E / W experts; with E < W an expert's rows are shared by
    its W / E ranks, whole rows at r = 1, hidden slices at r > 1: the same flops); shape: the tag plus
    dtype_bytes, device, local_rows (the most rows one rank routes, what r = 0 computes; None: as many
    as it receives) and total_rows (all ranks' rows; None: ep_size * local_rows)."""
    r, d, a2a = setting[:3]
    W, E = shape["ep_size"], shape["num_experts"]
    local, total = shape.get("local_rows"), shape.get("total_rows")
    workload = cost_model.Workload(rows_per_rank=int(round(rows * E / W)), model_dim=shape["model_dim"],
                                   hidden_dim=shape["hidden_size"], num_experts=E,
                                   dtype_bytes=shape.get("dtype_bytes", 4), matrices=shape.get("matrices", 2),
                                   local_rows=None if local is None else int(local),
                                   total_rows=None if total is None else int(total))
    params = cost_model.NDM_A100_V4 if shape.get("device") == "cuda" else cost_model.GLOO_HERE
    return cost_model.layer_seconds(r, d, a2a, workload, W, shape["node_size"], params)


class HostClock:
    """Wall time on the host (CPU work is done when its call returns)."""

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return end - start


class CudaClock:
    """CUDA events: recorded without waiting, read once the forward's host synchronization has passed them."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0


class _Measurement:
    def __init__(self, key: int, setting: Setting, clock):
        self.key, self.setting, self.clock = key, setting, clock
        self.marks: List = []
        self.backward = True

    def seconds(self) -> Optional[float]:
        """Forward part plus backward part, or None when the call did not finish both."""
        if len(self.marks) == 2 and not self.backward:
            return self.clock.seconds(*self.marks)
        if len(self.marks) != 4:
            return None
        return self.clock.seconds(self.marks[0], self.marks[1]) + self.clock.seconds(self.marks[2], self.marks[3])


class _Search:
    """One key's entry: the settings still to time (in order), the calls issued to each and the times
    that came back, their medians, the choice."""

    def __init__(self, order: List[Setting]):
        self.queue, self.samples, self.medians, self.issued = list(order), {}, {}, {}
        self.warming: set = set()        # settings whose first call ever (a warm-up) is one of this search's
        self.waiting = 0                 # calls since every queued setting had its calls issued
        self.choice: Optional[Setting] = None
        self.baseline: Optional[float] = None
        self.recent: List[float] = []
        self.calls = 0


class Tuner(nn.Module):
    """Per-load choice of (r, d, a2a), and of R with replicas=True; see the module docstring. The layer calls, per
    forward: outgoing() -> the int to send on route_counts; choose(counts_WE, gathered_W, dtype, measure, copies);
    then enter()/leave() around its expert path. candidates: (r, d, a2a) settings."""

    def __init__(self, candidates: List[Setting], shape: dict, trials: int = 3, retune_every: int = 500,
                 drift: float = 0.3, prune: float = 3.0, prune_same_r: float = 1.25, reject: float = 1.3,
                 cost: Optional[Callable[[Setting, float, dict], float]] = None, clock=None, replicas: bool = False):
        super().__init__()
        self.candidates = [tuple(setting) for setting in candidates]
        self.shape = {**shape, "redundant_experts": "auto"} if replicas else dict(shape)     # in the saved tag
        self.replicas = replicas
        self.copy_counts: Dict[int, List[int]] = {}  # per key: the replica counts offered at its first load
        self.trials, self.retune_every, self.drift, self.prune = trials, retune_every, drift, prune
        self.prune_same_r, self.reject = prune_same_r, reject
        self.cost = cost or model_seconds
        self.clock = clock or (CudaClock() if torch.cuda.is_available() and torch.cuda.is_initialized()
                               else HostClock())
        self.searches: Dict[int, _Search] = {}
        self.table: Dict[int, Setting] = {}          # the settled choices
        self.warm: set = set()                       # settings whose first (warm-up) time came back
        self.issued_ever: set = set()                # settings called at least once
        self.dtype: Optional[str] = None
        self.dtype_bytes = 4
        self.key: Optional[int] = None
        self.rows: Dict[int, Tuple[int, int]] = {}   # per key: the most rows one rank routes (what r = 0
                                                     # computes) and all ranks' rows
        self._loaded: Optional[dict] = None
        self._open: Optional[_Measurement] = None    # this call's
        self._done: Optional[_Measurement] = None    # the last call's, read at the next choose
        self._outgoing, self._outgoing_of = NOT_MEASURED, None

    # the per-forward protocol
    def outgoing(self) -> int:
        """This rank's time (microseconds) of a call two forwards back, or -1: the int route_counts carries."""
        return self._outgoing

    def choose(self, counts_WE: torch.Tensor, gathered_W: Optional[torch.Tensor], dtype: torch.dtype,
               measure: bool, copies: Optional[Callable[[], Iterable[int]]] = None) -> Setting:
        """copies (replicas=True): the replica counts worth timing at this load, asked once per new key."""
        self._set_dtype(str(dtype).replace("torch.", ""))
        self.dtype_bytes = torch.empty((), dtype=dtype).element_size()
        if self._outgoing_of is not None and gathered_W is not None and bool((gathered_W >= 0).all()):
            self.observe(*self._outgoing_of, float(gathered_W.max()) / 1e6)
        done, self._done = self._done, None
        seconds = None if done is None else done.seconds()
        self._outgoing = NOT_MEASURED if seconds is None else max(0, int(round(seconds * 1e6)))
        self._outgoing_of = None if seconds is None else (done.key, done.setting)

        self.key = load_key(counts_WE)
        self.rows[self.key] = (int(counts_WE.sum(1).max()), int(counts_WE.sum())) if counts_WE.numel() else (0, 0)
        if self.replicas and measure and self.key not in self.copy_counts:
            self.copy_counts[self.key] = sorted(set(copies() if copies is not None else []) | {0}, reverse=True)
        setting = self._pick(self.key, explore=measure)
        self._open = _Measurement(self.key, setting, self.clock) if measure else None
        return setting

    def enter(self, x_TD: torch.Tensor, gate_TK: torch.Tensor, weights: Iterable[torch.Tensor] = ()):
        """weights: the expert parameters; the backward's end mark waits for their gradients too."""
        if self._open is None:
            return x_TD, gate_TK
        measurement = self._open
        measurement.marks.append(measurement.clock.mark())
        watched = [t for t in (x_TD, gate_TK, *weights) if t.requires_grad]
        measurement.backward = bool(watched)
        if watched:
            def end(grads):
                measurement.marks.append(measurement.clock.mark())
                handle.remove()
            handle = torch.autograd.graph.register_multi_grad_hook(watched, end, mode="all")
        return x_TD, gate_TK

    def leave(self, y_TD: torch.Tensor) -> torch.Tensor:
        if self._open is None:
            return y_TD
        measurement, self._open = self._open, None
        self._done = measurement
        measurement.marks.append(measurement.clock.mark())
        if measurement.backward and y_TD.requires_grad:
            y_TD.register_hook(lambda grad: measurement.marks.append(measurement.clock.mark()))
        return y_TD

    # the dictionary
    def observe(self, key: int, setting: Setting, seconds: float) -> None:
        """One call's time (max over ranks); every rank makes this call with the same numbers."""
        if setting not in self.warm:
            self.warm.add(setting)
            return
        search = self.searches.get(key)
        if search is None:
            return
        if search.queue:
            if setting not in search.queue:
                return
            samples = search.samples.setdefault(setting, [])
            samples.append(seconds)
            rejected = bool(search.medians) and min(samples) > self.reject * min(search.medians.values())
            if len(samples) < self.trials and not rejected:
                return
            search.medians[setting] = statistics.median(samples)
            search.queue.remove(setting)
            best = min(search.medians, key=search.medians.get)
            ceiling = self.prune * self._cost(best, key)
            search.queue = [s for s in search.queue if self._cost(s, key) <= ceiling]
            if not search.queue:
                self._settle(key, search, best)
        elif setting == search.choice:
            search.recent = (search.recent + [seconds])[-self.trials:]
            search.calls += 1
            recent = statistics.median(search.recent)
            if search.baseline is None and len(search.recent) == self.trials:
                search.baseline = recent
            elif search.baseline is not None and len(search.recent) == self.trials \
                    and abs(recent - search.baseline) > self.drift * search.baseline:
                self._retune(key, search, f"its time drifted from {search.baseline:.3g} s to {recent:.3g} s")
            elif search.calls >= self.retune_every:
                self._retune(key, search, f"{search.calls} calls since it was timed")

    def nearest_choice(self, key: int) -> Optional[Setting]:
        if not self.table:
            return None
        return self.table[min(self.table, key=lambda k: (abs(k - key), k))]

    def _pick(self, key: int, explore: bool) -> Setting:
        search = self.searches.get(key)
        if search is None and explore:
            search = self.searches[key] = _Search(self._order(key))
        if search is not None and search.queue and explore:
            return self._next_to_time(search)
        if key in self.table:
            return self.table[key]
        return self.nearest_choice(key) or self._order(key)[0]

    def _next_to_time(self, search: _Search) -> Setting:
        """The first queued setting short of its calls (its warm-up included); while the last ones' times
        are on their way, the best setting timed so far. Once one setting has its median, the others get
        one probe call first, and their other trials only if the probe was within `reject` x the best."""
        for setting in search.queue:
            if setting not in self.issued_ever:
                self.issued_ever.add(setting)
                search.warming.add(setting)
            calls = 1 if search.medians and not search.samples.get(setting) else self.trials
            if search.issued.get(setting, 0) < calls + (setting in search.warming):
                search.issued[setting] = search.issued.get(setting, 0) + 1
                search.waiting = 0
                return setting
        search.waiting += 1
        if search.waiting > 3:      # more than the two calls' lag: some times never came (calls without backward)
            search.issued = {s: len(search.samples.get(s, [])) + (s in search.warming and s in self.warm)
                             for s in search.queue}
            search.waiting = 0
        return min(search.medians, key=search.medians.get) if search.medians else search.queue[0]

    def _settings(self, key: int) -> List[Setting]:
        """The candidates, each r >= 1 one with every replica count offered at this key (most copies first)."""
        if not self.replicas:
            return self.candidates
        counts = self.copy_counts.get(key, [0])
        return [s + (R,) for s in self.candidates for R in (counts if s[0] >= 1 else [0])]

    def _order(self, key: int) -> List[Setting]:
        """The candidates in the cost model's order, without those it puts past prune_same_r x the best
        one of the same r (same rows and weights moved: the model ranks those well); the nearest known
        key's choice first."""
        settings = self._settings(key)
        costs = {setting: self._cost(setting, key) for setting in settings}
        best_of_r: Dict[int, float] = {}
        for setting, seconds in costs.items():
            best_of_r[setting[0]] = min(seconds, best_of_r.get(setting[0], math.inf))
        kept = [s for s in settings if costs[s] <= self.prune_same_r * best_of_r[s[0]]]
        order = sorted(kept, key=costs.get)
        start = self.nearest_choice(key)
        return order if start is None else [start] + [s for s in order if s != start]

    def _cost(self, setting: Setting, key: int) -> float:
        device = "cuda" if isinstance(self.clock, CudaClock) else "cpu"
        local_rows, total_rows = self.rows.get(key, (None, None))
        return self.cost(setting, key_rows(key), {**self.shape, "dtype_bytes": self.dtype_bytes, "device": device,
                                                  "local_rows": local_rows, "total_rows": total_rows})

    def _settle(self, key: int, search: _Search, best: Setting) -> None:
        before = self.table.get(key)
        search.choice, search.baseline, search.recent, search.calls = best, search.medians[best], [], 0
        self.table[key] = best
        if best != before:
            log.info("moe_plugin tuner: load key %d (about %d rows per expert): %s -> %s; medians %s", key,
                     key_rows(key), as_dict(before), as_dict(best),
                     {",".join(map(str, s)): round(t, 6) for s, t in search.medians.items()})

    def _retune(self, key: int, search: _Search, why: str) -> None:
        log.info("moe_plugin tuner: re-timing load key %d (%s)", key, why)
        order = [search.choice] + [s for s in self._order(key) if s != search.choice]
        search.queue, search.samples, search.medians, search.issued, search.warming = order, {}, {}, {}, set()

    # visibility and persistence
    def stats(self) -> dict:
        return {"tuned": {"key": self.key, "choice": as_dict(self.table.get(self.key))},
                "tuned_table": {key: as_dict(setting) for key, setting in sorted(self.table.items())}}

    def tag(self) -> dict:
        return {**self.shape, "dtype": self.dtype}

    def get_extra_state(self) -> dict:
        return {"tag": self.tag(), "table": {key: list(setting) for key, setting in self.table.items()}}

    def set_extra_state(self, state: dict) -> None:
        self._loaded = dict(state)
        self._adopt()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        """A state dict without a dictionary (saved by a layer without this tuner) keeps this one's."""
        if prefix + "_extra_state" in state_dict:
            super()._load_from_state_dict(state_dict, prefix, *args)

    def _set_dtype(self, dtype: str) -> None:
        if dtype != self.dtype:
            self.dtype = dtype
            self._adopt()

    def _adopt(self) -> None:
        """Takes a loaded dictionary whose tag matches; the dtype is checked once a forward has shown it."""
        if self._loaded is None:
            return
        saved, mine = dict(self._loaded.get("tag", {})), self.tag()
        same_shape = {k: v for k, v in saved.items() if k != "dtype"} == {k: v for k, v in mine.items() if k != "dtype"}
        if same_shape and self.dtype is None:
            return
        table, self._loaded = self._loaded.get("table", {}), None
        if not same_shape or saved.get("dtype") != self.dtype:
            if table:
                log.warning("moe_plugin tuner: ignoring the saved dictionary: it was tuned for %s, this layer is %s",
                            saved, mine)
            return
        for key, setting in table.items():
            setting = (int(setting[0]), int(setting[1]), str(setting[2])) + tuple(int(R) for R in setting[3:])
            if setting[:3] in self.candidates and len(setting) == 3 + self.replicas:
                search = self.searches[int(key)] = _Search([])
                search.choice = self.table[int(key)] = setting


class OnceTuner:
    """Times each candidate during the first len(candidates) * trials training calls (forward only),
    adds the times over ranks (so they agree) and keeps the fastest for good."""

    def __init__(self, candidates: List[Setting], trials: int = 2, group=None):
        self.candidates, self.trials, self.group = list(candidates), trials, group
        self.seconds = [0.0] * len(self.candidates)
        self.calls = 0
        self.chosen: Optional[Setting] = self.candidates[0] if len(self.candidates) == 1 else None

    def current(self) -> Setting:
        if self.chosen is not None:
            return self.chosen
        return self.candidates[self.calls % len(self.candidates)]

    def record(self, candidate: Setting, seconds: float) -> None:
        if self.chosen is not None:
            return
        self.seconds[self.candidates.index(candidate)] += seconds
        self.calls += 1
        if self.calls == self.trials * len(self.candidates):
            totals = torch.tensor(self.seconds, dtype=torch.float64)
            if self.group is not None:
                dist.all_reduce(totals, group=self.group)
            self.chosen = self.candidates[int(torch.argmin(totals))]
            log.info("moe_plugin: tuned (parallel r, overlap d, a2a) = %s from %s", self.chosen,
                     dict(zip(self.candidates, totals.tolist())))

    def stats(self) -> dict:
        return {"tuned": as_dict(self.chosen)}

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
