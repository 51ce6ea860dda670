"""A small MoE transformer LM built with DeepSpeed's native MoE layers, and a synthetic task for it.

Used by examples/deepspeed/train_moe.py, benchmarks/bench_deepspeed.py and the tests: the model is
always built native; moe_plugin.integrations.deepspeed.initialize swaps its MoE layers when the
config's "moe.backend" is "tutel".

Legend: B batch, S sequence, D model dim, V vocabulary.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from deepspeed.moe.layer import MoE as NativeMoE

# routing settings of a native layer when the "moe" section leaves them out (DeepSpeed's defaults,
# except the two random ones, which moe_plugin's layer does not have)
NATIVE_DEFAULTS = dict(num_experts=4, ep_size=1, top_k=1, capacity_factor=1.0, eval_capacity_factor=1.0,
                       min_capacity=4, drop_tokens=True)


class MoEFFN(nn.Module):
    """An MoE layer as a transformer FFN: forward(x) -> y; .l_aux holds the layer's last l_aux."""

    def __init__(self, dim: int, hidden: int, moe: Mapping[str, Any], seed: int):
        super().__init__()
        settings = {**NATIVE_DEFAULTS, **{k: v for k, v in moe.items() if k in NATIVE_DEFAULTS}}
        expert = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.moe = NativeMoE(dim, expert, num_experts=settings["num_experts"], ep_size=settings["ep_size"],
                             k=settings["top_k"], capacity_factor=settings["capacity_factor"],
                             eval_capacity_factor=settings["eval_capacity_factor"],
                             min_capacity=settings["min_capacity"], drop_tokens=settings["drop_tokens"],
                             use_rts=False, top2_2nd_expert_sampling=False)
        # DeepSpeed deep-copies one expert; draw each from its own seed (global expert id), whatever the ep_size
        first = _expert_parallel_rank(settings["ep_size"]) * self.moe.num_local_experts
        for i, local in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            generator = torch.Generator().manual_seed(seed * 1000 + first + i)
            for linear in (local[0], local[2]):
                bound = 1.0 / math.sqrt(linear.in_features)
                for tensor in (linear.weight, linear.bias):
                    with torch.no_grad():
                        tensor.copy_(torch.empty(tensor.shape).uniform_(-bound, bound, generator=generator))
        self.l_aux = torch.zeros(())

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        y_BSD, self.l_aux, _ = self.moe(x_BSD)
        return y_BSD


def _expert_parallel_rank(ep_size: int) -> int:
    if ep_size == 1:
        return 0
    if not torch.distributed.is_initialized():
        raise ValueError(f"ep_size={ep_size} needs torch.distributed initialized before the model is built")
    return torch.distributed.get_rank() % ep_size   # DeepSpeed's default groups: consecutive ranks


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: nn.Module):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.ffn = ffn

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.attn_norm(x_BSD)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn_BSD = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D)
        x_BSD = x_BSD + self.out(attn_BSD)
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class MoETransformerLM(nn.Module):
    """forward(tokens_BS) -> logits_BSV; every block's FFN is an MoE layer. .l_aux(): their sum."""

    def __init__(self, moe: Mapping[str, Any], vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2,
                 hidden: int = 64, seq_len: int = 32, seed: int = 0):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.position_embedding = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, MoEFFN(dim, hidden, moe, seed + i)) for i in range(layers))
        self.norm = nn.LayerNorm(dim)
        for embedding in (self.token_embedding, self.position_embedding):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        positions_S = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
        x_BSD = self.token_embedding(tokens_BS) + self.position_embedding(positions_S)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.norm(x_BSD) @ self.token_embedding.weight.t()

    def l_aux(self) -> torch.Tensor:
        return sum(block.ffn.l_aux for block in self.blocks)


def synthetic_batch(generator: torch.Generator, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Rows of an affine sequence t[i+1] = (a t[i] + c) mod V with a random start and (a, c) from four
    pairs: the next token follows from the last two, so the loss can fall well below log(V)."""
    pairs = torch.tensor([[1, 1], [1, 3], [3, 1], [5, 7]])
    a_c = pairs[torch.randint(0, len(pairs), (batch,), generator=generator)]
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for i in range(seq_len):
        tokens[:, i + 1] = (a_c[:, 0] * tokens[:, i] + a_c[:, 1]) % vocab
    return tokens


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits_BSV = model(tokens[:, :-1])
    return F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), tokens[:, 1:].reshape(-1))
