"""Router: scores, top-k choice, gate normalization, load-balancing and z losses.

Legend: T tokens, D model dim, E experts, K top-k.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig

COSINE_MAX_SCALE = 100.0


@dataclass
class Routes:
    scores_TE: torch.Tensor   # router probabilities (softmax/cosine) or sigmoid scores, fp32 when fp32_router
    expert_TK: torch.Tensor   # chosen experts, best first
    gate_TK: torch.Tensor     # scores of the chosen experts (normalized before drop if configured)
    aux_loss: torch.Tensor    # unweighted load-balancing loss
    z_loss: torch.Tensor      # unweighted router z-loss


class Router(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight_ED = nn.Parameter(torch.empty(config.num_experts, config.model_dim))
        if config.router == "cosine":
            self.log_scale = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.config.model_dim)
        with torch.no_grad():
            self.weight_ED.uniform_(-bound, bound)
            if self.config.router == "cosine":
                self.log_scale.fill_(math.log(10.0))

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.config.fp32_router:    # in fp32 under autocast too: routes must not flip with rounding
            dtype = torch.promote_types(x_TD.dtype, torch.float32)
            with autocast_off(x_TD.device.type):
                return self._logits(x_TD.to(dtype), self.weight_ED.to(dtype))
        return self._logits(x_TD, self.weight_ED)

    def _logits(self, x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
        if self.config.router == "cosine":
            scale = self.log_scale.clamp(max=math.log(COSINE_MAX_SCALE)).exp()
            return F.normalize(x_TD, dim=-1) @ F.normalize(weight_ED, dim=-1).t() * scale.to(x_TD.dtype)
        return x_TD @ weight_ED.t()

    def forward(self, x_TD: torch.Tensor) -> Routes:
        cfg = self.config
        logits_TE = self.logits(x_TD)
        if cfg.router == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp(min=torch.finfo(scores_TE.dtype).tiny)
        else:
            scores_TE = probs_TE = torch.softmax(logits_TE, dim=-1)

        choice_TE = logits_TE
        if self.training and cfg.gate_noise > 0:
            choice_TE = logits_TE + cfg.gate_noise * torch.randn_like(logits_TE)
        expert_TK = torch.topk(choice_TE.detach(), cfg.top_k, dim=-1).indices
        gate_TK = scores_TE.gather(1, expert_TK)
        if cfg.normalize_gate == "before_drop" and cfg.top_k > 1:
            gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(gate_TK.dtype).tiny)

        aux = balance_loss(cfg.aux_loss, probs_TE, expert_TK, cfg.num_experts)
        z = z_loss(logits_TE) if cfg.z_loss_coef > 0 else logits_TE.new_zeros(())
        return Routes(scores_TE, expert_TK, gate_TK, aux, z)


def autocast_on(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A context without autocast for device_type (nothing to do for devices autocast does not know)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def finalize_gates(gate_TK: torch.Tensor, kept_TK: torch.Tensor, normalize: str) -> torch.Tensor:
    """Zero the gates of dropped choices; renormalize over the kept ones for "after_drop"."""
    gate_TK = gate_TK * kept_TK.to(gate_TK.dtype)
    if normalize == "after_drop" and gate_TK.shape[1] > 1:
        gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(gate_TK.dtype).eps)
    return gate_TK


def balance_loss(kind: str, probs_TE: torch.Tensor, expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e(mean router probability of e * fraction of choices routed to e); 1.0 when balanced.

    gshard counts each token's first choice only; switch counts all top-k choices.
    """
    if kind == "none" or probs_TE.shape[0] == 0:
        return probs_TE.new_zeros(())
    counted = expert_TK[:, :1] if kind == "gshard" else expert_TK
    counted = counted.reshape(-1)    # scatter_add, not bincount: bincount reads its input's maximum back
    fraction_E = probs_TE.new_zeros(num_experts).scatter_add_(0, counted, torch.ones_like(counted, dtype=probs_TE.dtype))
    fraction_E = fraction_E / counted.numel()
    return num_experts * torch.dot(probs_TE.mean(0), fraction_E)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    if logits_TE.shape[0] == 0:
        return logits_TE.new_zeros(())
    return torch.logsumexp(logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)), dim=-1).square().mean()
