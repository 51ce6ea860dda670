"""The dispatcher interface (see the package's docstring); shape legend: moe_plugin/__init__.py."""
from __future__ import annotations

import abc
from typing import Callable, Optional

import torch


class Dispatcher(abc.ABC):
    """Takes the routed rows to the experts and their outputs back into the tokens, for one layer.

    groups and tuner: what it was built for (the layer builds a new dispatcher when a host binds new ones)."""

    registry: list = []     # every dispatcher class of this package, in the order the package imported them
    priority = 0            # for_layer picks, of those that apply to a layer, the one of highest priority

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith(__name__.rpartition(".")[0] + "."):
            Dispatcher.registry.append(cls)

    def __init__(self, groups=None, tuner=None):
        self.groups, self.tuner = groups, tuner

    @classmethod
    def applies(cls, layer) -> bool:
        """Whether this dispatcher can serve layer (an MoELayer, its groups and tuner set). By default every
        layer, at priority 0: that is the local dispatcher; any other one raises priority and narrows this."""
        return True

    @classmethod
    def build(cls, layer) -> "Dispatcher":
        """This dispatcher for layer."""
        return cls(layer.groups, layer.tuner)

    @staticmethod
    def for_layer(layer) -> "Dispatcher":
        """The dispatcher of highest priority that applies to layer (the package imports every module in it,
        so a new dispatcher is one new file)."""
        fits = [c for c in Dispatcher.registry if c.applies(layer)]
        if not fits:
            raise ValueError(f"no dispatcher applies to this layer; registered: "
                             f"{[c.__name__ for c in Dispatcher.registry]}")
        top = max(c.priority for c in fits)
        best = [c for c in fits if c.priority == top]
        if len(best) > 1:
            raise ValueError(f"dispatchers {[c.__name__ for c in best]} all apply to this layer at priority "
                             f"{top}; give one a higher priority or a narrower applies()")
        return best[0].build(layer)

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
