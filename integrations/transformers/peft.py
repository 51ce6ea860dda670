"""PEFT's LoRA on Hugging Face's experts, read by the "moe_plugin" experts backend (experts_backend.py).

PEFT (>= 0.17) adapts a 3-D expert tensor with `LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])`: its ParamWrapper registers, for the duration of each forward, a parametrization on the
experts' parameter whose value is the merged weight W + s * lhs @ rhs (PEFT 0.21: `_LoraFactorsProxy`, for one
active adapter on an fp32/fp16-or-wider stack of several experts). Reading the parameter would form that merged
weight; the backend reads the stored W and the factors instead (factors() below) and adds the low-rank term on
the routed rows with grouped GEMMs. Any other PEFT state (several adapters, a merged-delta proxy, a
parametrization of some other library) is left as PEFT made it: the backend then reads the parameter as before.

Legend: E experts, I input dim, O output dim (of the projection x -> x W), Q LoRA rank.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

PROXY = "_LoraFactorsProxy"     # peft.tuners.lora.layer's class, matched by name: peft need not be imported here


def factors(experts: nn.Module, name: str, transposed: bool
            ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(W, a, b) for experts' parameter name under PEFT's LoRA, in the layer's orientation: W the stored weight
    ([E, O, I] unless transposed, then [E, I, O]); a [E, I, Q] and b [E, Q, O] (b times PEFT's scale) with
    x (W' + a b) = x W' + (x a) b, W' the weight as [E, I, O]. None when name carries no single LoRA factors proxy."""
    parametrizations = getattr(experts, "parametrizations", None)
    if parametrizations is None or name not in parametrizations:
        return None
    chain = parametrizations[name]
    if len(chain) != 1 or type(chain[0]).__name__ != PROXY:
        return None
    proxy = chain[0]
    lhs, rhs = proxy.lhs, proxy.rhs           # the delta in the stored orientation is lhs @ rhs
    a, b = (lhs, rhs) if transposed else (rhs.transpose(1, 2), lhs.transpose(1, 2))
    return chain.original, a.contiguous(), (b * proxy.scaling).contiguous()


def from_peft(lora_A: torch.Tensor, lora_B: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ParamWrapper weights of one expert projection (lora_A [Q*E, I], lora_B [O, Q*E], whatever the stored
    layout) -> the layer's (a [E, I, Q], b [E, Q, O]), unscaled: x W + s (x a) b is what PEFT computes (the columns
    of O in the stored projection's order)."""
    a = lora_A.reshape(num_experts, -1, lora_A.shape[-1]).transpose(1, 2)
    b = lora_B.reshape(lora_B.shape[0], -1, num_experts).permute(2, 1, 0)
    return a.contiguous(), b.contiguous()


def to_peft(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of from_peft: (lora_A [Q*E, I], lora_B [O, Q*E])."""
    E, I, Q = a.shape
    lora_A = a.transpose(1, 2).reshape(E * Q, I)
    lora_B = b.permute(2, 1, 0).reshape(b.shape[2], Q * E)
    return lora_A.contiguous(), lora_B.contiguous()
