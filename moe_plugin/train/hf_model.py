"""A Hugging Face MoE architecture as the model of `moe-plugin train` (the `hf` section).

The `hf` section is an HF config (model_type and its fields); the model is that architecture with
fresh random weights (no download), its sparse-MoE blocks swapped for MoELayers by
moe_plugin.integrations.transformers. transformers is imported only here, and only when `hf` is set.

With `hf` set: vocab_size is the data's (256 bytes), max_position_embeddings defaults to
model.seq_len; the model section gives only seq_len. The HF config fixes the MoE architecture
(model_dim, hidden_size, num_experts, top_k, router, gate normalization, activation, shared expert,
groups, route scale); the moe section's other keys (capacity_factor, aux_loss, aux_loss_coef,
expert_bias_update_rate, parallel, ...) apply, and parallel.ep_size spreads the experts.

Legend: B batch rows, S sequence length, V vocabulary.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from ..config import MoEConfig, gate_normalization
from ..data import VOCAB_SIZE
from ..layer import MoELayer

# moe-section keys whose value describes the routing in the HF model too (the HF config sets them)
FREE_KEYS = ("capacity_factor", "aux_loss", "aux_loss_coef", "expert_bias_update_rate")


def _integration():
    import moe_plugin.integrations.transformers as hf_moe   # hides an unloadable torchaudio first
    return hf_moe


def hf_config(cfg):
    """The transformers config of the `hf` section; ValueError naming the key on a bad one."""
    hf_moe = _integration()
    import transformers
    values: Dict[str, Any] = dict(cfg.hf)
    model_type = values.pop("model_type", None)
    if model_type not in hf_moe.FAMILIES:
        raise ValueError(f"hf.model_type={model_type!r} is invalid: must be one of "
                         f"{', '.join(sorted(hf_moe.FAMILIES))} (a Hugging Face MoE family)")
    if values.setdefault("vocab_size", VOCAB_SIZE) != VOCAB_SIZE:
        raise ValueError(f"hf.vocab_size={values['vocab_size']!r} is invalid: the data are bytes, so it must be "
                         f"{VOCAB_SIZE} (or left out)")
    values.setdefault("max_position_embeddings", cfg.model.seq_len)
    if values["max_position_embeddings"] < cfg.model.seq_len:
        raise ValueError(f"hf.max_position_embeddings={values['max_position_embeddings']} is invalid: must be >= "
                         f"model.seq_len={cfg.model.seq_len}")
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"hf section ({model_type}): {error}") from None


def swap_overrides(cfg, config) -> Dict[str, Any]:
    """The moe section as swap_moe_blocks overrides. A key that the HF config fixes is left out; one
    set in the YAML (not the built-in default) to another value than the HF config's is an error."""
    from .config import DEFAULT_MOE
    hf_moe = _integration()
    fixed = set(hf_moe.require_family(config).moe_config(config)) - set(FREE_KEYS)
    base = hf_moe.moe_config(config).to_dict()
    overrides = {"ep_size": cfg.parallel.ep_size}
    for key, value in cfg.moe.items():
        if key not in fixed:
            overrides[key] = value
            continue
        user_set = key not in DEFAULT_MOE or value != DEFAULT_MOE[key]
        if key == "normalize_gate":
            value = gate_normalization(value, base["top_k"])
        if user_set and value != base[key]:
            raise ValueError(f"moe.{key}={value!r} contradicts the hf section ({config.model_type} gives "
                             f"{key}={base[key]!r}); set it in the hf section")
    return overrides


def hf_moe_config(cfg) -> MoEConfig:
    """The MoEConfig of the swapped layers (what check_config checks)."""
    config = hf_config(cfg)
    try:
        return _integration().moe_config(config, **swap_overrides(cfg, config))
    except ValueError as error:
        raise ValueError(f"moe section: {error}") from None


class HFCausalLM(nn.Module):
    """forward(x_BS token ids) -> logits_BSV, as TransformerLM; .hf is the transformers model."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def moe_layers(self) -> List[MoELayer]:
        return [m for m in self.hf.modules() if isinstance(m, MoELayer)]

    def forward(self, x_BS: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x_BS, use_cache=False).logits


def build_hf_model(cfg) -> HFCausalLM:
    """The HF architecture of the `hf` section, random weights from the torch RNG, blocks swapped.
    Every process builds all the experts; under expert parallelism each keeps its share."""
    import transformers
    config = hf_config(cfg)
    model = transformers.AutoModelForCausalLM.from_config(config)
    hf_moe = _integration()
    # plain blocks: the trainer runs its own data and expert parallelism, whatever hosts are installed
    hf_moe.swap_moe_blocks(model, block_class=hf_moe.HFMoEBlock, **swap_overrides(cfg, config))
    return HFCausalLM(model)


def export_hf_model(model: HFCausalLM, directory, cfg=None) -> None:
    """The trained model as an HF folder: AutoModelForCausalLM.from_pretrained(directory) loads it (unswapped).
    Under expert parallelism every process must call it; rank 0 writes. An FSDP2-sharded model (parallel.fsdp,
    cfg needed) is gathered whole by every process, and rank 0 exports it from an unsharded copy."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        return _integration().export_hf(model.hf, directory)
    import dataclasses
    import torch.distributed as dist
    from .checkpoint import full_state_dict
    from .config import ParallelConfig
    state = full_state_dict(model)   # a collective
    if dist.get_rank() == 0:
        plain = build_hf_model(dataclasses.replace(cfg, parallel=ParallelConfig(ep_size=1)))
        plain.load_state_dict(state)
        _integration().export_hf(plain.hf, directory)   # it ends with a barrier over the world
    else:
        dist.barrier()
