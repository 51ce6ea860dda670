"""The dispatcher interface (see the package's docstring); shape legend: moe_plugin/shapes.py."""
from __future__ import annotations

import abc
from typing import Callable, Optional

import torch


class Dispatcher(abc.ABC):
    """Takes the routed rows to the experts and their outputs back into the tokens, for one layer.

    groups and tuner: what it was built for (the layer builds a new dispatcher when a host binds new ones)."""

    def __init__(self, groups=None, tuner=None):
        self.groups, self.tuner = groups, tuner

    @abc.abstractmethod
    def __call__(self, x_TD: torch.Tensor, gate_TK: torch.Tensor, plan, experts,
                 in_flight: Optional[Callable[[], None]] = None, parallel: Optional[int] = None,
                 overlap_degree: Optional[int] = None, training: bool = False) -> torch.Tensor:
        """y_TD[t] = sum over t's kept choices k of gate_TK[t, k] * expert(x_TD[t]), in x_TD's dtype (autocast
        is off). in_flight: called once while the exchange is in flight (the shared expert), or first.
        parallel, overlap_degree: this call's degrees where the dispatcher has any; training: a training step
        (a dispatcher may time it to tune itself)."""

    def stats(self) -> dict:
        """What the last call chose (the layer's .stats), {} if nothing."""
        return {}
