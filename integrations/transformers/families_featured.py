"""Hugging Face MoE families whose blocks need the layer's newer expert and router features
(GeGLU, clamped SwiGLU, router bias, gating on the expert input, ...). Entries as in families.py."""
from __future__ import annotations

from typing import Tuple

from .family import Family  # noqa: F401

FEATURED_FAMILIES: Tuple[Family, ...] = ()
