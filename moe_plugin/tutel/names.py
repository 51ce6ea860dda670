"""Tutel's state-dict keys and layouts <-> MoELayer's, both ways, as pure functions on dicts of tensors.

Shape legend: moe_plugin/__init__.py (E experts, here one rank's, D model dim, H expert hidden dim), plus J the cosine
gate's projection width (Tutel's proj_dim).

One Tutel layer (keys relative to the layer)              MoELayer
    _num_global_experts  int64 []                         (none: checked against the experts)
    gates.N.wg.weight  [E, D]                             router.weight_ED  [E, D]
    gates.N.cosine_projector.weight  [J, D], .bias [J]    router.projector.weight, router.projector.bias
    gates.N.sim_matrix  [J, E]                            router.weight_ED  [E, J] (transposed)
    gates.N.temperature  [1]                              router.log_scale  []
    experts.batched_fc1_w  [E, H, D]                      experts.w1_EDH  [E, D, H] (transposed)
    experts.batched_fc2_w  [E, H, D]                      experts.w2_EHD  [E, H, D]
    experts.batched_fc1_bias  [E, H] (Swin-MoE: [E, 1, H])  experts.b1_EH
    experts.batched_fc2_bias  [E, D] (Swin-MoE: [E, 1, D])  experts.b2_ED
    experts.W_fc1, W_fc2  flat [E*D*H] (or [E, D, H])     experts.w1_EDH  [E, D, 2H] = [W_fc1 | W_fc2] (swiglu's
    experts.W_fc3  flat [E*H*D] (or [E, H, D])            experts.w2_EHD  [E, H, D]          [gate | up])
                                                          router.expert_bias_E  zeros [E_global] (Tutel has none)

A MoELayer has one router: a Tutel layer with several gates converts one of them (gate=N). Tutel's layers with an
expert sliced over ranks (fewer experts than ranks: sharded weights) are not handled here.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional

import torch

NUM_EXPERTS = "_num_global_experts"
FFN_KEYS = ("experts.batched_fc1_w", "experts.batched_fc2_w", "experts.batched_fc1_bias", "experts.batched_fc2_bias")
LLAMA_KEYS = ("experts.W_fc1", "experts.W_fc2", "experts.W_fc3")
TOP_GATE_KEYS = ("wg.weight",)
COSINE_GATE_KEYS = ("temperature", "sim_matrix", "cosine_projector.weight", "cosine_projector.bias")
_GATE_KEY = re.compile(r"gates\.(\d+)\.(.+)")

Tensors = Dict[str, torch.Tensor]


def is_tutel_layer(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether state (keys relative to one layer) holds a Tutel MoE layer's experts."""
    return "experts.batched_fc1_w" in state or "experts.W_fc1" in state


def tutel_layer_prefixes(state: Mapping[str, torch.Tensor]) -> List[str]:
    """The prefixes ("" or ending in ".") of every Tutel MoE layer in a model's state dict, in key order."""
    prefixes = []
    for key in state:
        for leaf in ("experts.batched_fc1_w", "experts.W_fc1"):
            if key.endswith(leaf) and (key == leaf or key[-len(leaf) - 1] == "."):
                prefixes.append(key[:-len(leaf)])
    return prefixes


def gate_indices(state: Mapping[str, torch.Tensor]) -> List[int]:
    """The N of every gates.N.* key, sorted."""
    return sorted({int(match.group(1)) for match in map(_GATE_KEY.fullmatch, state) if match})


