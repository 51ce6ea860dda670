"""export_hf of an upcycled model (upcycle.py), and load_upcycled, the loader of its generic folders.

Where an HF MoE family has the upcycled model's architecture, the folder is that family's, which plain
`from_pretrained` loads with the same outputs:
  llama, mistral -> mixtral    every layer upcycled, no attention or MLP biases, softmax router with
                               normalized top-k gates;
  qwen2 -> qwen2_moe           any layers (the others are its mlp_only_layers), no sliding window,
                               softmax router (norm_topk_prob = normalized gates); its shared expert
                               has width 0 (it adds nothing).
Anything else (vit, swinv2, a llama upcycled in some layers only, other router settings) is written as
the dense model's folder, whose MLPs hold the mean of their experts (at step 0 of an exact upcycling:
the dense MLP), plus moe_plugin_upcycle.json (upcycle's arguments and MoE settings) and
moe_plugin_experts.safetensors (every upcycled layer's MoELayer state, all experts). load_upcycled(folder)
rebuilds the MoE model from the two.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .writer import full_layer_state, write_folder
from .family import routed_experts
from .upcycle import ATTRIBUTE, is_upcycled, upcycle, upcycled_blocks

UPCYCLE_FILE = "moe_plugin_upcycle.json"
EXPERTS_FILE = "moe_plugin_experts.safetensors"
# fields a dense decoder config shares with the MoE family it maps to
DECODER_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
                  "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
                  "attention_dropout", "sliding_window", "use_sliding_window", "max_window_layers")
MOE_TARGETS = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe"}

__all__ = ["export_upcycled", "load_upcycled", "moe_family_target", "is_upcycled"]


def moe_family_target(model: nn.Module) -> Optional[str]:
    """The HF MoE model_type whose architecture the upcycled model has (see the module), or None."""
    record, config = getattr(model, ATTRIBUTE), model.config
    target = MOE_TARGETS.get(config.model_type)
    moe = upcycled_blocks(model)[0][2].moe.config
    routing_ok = (moe.router == "softmax" and moe.route_scale == 1.0 and moe.num_groups == 1
                  and moe.shared_hidden_size == 0 and moe.expert_bias_update_rate == 0 and not moe.bias
                  and moe.activation == "swiglu")
    if target is None or not routing_ok or any(kind != "gated" for _, kind in record["sites"]):
        return None
    if target == "mixtral":
        every_layer = len(record["layers"]) == config.num_hidden_layers
        plain = not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
        return target if every_layer and plain and moe.normalize_gate == "before_drop" else None
    return target if not getattr(config, "use_sliding_window", False) and moe.normalize_gate != "after_drop" else None


def _family_config(model: nn.Module, target: str):
    import transformers
    config, record = model.config, getattr(model, ATTRIBUTE)
    moe = upcycled_blocks(model)[0][2].moe.config
    shared = {k: getattr(config, k) for k in DECODER_FIELDS if getattr(config, k, None) is not None}
    if target == "mixtral":
        return transformers.MixtralConfig(**shared, intermediate_size=moe.hidden_size,
                                          num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                                          architectures=["MixtralForCausalLM"])
    layers = set(record["layers"])
    return transformers.Qwen2MoeConfig(
        **shared, intermediate_size=config.intermediate_size, moe_intermediate_size=moe.hidden_size,
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.normalize_gate != "none",
        shared_expert_intermediate_size=0, decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(config.num_hidden_layers) if i not in layers],
        architectures=["Qwen2MoeForCausalLM"])


def _check_dropless(model: nn.Module, target: Optional[str]) -> None:
    moe = upcycled_blocks(model)[0][2].moe.config
    if moe.capacity_factor != 0 or moe.eval_capacity_factor not in (None, 0):
        where = (f"the exported {target} folder computes the dropless output (HF's MoE families are dropless)"
                 if target is not None else "load_upcycled restores them from the folder, but plain "
                 "from_pretrained of it gives the dense model (each MLP the mean of its experts)")
        warnings.warn(f"export_hf: the model's MoE layers drop tokens over capacity (capacity_factor="
                      f"{moe.capacity_factor}, eval_capacity_factor={moe.eval_capacity_factor}); {where}",
                      stacklevel=3)


@torch.no_grad()
def export_upcycled(model: nn.Module, directory: Union[str, os.PathLike]) -> Path:
    """export_hf of an upcycled model: the MoE family's folder, or the dense folder with moe_plugin's expert
    files (see the module). Under expert parallelism every rank must call it; global rank 0 writes."""
    target = moe_family_target(model)
    _check_dropless(model, target)
    blocks = upcycled_blocks(model)
    layer_states = {name: full_layer_state(block) for name, _, block in blocks}   # a collective under EP
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return Path(directory)
    state = _outside_blocks(model, blocks)
    extra: Dict[str, Any] = {}
    if target is not None:
        config = _family_config(model, target)
        for name, layer_state in layer_states.items():
            for weights in routed_experts():
                for key, tensor in zip(weights.hf, weights.to_hf(layer_state[weights.layer])):
                    state[f"{name}.{key}"] = tensor.contiguous()
        import transformers
        model_class = getattr(transformers, config.architectures[0])
    else:
        config, model_class = model.config, type(model)
        for (name, kind, _), layer_state in zip(blocks, layer_states.values()):
            state.update({f"{name}.{key}": t for key, t in _mean_dense(kind, layer_state).items()})
        extra = {UPCYCLE_FILE: _record(model), EXPERTS_FILE: {f"{name}.{key}": t.contiguous()
                                                              for name, s in layer_states.items()
                                                              for key, t in s.items()}}
    _write(model_class, config, state, Path(directory), extra)
    if dist.is_initialized():
        dist.barrier()
    return Path(directory)


def _outside_blocks(model: nn.Module, blocks) -> Dict[str, torch.Tensor]:
    prefixes = tuple(f"{name}.intermediate." if kind == "pair" else f"{name}." for name, kind, _ in blocks)
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}


def _mean_dense(kind: str, layer_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The dense MLP's tensors (names relative to the site) holding the mean of the experts."""
    w1 = layer_state["experts.w1_EDH"].mean(0).t()
    w2 = layer_state["experts.w2_EHD"].mean(0).t()
    b1 = layer_state["experts.b1_EH"].mean(0) if "experts.b1_EH" in layer_state else None
    b2 = layer_state["experts.b2_ED"].mean(0) if "experts.b2_ED" in layer_state else None
    if kind == "gated":
        names = {"gate_proj": (w1.chunk(2)[0], None if b1 is None else b1.chunk(2)[0]),
                 "up_proj": (w1.chunk(2)[1], None if b1 is None else b1.chunk(2)[1]), "down_proj": (w2, b2)}
    elif kind == "plain":
        names = {"fc1": (w1, b1), "fc2": (w2, b2)}
    else:
        names = {"intermediate.dense": (w1, b1), "output.dense": (w2, b2)}
    out = {}
    for name, (weight, bias) in names.items():
        out[f"{name}.weight"] = weight.contiguous()
        if bias is not None:
            out[f"{name}.bias"] = bias.contiguous()
    return out


