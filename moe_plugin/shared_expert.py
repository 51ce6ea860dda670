"""The shared expert: one dense FFN applied to every token beside the routed experts (DeepSeek's
shared experts, Qwen2-MoE's gated shared expert).

Shape legend: moe_plugin/__init__.py (here H is the shared expert's hidden width). With a gated activation w1_DH
holds 2H columns: [gate | up]. The activation is the routed experts' (with its limit unless config.clamp_shared is False).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .activations import first_width, forward, of_config
from .config import MoEConfig


class SharedExpert(nn.Module):
    """y = act(x w1 + b1) w2 + b2, times sigmoid(x . gate_D) per token when config.shared_gate.

    init_std: None draws every tensor uniform in +-1/sqrt(fan_in); a float draws w1, w2 and gate_D
    normal(0, init_std) and zeros the biases (Hugging Face's _init_weights of its Linears; set by
    swap_moe_blocks)."""

    init_std: Optional[float] = None

    def __init__(self, config: MoEConfig):
        super().__init__()
        D, H = config.model_dim, config.shared_hidden_size
        self.activation = of_config(config, shared=True)
        self.w1_DH = nn.Parameter(torch.empty(D, first_width(config.activation, H)))
        self.w2_HD = nn.Parameter(torch.empty(H, D))
        self.b1_H = nn.Parameter(torch.empty(self.w1_DH.shape[1])) if config.bias else None
        self.b2_D = nn.Parameter(torch.empty(D)) if config.bias else None
        self.gate_D = nn.Parameter(torch.empty(D)) if config.shared_gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        D, H = self.w2_HD.shape[1], self.w2_HD.shape[0]
        with torch.no_grad():
            for tensor, fan_in, is_bias in [(self.w1_DH, D, False), (self.b1_H, D, True), (self.w2_HD, H, False),
                                            (self.b2_D, H, True), (self.gate_D, D, False)]:
                if tensor is None:
                    continue
                if self.init_std is None:
                    tensor.uniform_(-1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))
                elif is_bias:
                    tensor.zero_()
                else:
                    tensor.normal_(0.0, self.init_std)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h_TH = forward(F.linear(x_TD, self.w1_DH.t(), self.b1_H), self.activation)
        y_TD = F.linear(h_TH, self.w2_HD.t(), self.b2_D)
        if self.gate_D is not None:
            y_TD = y_TD * torch.sigmoid(x_TD @ self.gate_D).unsqueeze(-1)
        return y_TD
