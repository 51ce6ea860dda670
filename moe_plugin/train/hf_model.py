"""A Hugging Face MoE architecture as the model of `moe-plugin train` (the `hf` section).

The `hf` section is an HF config (model_type and its fields); the model is that architecture with
fresh random weights (no download), its sparse-MoE blocks swapped for MoELayers by
moe_plugin.integrations.transformers. transformers is imported only here, and only when `hf` is set.

With `hf` set: vocab_size is the data's (256 bytes), max_position_embeddings defaults to
model.seq_len; the model section gives only seq_len. The HF config fixes the MoE architecture
(model_dim, hidden_size, num_experts, top_k, router, gate normalization, activation, shared expert,
groups, route scale); the moe section's other keys (capacity_factor, aux_loss, aux_loss_coef,
expert_bias_update_rate, parallel, ...) apply, and parallel.ep_size spreads the experts.

A dense causal LM (hf.model_type llama, qwen2, mistral, ...: any AutoModelForCausalLM type that is no MoE
family) trains as it is, with no MoE layer, or, with an `upcycle` section, sparsely upcycled
(moe_plugin.integrations.transformers.upcycle): its dense MLPs in the chosen layers become MoE blocks of
moe.num_experts experts (top moe.top_k), each a copy of the MLP, after loading the dense run named by
upcycle.checkpoint (see load_dense). The dense MLP fixes model_dim, hidden_size, activation and bias.

Legend: B batch rows, S sequence length, V vocabulary.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, List

import torch
from torch import nn

from .. import checkpoint as sharded
from ..config import MoEConfig, gate_normalization
from ..layer import MoELayer
from ..lora import add_lora, merge_lora, unmerge_lora
from .checkpoint import checkpoints, full_state_dict, load_full_state_dict, read_meta, verify
from .config import DEFAULT_MOE, ParallelConfig
from .data import VOCAB_SIZE

# moe-section keys whose value describes the routing in the HF model too (the HF config sets them)
FREE_KEYS = ("capacity_factor", "aux_loss", "aux_loss_coef", "expert_bias_update_rate")


def hf_adapter():
    """The transformers adapter (it imports transformers, an optional dependency: only when an hf section is set)."""
    import moe_plugin.integrations.transformers as hf_moe   # optional: needs transformers; hides torchaudio first
    return hf_moe


def upcycle_module():
    """The module (the package's `upcycle` is the function)."""
    hf_adapter()
    return importlib.import_module("moe_plugin.integrations.transformers.upcycle")


def hf_config(cfg):
    """The transformers config of the `hf` section; ValueError naming the key on a bad one."""
    hf_moe = hf_adapter()
    import transformers
    values: Dict[str, Any] = dict(cfg.hf)
    model_type = values.pop("model_type", None)
    dense_types = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if model_type not in hf_moe.FAMILIES and model_type not in dense_types:
        raise ValueError(f"hf.model_type={model_type!r} is invalid: must be a Hugging Face MoE family ("
                         f"{', '.join(sorted(hf_moe.FAMILIES))}) or a dense causal LM type (llama, qwen2, "
                         f"mistral, ...; with an upcycle section to make it MoE)")
    if model_type in hf_moe.FAMILIES and cfg.upcycle is not None:
        raise ValueError(f"upcycle is invalid with hf.model_type={model_type!r}: that model has MoE blocks already; "
                         f"upcycle a dense model_type (llama, qwen2, mistral, ...) or leave the upcycle section out")
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
    hf_moe = hf_adapter()
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


def is_dense(config) -> bool:
    return hf_adapter().family_of(config) is None


def upcycle_arguments(cfg, mlp_keys: str = "hf.hidden_size, hf.intermediate_size, hf.hidden_act, hf.mlp_bias"
                      ) -> Dict[str, Any]:
    """upcycle()'s arguments from the upcycle and moe sections. A moe key the dense MLP fixes (hidden_size,
    activation, bias) set in the YAML (not the built-in default) is an error naming mlp_keys, the hf keys
    that set them instead."""
    up = cfg.upcycle
    arguments = {"every": up.every, "layers": up.layers, "noise": up.noise, "reinit_fraction": up.reinit_fraction,
                 "ep_size": cfg.parallel.ep_size}
    for key, value in cfg.moe.items():
        if key in upcycle_module().FIXED_BY_MLP:
            if key not in DEFAULT_MOE or value != DEFAULT_MOE[key]:
                raise ValueError(f"moe.{key}={value!r} is invalid with upcycle: the dense MLPs of the hf model fix it "
                                 f"({mlp_keys}); leave it out")
            continue
        arguments[key] = value
    return arguments


def hf_moe_configs(cfg) -> List[MoEConfig]:
    """The MoEConfig of every MoE layer the hf section (and upcycle section) gives (what check_config checks):
    an MoE family's, the upcycled layers' of a dense model, none for a dense model trained as it is."""
    config = hf_config(cfg)
    if not is_dense(config):
        return [_family_moe_config(cfg, config)]
    if cfg.upcycle is None:
        if cfg.moe != DEFAULT_MOE or cfg.parallel.ep_size != 1:
            raise ValueError(f"the moe section and parallel.ep_size apply to no layer of the dense hf model "
                             f"({config.model_type}): add an upcycle section to make it MoE, or leave them out")
        return []
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    arguments = upcycle_arguments(cfg)
    for key in ("noise", "reinit_fraction"):
        arguments.pop(key)
    arguments.update(num_experts=arguments.pop("num_experts", 8), top_k=arguments.pop("top_k", 2))
    try:
        return [moe for *_, moe in upcycle_module().plan(model, **arguments)]
    except (ValueError, TypeError) as error:
        raise ValueError(f"upcycle/moe section: {error}") from None


def hf_moe_config(cfg) -> MoEConfig:
    """The MoEConfig the MoE layers run (--print-config shows it): an MoE family's swapped blocks', the first
    upcycled layer's of a dense model; the moe section as given for a dense model trained as it is."""
    config = hf_config(cfg)
    if not is_dense(config):
        return _family_moe_config(cfg, config)
    configs = hf_moe_configs(cfg)
    return configs[0] if configs else MoEConfig.from_dict({**cfg.moe, "model_dim": config.hidden_size})


def _family_moe_config(cfg, config) -> MoEConfig:
    try:
        return hf_adapter().moe_config(config, **swap_overrides(cfg, config))
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
    hf_moe = hf_adapter()
    # plain blocks: the trainer runs its own data and expert parallelism, whatever hosts are installed
    lora = getattr(cfg, "lora", None)
    start = None if lora is None else lora.checkpoint
    if not is_dense(config):
        from pathlib import Path
        hf_folder = start is not None and (Path(start) / "config.json").is_file()
        if hf_folder:                # an MoE run's hf_model/: HF's own names, before the swap
            load_dense(model, start, key="lora.checkpoint", what="an MoE run of this hf section")
        hf_moe.swap_moe_blocks(model, block_class=hf_moe.HFMoEBlock, **swap_overrides(cfg, config))
        if start is not None and not hf_folder:    # an MoE run's checkpoint: the swapped model's tensors
            state = run_state(start, "lora.checkpoint")
            try:
                load_full_state_dict(model, state)     # every expert: each rank keeps its share
            except RuntimeError as error:
                raise ValueError(f"lora.checkpoint={start!r} does not fit the hf section's model: "
                                 f"{str(error).splitlines()[-1].strip()} (a run of another hf config?)") from None
    elif cfg.upcycle is not None:
        dense = cfg.upcycle.checkpoint if start is None else start
        if dense is not None:
            load_dense(model, dense, key="upcycle.checkpoint" if start is None else "lora.checkpoint")
        arguments = upcycle_arguments(cfg)
        hf_moe.upcycle(model, arguments.pop("num_experts", 8), arguments.pop("top_k", 2),
                       block_class=hf_moe.HFMoEBlock, **arguments)
    if lora is not None:
        if not any(isinstance(m, MoELayer) for m in model.modules()):
            raise ValueError("lora is invalid for a dense hf model trained as it is: it adapts MoE experts (add an "
                             "upcycle section, or use an MoE model_type)")
        model.requires_grad_(False)
        add_lora(model, lora.rank, lora.alpha, lora.targets)
    return HFCausalLM(model)


def load_dense(model: nn.Module, where: str, auto_class: str = "AutoModelForCausalLM", key: str = "upcycle.checkpoint",
               what: str = "a dense run") -> None:
    """The dense run's weights into model (the HF model of the same hf section): where is the run's out_dir (its
    newest checkpoint), a checkpoint folder (checkpoints/step_N) or an HF folder (the run's hf_model/, read by
    transformers' auto_class)."""
    from pathlib import Path
    path = Path(where)
    if (path / "config.json").is_file():
        import transformers
        state = getattr(transformers, auto_class).from_pretrained(path).state_dict()
    else:
        state = run_state(where, key)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in (getattr(model, "_tied_weights_keys", None) or {})]
    if missing or unexpected:
        raise ValueError(f"{key}={where!r} does not fit the hf section's model: it lacks {missing[:4]}, "
                         f"holds {unexpected[:4]} (a run of another hf config, or not {what})")


