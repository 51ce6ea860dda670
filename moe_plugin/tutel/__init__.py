"""Tutel's moe_layer on moe_plugin: `from moe_plugin import tutel as tutel_moe; tutel_moe.moe_layer(...)` takes Tutel's
arguments, computes Tutel's math and loads Tutel's state dicts (docs/tutel.md)."""
from .layer import TutelMoELayer, moe_layer

__all__ = ["TutelMoELayer", "moe_layer"]

# tutel.moe's other names: its low-level routing functions, which a layer written on them calls directly
TUTEL_ONLY = ("extract_critical", "fast_cumsum_sub_one", "fast_decode", "fast_dispatcher", "fast_encode",
              "top_k_routing")


def __getattr__(name: str):
    if name in TUTEL_ONLY:
        raise AttributeError(f"moe_plugin.tutel has no {name!r}: the drop-in provides Tutel's layer, moe_layer "
                             f"(and TutelMoELayer), not Tutel's low-level routing functions; code built on "
                             f"{name} needs Tutel itself, or moe_plugin.MoELayer in its place")
    raise AttributeError(f"module 'moe_plugin.tutel' has no attribute {name!r}")
