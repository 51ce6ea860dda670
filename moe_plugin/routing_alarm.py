"""The routing alarm (issue 44): when an expert gets under min_share of the mean load, or a layer's dropped fraction
is over max_dropped, in each of `windows` logging windows in a row, one warning names the layer, the experts and
the numbers. It fires once per layer until the layer is healthy again. Hosts pass read()'s metrics
(routing_metrics.RoutingMonitor) to check() and send what it returns to their own logger.
"""
from __future__ import annotations

from typing import Dict, List


class RoutingAlarm:
    def __init__(self, min_share: float = 0.1, max_dropped: float = 0.2, windows: int = 3):
        if not _number(min_share) or not 0.0 <= min_share < 1.0:
            raise ValueError(f"routing alarm: min_share must be in [0, 1) (a share of the mean load), got {min_share!r}")
        if not _number(max_dropped) or not 0.0 <= max_dropped < 1.0:
            raise ValueError(f"routing alarm: max_dropped must be in [0, 1) (a fraction), got {max_dropped!r}")
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
            raise ValueError(f"routing alarm: windows must be an integer >= 1, got {windows!r}")
        self.min_share, self.max_dropped, self.windows = min_share, max_dropped, windows
        self.unhealthy_in_a_row: Dict[str, int] = {}

    def check(self, metrics: Dict[str, dict]) -> List[str]:
        """One message per layer whose trouble has just lasted `windows` windows ([] otherwise)."""
        messages = []
        for name, layer in metrics.items():
            trouble = self.trouble(layer)
            count = self.unhealthy_in_a_row.get(name, 0) + 1 if trouble else 0
            self.unhealthy_in_a_row[name] = count
            if count == self.windows:
                messages.append(f"moe_plugin routing alarm: MoE layer {name or '(the model)'}: {trouble}, "
                                f"in each of the last {self.windows} logging windows")
        return messages

    def trouble(self, layer: dict) -> str:
        """What is wrong with one layer's window ('' when nothing)."""
        load = layer["tokens_per_expert"]
        mean = sum(load) / len(load)
        starved = [(e, n / mean) for e, n in enumerate(load) if mean and n / mean < self.min_share]
        found = []
        if starved:
            shares = ", ".join(f"{e} ({share:.1%})" for e, share in starved)
            found.append(f"experts {shares} got under {self.min_share:.0%} of the mean load "
                         f"(busiest expert {layer['max_load']:.2f}x the mean)")
        if layer["dropped_fraction"] > self.max_dropped:
            found.append(f"dropped fraction {layer['dropped_fraction']:.1%} over {self.max_dropped:.0%}")
        return "; ".join(found)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
