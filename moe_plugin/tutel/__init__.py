"""Tutel's moe_layer on moe_plugin: `from moe_plugin import tutel as tutel_moe; tutel_moe.moe_layer(...)` takes Tutel's
arguments, computes Tutel's math and loads Tutel's state dicts (docs/tutel.md)."""
from .layer import TutelMoELayer, moe_layer

__all__ = ["TutelMoELayer", "moe_layer"]