def tutel_to_moe(state: Mapping[str, torch.Tensor], gate: Optional[int] = None,
                 num_global_experts: Optional[int] = None, num_local_experts: Optional[int] = None) -> Tensors:
    """One Tutel layer's state (keys relative to the layer) as MoELayer's state dict.

    gate: which of gates.N becomes the router (None: the only one; several are an error).
    num_global_experts: the router's expert count where the file has no _num_global_experts (old files).
    num_local_experts: the experts the file holds, needed only for llama_ffn's flat weights (their sizes alone cannot
    tell experts from hidden width).
    The experts stay as many as the file holds (one rank's share of an expert-parallel layer)."""
    state = dict(state)
    unknown = [key for key in state if key != NUM_EXPERTS and not key.startswith("experts.")
               and not _GATE_KEY.fullmatch(key)]
    if unknown:
        raise ValueError(f"tutel_to_moe: keys {unknown} are not a Tutel MoE layer's (expected _num_global_experts, "
                         f"gates.N.*, experts.*): pass one layer's keys, without its prefix")
    gates = gate_indices(state)
    if "experts.W_fc1" in state and state["experts.W_fc1"].dim() != 3:
        if num_local_experts is None:
            raise ValueError("tutel_to_moe: llama_ffn's W_fc1/W_fc2/W_fc3 are stored flat: pass num_local_experts")
        state = llama_shapes(state, num_local_experts, _model_dim(state, gates))
    out = experts_to_moe(state)
    if gate is None:
        if len(gates) != 1:
            raise ValueError(f"tutel_to_moe: the layer has gates {gates}; a MoELayer has one router: pass gate=N")
        gate = gates[0]
    if gate not in gates:
        raise ValueError(f"tutel_to_moe: gate={gate!r} is not among the layer's gates {gates}")
    out.update(gate_to_moe(state, gate))
    num_experts = _global_experts(state, num_global_experts)
    if out["router.weight_ED"].shape[0] != num_experts:
        raise ValueError(f"tutel_to_moe: gates.{gate} scores {out['router.weight_ED'].shape[0]} experts, but "
                         f"_num_global_experts is {num_experts}")
    out["router.expert_bias_E"] = torch.zeros(num_experts, dtype=torch.float32)
    return out


def moe_to_tutel(state: Mapping[str, torch.Tensor], gate: int = 0, llama: bool = False) -> Tensors:
    """MoELayer's state dict (one rank's experts, or all) as one Tutel layer's keys, with its router as gates.{gate}.

    llama: the experts are Tutel's llama_ffn (w1_EDH holds [W_fc1 | W_fc2]), else ffn. A router whose balancing bias
    is not zero has no Tutel counterpart: an error."""
    state = dict(state)
    extra = [key for key in state if not key.startswith(("router.", "experts."))]
    if extra:
        raise ValueError(f"moe_to_tutel: keys {extra} have no Tutel counterpart (a shared expert, a tuner state?)")
    bias_E = state.pop("router.expert_bias_E", None)
    if bias_E is not None and bool(bias_E.ne(0).any()):
        raise ValueError("moe_to_tutel: router.expert_bias_E is not zero (auxiliary-loss-free balancing): Tutel's "
                         "gates have no such bias")
    out = experts_to_tutel(state, llama)
    out.update(gate_to_tutel(state, gate))
    num_experts = out[f"gates.{gate}.wg.weight"].shape[0] if f"gates.{gate}.wg.weight" in out \
        else out[f"gates.{gate}.sim_matrix"].shape[1]
    out[NUM_EXPERTS] = torch.tensor(num_experts)
    return out


def model_tutel_to_moe(state: Mapping[str, torch.Tensor], gate: Optional[int] = None,
                       num_local_experts: Optional[int] = None) -> Tensors:
    """A model's state dict with every Tutel layer (found by tutel_layer_prefixes) converted in place of its keys."""
    out = dict(state)
    for prefix in tutel_layer_prefixes(state):
        layer = {key[len(prefix):]: out.pop(key) for key in list(out) if key.startswith(prefix)
                 and _layer_key(key[len(prefix):])}
        out.update({prefix + key: value for key, value in tutel_to_moe(layer, gate, num_local_experts=num_local_experts).items()})
    return out


