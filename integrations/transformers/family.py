"""What a Hugging Face MoE family entry is made of: the Family record, the WeightMap helpers that map
an HF block's tensors to the MoELayer's and back, and the MoEConfig fields every family shares.
The entries themselves are in families.py (and families_special.py).

Legend: E experts, D model dim, H expert hidden dim, S shared expert hidden dim.
HF keeps routed experts as gate_up_proj [E, 2H, D] (rows [gate | up]) and down_proj [E, D, H];
the layer keeps w1_EDH [E, D, 2H] (columns [gate | up]) and w2_EHD [E, H, D]. The shared expert is
an HF MLP of three Linears (gate_proj, up_proj [S, D], down_proj [D, S]); ours is w1_DH [D, 2S]
(columns [gate | up]) and w2_HD [S, D]; Qwen2-MoE's shared gate Linear(D, 1) is our gate_D [D].
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

# HF hidden_act of a gated MLP -> our activation (ACT2FN: "gelu" is the exact erf GELU, "gelu_pytorch_tanh" the tanh one)
ACTIVATIONS = {"silu": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh"}


@dataclass(frozen=True)
class WeightMap:
    """One tensor of the layer and the HF tensor(s) it is made of; to_layer and to_hf invert each other."""
    layer: str
    hf: Tuple[str, ...]
    to_layer: Callable[..., torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tuple[torch.Tensor, ...]]
    optional: bool = False   # the HF block holds it only under some configs (a shared expert, a bias)
    by_expert: bool = False  # to_layer takes num_experts= too (HF's tensor does not show it: DBRX's flat experts)

    def maybe(self) -> "WeightMap":
        return dataclasses.replace(self, optional=True)


def same(layer: str, hf: str) -> WeightMap:
    return WeightMap(layer, (hf,), lambda t: t, lambda t: (t,))


def transposed(layer: str, hf: str) -> WeightMap:
    """The last two dimensions swapped: HF's [out, in] (per expert) against our [in, out]."""
    return WeightMap(layer, (hf,), lambda t: t.transpose(-1, -2), lambda t: (t.transpose(-1, -2),))


def gate_and_up(layer: str, gate: str, up: str) -> WeightMap:
    """Two HF Linear weights [S, D] against one [D, 2S] = [gate | up] columns."""
    return WeightMap(layer, (gate, up), lambda g, u: torch.cat([g.t(), u.t()], dim=1),
                     lambda t: tuple(half.t() for half in t.chunk(2, dim=1)))


def routed_experts(router: str = "gate.weight", experts: str = "experts") -> Tuple[WeightMap, ...]:
    return (same("router.weight_ED", router),
            transposed("experts.w1_EDH", f"{experts}.gate_up_proj"),
            transposed("experts.w2_EHD", f"{experts}.down_proj"))


def stacked_experts(router: str, experts: str = "experts") -> Tuple[WeightMap, ...]:
    """Experts already in our layout (Aria): gate_up_proj [E, D, 2H] ([gate | up] columns), down_proj [E, H, D]."""
    return (same("router.weight_ED", router), same("experts.w1_EDH", f"{experts}.gate_up_proj"),
            same("experts.w2_EHD", f"{experts}.down_proj"))


def flat_experts(router: str, experts: str) -> Tuple[WeightMap, ...]:
    """DBRX: w1 (gate), v1 (up) and w2 (down), each [E*H, D], expert e in rows e*H .. (e+1)*H."""
    def to_layer(w1, v1, num_experts):
        return torch.cat([w1.reshape(num_experts, -1, w1.shape[-1]).transpose(1, 2),
                          v1.reshape(num_experts, -1, v1.shape[-1]).transpose(1, 2)], dim=2)

    def to_hf(w1_EDH):
        return tuple(half.transpose(1, 2).reshape(-1, half.shape[1]) for half in w1_EDH.chunk(2, dim=2))

    return (same("router.weight_ED", router),
            WeightMap("experts.w1_EDH", (f"{experts}.w1", f"{experts}.v1"), to_layer, to_hf, by_expert=True),
            WeightMap("experts.w2_EHD", (f"{experts}.w2",),
                      lambda w2, num_experts: w2.reshape(num_experts, -1, w2.shape[-1]),
                      lambda w2_EHD: (w2_EHD.reshape(-1, w2_EHD.shape[-1]),), by_expert=True))


def shared_mlp(hf: str) -> Tuple[WeightMap, ...]:
    return (gate_and_up("shared_expert.w1_DH", f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
            transposed("shared_expert.w2_HD", f"{hf}.down_proj.weight"))


def row(layer: str, hf: str) -> WeightMap:
    """HF's Linear(D, 1) weight [1, D] against our vector [D]."""
    return WeightMap(layer, (hf,), lambda t: t.reshape(-1), lambda t: (t.reshape(1, -1),))


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str                                   # the modeling module holding the block class
    block: str                                    # the sparse-MoE block class in it
    moe_config: Callable[[Any], Dict[str, Any]]   # HF config -> MoEConfig fields
    weights: Tuple[WeightMap, ...]
    jitter_noise: Callable[[Any], float] = lambda config: 0.0   # Mixtral's input jitter in training
    returns_tuple: bool = False   # the HF block returns (output, router scores) (gpt-oss, Llama 4): ours (output, None)
    swaps: Callable[[Any], bool] = lambda hf_block: True   # which blocks of the class (DeepSeek-V4: not hash-routed)
    # No block (Gemma 4): `block` names the decoder layer, which holds `router` and `experts` and calls them itself;
    # the weights are named from it. The HFMoEBlock replaces `experts`, a RouterInputTap `router` (block.py).
    in_decoder: bool = False

    def block_class(self) -> type:
        import importlib
        return getattr(importlib.import_module(self.module), self.block)


def activation(config, key: str = "hidden_act", value: Any = None) -> str:
    """Our activation for the HF config's activation setting (config.<key>, or value when given)."""
    act = getattr(config, key) if value is None else value
    if act not in ACTIVATIONS:
        raise ValueError(f"{config.model_type}: {key}={act!r} is not supported by the MoE layer; "
                         f"supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def family(model_type: str, block: str, moe_config, weights, module: Optional[str] = None, **options) -> "Family":
    """The entry of a family whose blocks are class `block` of transformers.models.<module>.modeling_<module>
    (module: the model_type by default)."""
    module = module or model_type
    return Family(model_type, f"transformers.models.{module}.modeling_{module}", block, moe_config, weights, **options)


def unsupported(config, key: str, value: Any, allowed: str) -> ValueError:
    """The error for an HF config value the layer cannot compute (raise it)."""
    return ValueError(f"{config.model_type}: {key}={value!r} is not supported by the MoE layer; supported: {allowed}")


def _common(config, hidden_size: int, num_experts: int, normalize: bool, top_k: Any = None,
            model_dim: Any = None, act: Any = None) -> Dict[str, Any]:
    """What every family shares: dropless, no expert biases, no balance loss of the layer's own
    (the HF model computes its aux loss from the recorded router logits)."""
    return dict(model_dim=model_dim or config.hidden_size, hidden_size=hidden_size, num_experts=num_experts,
                top_k=config.num_experts_per_tok if top_k is None else top_k, router="softmax",
                normalize_gate="before_drop" if normalize else "none",
                activation=act or activation(config), bias=False, capacity_factor=0.0, aux_loss="none",
                aux_loss_coef=0.0)
