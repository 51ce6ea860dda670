"""Tutel's gates as our Routers: "top" is the softmax router (router.weight_ED is Tutel's wg.weight), "cosine_top" the
cosine router with a projection (router.projector is Tutel's cosine_projector, weight_ED its sim_matrix transposed,
log_scale its temperature). Each starts with the values Tutel's gate would draw from the same random state.

Shape legend: moe_plugin/__init__.py (here D model dim, E experts), J the cosine gate's projection width.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import MoEConfig
from ..router import Router
from .arguments import GateSpec


def build_gate(config: MoEConfig, spec: GateSpec) -> Router:
    """A router for one of Tutel's gates, its parameters drawn in Tutel's order from the global random state."""
    with torch.random.fork_rng(devices=[]):      # the router's own draws leave the global state alone
        router = Router(config)
    init_like_tutel(router, spec)
    return router


@torch.no_grad()
def init_like_tutel(router: Router, spec: GateSpec) -> None:
    D, E = router.config.model_dim, router.config.num_experts
    if spec.kind == "top":
        router.weight_ED.copy_(nn.Linear(D, E, bias=False).weight)
        return
    router.log_scale.fill_(math.log(1.0 / spec.init_t))
    projector = nn.Linear(D, spec.proj_dim)
    router.projector.weight.copy_(projector.weight)
    router.projector.bias.copy_(projector.bias)
    sim_JE = torch.randn(spec.proj_dim, E)      # drawn, then drawn again, as Tutel's gate does
    router.weight_ED.copy_(sim_JE.normal_(0, 0.01).t())