def _model_dim(state: Tensors, gates: List[int]) -> int:
    for gate in gates:
        for leaf in ("wg.weight", "cosine_projector.weight"):
            if f"gates.{gate}.{leaf}" in state:
                return state[f"gates.{gate}.{leaf}"].shape[1]
    raise ValueError("tutel_to_moe: no gate tells the model dim (gates.N.wg.weight or cosine_projector.weight)")


def _layer_key(key: str) -> bool:
    return key == NUM_EXPERTS or key.startswith("experts.") or bool(_GATE_KEY.fullmatch(key))


def _global_experts(state: Tensors, given: Optional[int]) -> int:
    if NUM_EXPERTS in state:
        stored = int(state[NUM_EXPERTS])
        if given is not None and given != stored:
            raise ValueError(f"tutel_to_moe: num_global_experts={given} but the file's _num_global_experts is {stored}")
        return stored
    if given is None:
        for key in state:
            match = _GATE_KEY.fullmatch(key)
            if match and match.group(2) == "wg.weight":
                return state[key].shape[0]
            if match and match.group(2) == "sim_matrix":
                return state[key].shape[1]
    return given


def experts_to_moe(state: Tensors) -> Tensors:
    present = [key for key in state if key.startswith("experts.")]
    if "experts.batched_fc1_w" in state:
        _only(present, FFN_KEYS, "ffn")
        fc1_EHD, fc2_EHD = state["experts.batched_fc1_w"], state["experts.batched_fc2_w"]
        E, H, D = fc1_EHD.shape
        if fc2_EHD.shape != (E, H, D):
            raise ValueError(f"tutel_to_moe: experts.batched_fc2_w is {tuple(fc2_EHD.shape)}, expected [E, H, D] = "
                             f"{[E, H, D]} (an output_dim other than model_dim, or sharded experts, is not supported)")
        out = {"experts.w1_EDH": fc1_EHD.transpose(1, 2).contiguous(), "experts.w2_EHD": fc2_EHD.contiguous()}
        for key, name, width in (("experts.batched_fc1_bias", "experts.b1_EH", H),
                                 ("experts.batched_fc2_bias", "experts.b2_ED", D)):
            if key in state:
                out[name] = _reshaped(state[key], (E, width), key)
        return out
    if "experts.W_fc1" in state:
        _only(present, LLAMA_KEYS, "llama_ffn")
        if any(key not in state for key in LLAMA_KEYS):
            raise ValueError(f"tutel_to_moe: llama_ffn experts need {list(LLAMA_KEYS)}, got {present}")
        fc1_EDH, fc2_EDH, fc3_EHD = (state[key] for key in LLAMA_KEYS)
        return {"experts.w1_EDH": torch.cat([fc1_EDH, fc2_EDH], dim=2).contiguous(),
                "experts.w2_EHD": fc3_EHD.contiguous()}
    raise ValueError(f"tutel_to_moe: no experts found (experts.batched_fc1_w or experts.W_fc1); got {present}")


def llama_shapes(state: Mapping[str, torch.Tensor], num_local_experts: int, model_dim: int) -> Tensors:
    """state with llama_ffn's flat W_fc1, W_fc2 [E, D, H] and W_fc3 [E, H, D] given their shapes (H from the sizes)."""
    out = dict(state)
    numel = state["experts.W_fc1"].numel()
    if numel % (num_local_experts * model_dim):
        raise ValueError(f"llama_shapes: experts.W_fc1 has {numel} values, not a multiple of num_local_experts * "
                         f"model_dim = {num_local_experts * model_dim}")
    E, D, H = num_local_experts, model_dim, numel // (num_local_experts * model_dim)
    for key, shape in zip(LLAMA_KEYS, ((E, D, H), (E, D, H), (E, H, D))):
        out[key] = _reshaped(state[key], shape, key)
    return out