def run_state(where: str, key: str) -> Dict[str, torch.Tensor]:
    """The HF model's tensors of a run of `moe-plugin train`: where is its out_dir (the newest whole checkpoint) or a
    checkpoint folder."""
    from pathlib import Path
    path = Path(where)
    if (path / "checkpoints").is_dir() and checkpoints(path):   # the newest whole one
        path = next((p for p in reversed(checkpoints(path)) if verify(p) is None), checkpoints(path)[-1])
    try:
        read_meta(path)
        problem = verify(path)
        if problem is not None:
            raise ValueError(f"the checkpoint is damaged: {problem}")
    except ValueError as error:
        raise ValueError(f"{key}={where!r} is invalid: {error} (give the run's out_dir, a "
                         f"checkpoint folder or an HF folder)") from None
    return _model_state(path)


def _model_state(path) -> Dict[str, torch.Tensor]:
    """The HF model's tensors of a checkpoint of `moe-plugin train` (read by this one process)."""
    prefix = "model.hf."
    return {key[len(prefix):]: tensor for key, tensor in sharded.full_state(path).items() if key.startswith(prefix)}


def export_hf_model(model: HFCausalLM, directory, cfg=None) -> None:
    """The trained model as an HF folder: AutoModelForCausalLM.from_pretrained(directory) loads it (unswapped).
    Under expert parallelism every process must call it; rank 0 writes. An FSDP2-sharded model (parallel.fsdp,
    cfg needed) is gathered whole by every process, and rank 0 exports it from an unsharded copy."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(model, FSDPModule):
        return _export(model.hf, directory)
    import dataclasses
    import torch.distributed as dist
    state = full_state_dict(model)   # a collective
    if dist.get_rank() == 0:
        plain = build_hf_model(dataclasses.replace(cfg, parallel=ParallelConfig(ep_size=1)))
        plain.load_state_dict(state)
        _export(plain.hf, directory)   # it ends with a barrier over the world
    else:
        dist.barrier()


def _export(hf: nn.Module, directory) -> None:
    """export_hf; a dense model (trained as it is) with its own save_pretrained. Rank 0 writes, then a barrier."""
    if any(isinstance(m, MoELayer) for m in hf.modules()):
        adapted = any(getattr(m.experts, "lora", None) is not None for m in hf.modules() if isinstance(m, MoELayer))
        if adapted:     # the fine-tuned weights W + s A B, as plain HF experts
            merge_lora(hf)
        try:
            hf_adapter().export_hf(hf, directory)
        finally:
            if adapted:
                unmerge_lora(hf)
        return
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        hf.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()