def _record(model: nn.Module) -> dict:
    record = dict(getattr(model, ATTRIBUTE))
    moe = upcycled_blocks(model)[0][2].moe.config.to_dict()
    for key in ("model_dim", "hidden_size", "num_experts", "top_k", "activation", "bias", "ep_size"):
        moe.pop(key)
    record.update(moe=moe, sites=[list(site) for site in record["sites"]], format=1)
    record.pop("moe_overrides")
    return record


def _write(model_class: type, config, state: Dict[str, torch.Tensor], directory: Path, extra: Dict[str, Any]) -> None:
    """model_class(config) holding state, saved (atomically) with the extra files."""
    with torch.device("meta"):
        fresh = model_class(config)
    for key, tensor in fresh.state_dict().items():   # qwen2_moe's width-0 shared expert: zeros (it adds nothing)
        if key not in state and ".shared_expert" in key:
            state[key] = torch.zeros(tensor.shape, dtype=next(iter(state.values())).dtype)
    write_folder(fresh, state, directory, extra)


def load_upcycled(directory: Union[str, os.PathLike], model_class: Optional[type] = None, **moe_overrides: Any):
    """The upcycled model of a folder export_hf wrote as the dense folder plus moe_plugin's expert files:
    model_class.from_pretrained(directory) (default: the class in its config.json's architectures), upcycled
    as it was, its MoE layers loaded from moe_plugin_experts.safetensors. moe_overrides: MoEConfig fields
    to change (ep_size under expert parallelism: every rank calls it and keeps its share of the experts).
    A folder of an HF MoE family (no moe_plugin_upcycle.json) loads with plain from_pretrained instead."""
    import transformers
    from safetensors.torch import load_file
    directory = Path(directory)
    if not (directory / UPCYCLE_FILE).is_file():
        raise ValueError(f"load_upcycled: {directory} has no {UPCYCLE_FILE}: not a folder of an upcycled model "
                         f"written by export_hf (an HF MoE family's folder loads with from_pretrained)")
    record = json.loads((directory / UPCYCLE_FILE).read_text())
    if model_class is None:
        config = transformers.AutoConfig.from_pretrained(directory)
        model_class = getattr(transformers, config.architectures[0])
    model = model_class.from_pretrained(directory)
    upcycle(model, record["num_experts"], record["top_k"], layers=record["layers"],
            **{**record["moe"], **moe_overrides})
    tensors = load_file(str(directory / EXPERTS_FILE))
    for name, _, block in upcycled_blocks(model):
        prefix = f"{name}."
        block.moe.load_full_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    getattr(model, ATTRIBUTE).update(noise=record["noise"], reinit_fraction=record["reinit_fraction"])
    return model