def experts_to_tutel(state: Tensors, llama: bool) -> Tensors:
    w1_EDH, w2_EHD = state["experts.w1_EDH"], state["experts.w2_EHD"]
    if llama:
        if "experts.b1_EH" in state or "experts.b2_ED" in state:
            raise ValueError("moe_to_tutel: llama_ffn experts have no biases, but the state holds experts.b1_EH or "
                             "experts.b2_ED")
        H = w2_EHD.shape[1]
        if w1_EDH.shape[2] != 2 * H:
            raise ValueError(f"moe_to_tutel: llama_ffn needs w1_EDH with 2H = {2 * H} columns ([gate | up], swiglu), "
                             f"got {tuple(w1_EDH.shape)}")
        return {"experts.W_fc1": w1_EDH[..., :H].contiguous().view(-1),
                "experts.W_fc2": w1_EDH[..., H:].contiguous().view(-1),
                "experts.W_fc3": w2_EHD.contiguous().view(-1)}
    out = {"experts.batched_fc1_w": w1_EDH.transpose(1, 2).contiguous(), "experts.batched_fc2_w": w2_EHD.contiguous()}
    for name, key in (("experts.b1_EH", "experts.batched_fc1_bias"), ("experts.b2_ED", "experts.batched_fc2_bias")):
        if name in state:
            out[key] = state[name].contiguous()
    unknown = [key for key in state if key.startswith("experts.") and key not in
               ("experts.w1_EDH", "experts.w2_EHD", "experts.b1_EH", "experts.b2_ED")]
    if unknown:
        raise ValueError(f"moe_to_tutel: expert keys {unknown} have no Tutel counterpart (LoRA adapters?)")
    return out


def gate_to_moe(state: Tensors, gate: int) -> Tensors:
    prefix = f"gates.{gate}."
    keys = sorted(key[len(prefix):] for key in state if key.startswith(prefix))
    if keys == sorted(TOP_GATE_KEYS):
        return {"router.weight_ED": state[prefix + "wg.weight"]}
    if keys == sorted(COSINE_GATE_KEYS):
        return {"router.weight_ED": state[prefix + "sim_matrix"].t().contiguous(),
                "router.log_scale": state[prefix + "temperature"].reshape(()),
                "router.projector.weight": state[prefix + "cosine_projector.weight"],
                "router.projector.bias": state[prefix + "cosine_projector.bias"]}
    raise ValueError(f"tutel_to_moe: gates.{gate} holds {keys}: neither a top gate ({list(TOP_GATE_KEYS)}) nor a "
                     f"cosine_top gate ({list(COSINE_GATE_KEYS)})")


def gate_to_tutel(state: Tensors, gate: int) -> Tensors:
    prefix = f"gates.{gate}."
    keys = sorted(key for key in state if key.startswith("router."))
    if keys == ["router.weight_ED"]:
        return {prefix + "wg.weight": state["router.weight_ED"]}
    if keys == sorted(["router.weight_ED", "router.log_scale", "router.projector.weight", "router.projector.bias"]):
        return {prefix + "temperature": state["router.log_scale"].reshape(1),
                prefix + "sim_matrix": state["router.weight_ED"].t().contiguous(),
                prefix + "cosine_projector.weight": state["router.projector.weight"],
                prefix + "cosine_projector.bias": state["router.projector.bias"]}
    raise ValueError(f"moe_to_tutel: router keys {keys} match neither Tutel's top gate (router.weight_ED) nor its "
                     f"cosine_top gate (weight_ED, log_scale, projector.weight, projector.bias)")


def _only(present: List[str], allowed: tuple, kind: str) -> None:
    unknown = [key for key in present if key not in allowed]
    if unknown:
        raise ValueError(f"tutel_to_moe: {kind} experts hold only {list(allowed)}; also got {unknown} (custom "
                         f"experts are converted by their own code)")


def _reshaped(value: torch.Tensor, shape: tuple, key: str) -> torch.Tensor:
    if value.numel() != torch.Size(shape).numel():
        raise ValueError(f"tutel: {key} is {tuple(value.shape)}, expected {list(shape)} values")
    return value.reshape(shape).contiguous()
