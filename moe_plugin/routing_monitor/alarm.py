"""The routing alarm (issue 44): when an expert gets under min_share of the mean load in each of `windows` logging
windows in a row, or a layer's dropped fraction is over max_dropped in each of them, or (max_rank_load given) its
busiest expert-parallel rank computes over max_rank_load times the mean rank's routed rows in each of them
(metrics.max_rank_load), one warning names the layer, the experts and the numbers. It fires once per layer until the layer is healthy again. Hosts pass read()'s metrics
(metrics.RoutingMonitor) to check() and send what it returns to their own logger.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set


class RoutingAlarm:
    def __init__(self, min_share: float = 0.1, max_dropped: float = 0.2, windows: int = 3,
                 max_rank_load: Optional[float] = None):
        """max_rank_load: a number >= 1, or None (the default: not watched)."""
        if not _number(min_share) or not 0.0 <= min_share < 1.0:
            raise ValueError(f"routing alarm: min_share must be in [0, 1) (a share of the mean load), got {min_share!r}")
        if not _number(max_dropped) or not 0.0 <= max_dropped < 1.0:
            raise ValueError(f"routing alarm: max_dropped must be in [0, 1) (a fraction), got {max_dropped!r}")
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
            raise ValueError(f"routing alarm: windows must be an integer >= 1, got {windows!r}")
        if max_rank_load is not None and (not _number(max_rank_load) or not 1.0 <= max_rank_load < float("inf")):
            raise ValueError(f"routing alarm: max_rank_load must be a number >= 1 (the busiest rank's rows over the "
                             f"mean rank's) or None (not watched), got {max_rank_load!r}")
        self.min_share, self.max_dropped, self.windows = min_share, max_dropped, windows
        self.max_rank_load = max_rank_load
        self.busy_in_a_row: Dict[str, int] = {}             # layer -> its run of windows over max_rank_load
        self.starved_in_a_row: Dict[str, List[int]] = {}    # layer -> each expert's run of starved windows
        self.dropping_in_a_row: Dict[str, int] = {}         # layer -> its run of windows over max_dropped
        self.fired: Set[str] = set()                        # layers warned about and not healthy since

    def check(self, metrics: Dict[str, dict]) -> List[str]:
        """One message per layer whose trouble has just lasted `windows` windows ([] otherwise): the same expert
        starved in each of them, or the drops over max_dropped in each."""
        messages = []
        for name, layer in metrics.items():
            shares = _shares(layer["tokens_per_expert"])
            runs = self.starved_in_a_row.get(name) or [0] * len(shares)
            runs = [run + 1 if share < self.min_share else 0 for run, share in zip(runs, shares)]
            dropping = self.dropping_in_a_row.get(name, 0) + 1 if layer["dropped_fraction"] > self.max_dropped else 0
            busy = self.busy_in_a_row.get(name, 0) + 1 if self.max_rank_load is not None and \
                layer.get("max_rank_load", 1.0) > self.max_rank_load else 0
            self.starved_in_a_row[name], self.dropping_in_a_row[name] = runs, dropping
            self.busy_in_a_row[name] = busy
            if not any(runs) and not dropping and not busy:
                self.fired.discard(name)          # healthy: armed again
            trouble = self.trouble(layer, shares, [e for e, run in enumerate(runs) if run >= self.windows],
                                   dropping >= self.windows, busy >= self.windows)
            if trouble and name not in self.fired:
                self.fired.add(name)
                messages.append(f"moe_plugin routing alarm: MoE layer {name or '(the model)'}: {trouble}, "
                                f"in each of the last {self.windows} logging windows")
        return messages

    def layers_in_alarm(self) -> int:
        """How many layers' trouble has lasted `windows` windows as of the last check."""
        return sum(any(run >= self.windows for run in self.starved_in_a_row[name]) or
                   self.dropping_in_a_row[name] >= self.windows or self.busy_in_a_row.get(name, 0) >= self.windows
                   for name in self.starved_in_a_row)

    def trouble(self, layer: dict, shares: List[float], starved: List[int], dropping: bool, busy: bool = False) -> str:
        """What has lasted in one layer: its starved experts (with their shares in this window), its drops and its
        busiest rank."""
        found = []
        if starved:
            named = ", ".join(f"{e} ({shares[e]:.1%})" for e in starved)
            found.append(f"experts {named} got under {self.min_share:.0%} of the mean load "
                         f"(busiest expert {layer['max_load']:.2f}x the mean)")
        if dropping:
            found.append(f"dropped fraction {layer['dropped_fraction']:.1%} over {self.max_dropped:.0%}")
        if busy:
            found.append(f"the busiest expert-parallel rank computes {layer['max_rank_load']:.2f}x the mean rank's "
                         f"routed rows, over {self.max_rank_load:g}x (docs/expert-parallelism.md, Balance at scale)")
        return "; ".join(found)


def _shares(load: List[float]) -> List[float]:
    """Each expert's tokens over the mean load (1.0 each when no token was routed: nothing is starved then)."""
    mean = sum(load) / len(load)
    return [n / mean if mean else 1.0 for n in load]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
