"""Dispatchers: how the routed rows reach their experts and the experts' outputs come back to the tokens.

MoELayer.forward reads router -> plan -> dispatcher -> shared expert. The layer builds its dispatcher once
(MoELayer.make_dispatcher, when its groups are known) and calls it every forward with the tokens, their
gates, the routing plan and the experts (experts.BaseExperts). One file per dispatcher:

    local.py        every expert on this process: no exchange (the single-process path)
    all_to_all.py   expert parallel: rows go by all-to-all to the ranks holding their experts

A new dispatcher (a DeepEP-style one on GPUs, say) is one new file here: a subclass of base.Dispatcher that
says when it applies (applies, priority) and how it is built (build). This package imports every module in
it, and MoELayer.make_dispatcher takes Dispatcher.for_layer: the one of highest priority that applies.
"""
import importlib
import pkgutil

from .all_to_all import AllToAllDispatcher
from .base import Dispatcher
from .local import LocalDispatcher, local_moe

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Dispatcher", "LocalDispatcher", "AllToAllDispatcher", "local_moe"]
