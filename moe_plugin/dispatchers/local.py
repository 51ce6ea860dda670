"""Every expert on this process: no exchange. Stacked experts run the fused path (one_process/fused_experts.py: gather, two
grouped GEMMs and the weighted sum in one autograd node); experts without stacked weights (module_experts.py)
run encode -> their own forward -> decode.

Shape legend: moe_plugin/__init__.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import dispatch
from ..experts import ExpertWeights
from ..one_process.fused_experts import fused_moe
from .base import Dispatcher


def local_moe(x_TD: torch.Tensor, gate_TK: torch.Tensor, plan: dispatch.Plan, experts,
              weights: Optional[ExpertWeights] = None) -> torch.Tensor:
    """The MoE on this process. weights: what stacked experts run with (default: experts.weights in x_TD's
    dtype; gathered ones at expert-parallel degree 0); experts without stacked weights run their forward."""
    weights = experts.weights(x_TD.dtype) if weights is None else weights
    if weights is None:
        return dispatch.decode(experts(dispatch.encode(x_TD, plan), plan.kept_E), gate_TK, plan)
    return fused_moe(x_TD, gate_TK, plan.pos_TK, plan.offs_E, weights.activation,
                     weights.w1_EDH, weights.b1_EH, weights.w2_EHD, weights.b2_ED, *weights.lora,
                     weights.recompute)


class LocalDispatcher(Dispatcher):
    """Every expert here: the degrees are moot. run: local_moe (with weights given: gathered ones)."""

    run = staticmethod(local_moe)

    def __call__(self, x_TD, gate_TK, plan, experts, in_flight=None, parallel=None, overlap_degree=None,
                 training=False) -> torch.Tensor:
        if in_flight is not None:
            in_flight()
        weights = experts.weights(x_TD.dtype)     # local_moe's body, inline: one Python call less per forward
        if weights is None:
            return dispatch.decode(experts(dispatch.encode(x_TD, plan), plan.kept_E), gate_TK, plan)
        return fused_moe(x_TD, gate_TK, plan.pos_TK, plan.offs_E, weights.activation,
                         weights.w1_EDH, weights.b1_EH, weights.w2_EHD, weights.b2_ED, *weights.lora,
                         weights.recompute)
