"""A small decoder-only transformer LM whose FFN is an MoELayer in every `moe_every`-th block.

Legend: B batch, S sequence, D model dim, N attention heads, d head dim, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from ...config import MoEConfig
from ...layer import MoELayer


@dataclass
class ModelConfig:
    dim: int = 128               # D, also the MoE layers' model_dim
    layers: int = 4
    heads: int = 4
    seq_len: int = 128           # tokens per training row (the learned position table's size)
    ffn_hidden: int = 512        # hidden width of the dense FFN blocks
    moe_every: int = 2           # block i (from 1) has an MoE FFN when i % moe_every == 0
    tie_embeddings: bool = True  # the output projection reuses the token embedding


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        qkv_3BNSd = self.qkv(x_BSD).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y_BNSd = F.scaled_dot_product_attention(qkv_3BNSd[0], qkv_3BNSd[1], qkv_3BNSd[2], is_causal=True)
        return self.out(y_BNSd.transpose(1, 2).reshape(B, S, D))


class DenseFFN(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x_BSD)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn: nn.Module):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg.dim, cfg.heads)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.ffn = ffn

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class TransformerLM(nn.Module):
    """forward(x_BS token ids) -> logits_BSV. The MoE layers' aux losses: moe_plugin.aux_loss(model)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, vocab_size: int):
        super().__init__()
        if moe.model_dim != cfg.dim:
            raise ValueError(f"MoEConfig.model_dim={moe.model_dim} must equal model.dim={cfg.dim}")
        self.cfg = cfg
        self.token_embedding = nn.Embedding(vocab_size, cfg.dim)
        self.position_embedding = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(
            Block(cfg, MoELayer(moe) if i % cfg.moe_every == 0 else DenseFFN(cfg.dim, cfg.ffn_hidden))
            for i in range(1, cfg.layers + 1))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, vocab_size, bias=False)
        self._init_dense()

    def reset_parameters(self) -> None:
        """Draws every parameter and buffer as construction does: for a model built on the meta device,
        after to_empty (the MoE layers re-draw their experts, the norms reset, the rest normal(0, 0.02))."""
        for module in self.modules():
            if isinstance(module, (MoELayer, nn.LayerNorm)):
                module.reset_parameters()
        self._init_dense()

    def _init_dense(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def moe_layers(self) -> List[MoELayer]:
        return [block.ffn for block in self.blocks if isinstance(block.ffn, MoELayer)]

    def forward(self, x_BS: torch.Tensor) -> torch.Tensor:
        S = x_BS.shape[1]
        if S > self.cfg.seq_len:
            raise ValueError(f"sequence of {S} tokens is longer than model.seq_len={self.cfg.seq_len}")
        h_BSD = self.token_embedding(x_BS) + self.position_embedding(torch.arange(S, device=x_BS.device))
        for block in self.blocks:
            h_BSD = block(h_BSD)
        h_BSD = self.norm(h_BSD)
        weight_VD = self.token_embedding.weight if self.head is None else self.head.weight
        return h_BSD @ weight_VD.t()
