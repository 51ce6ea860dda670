"""Tutel's moe_layer arguments, checked and translated: the gates' and the experts' specs, and one MoEConfig per
(gate, call) for the MoELayer underneath. Every argument Tutel takes is either honoured here or refused with an
error naming it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig

GATE_TYPES = ("top", "cosine_top")
EXPERT_TYPES = ("ffn", "llama_ffn", "custom")
# Activations the fast path runs by name; any other callable runs as given on the general path (experts.py)
ACTIVATION_FUNCTIONS = {torch.relu: "relu", F.relu: "relu", F.gelu: "gelu", F.silu: "silu"}
ACTIVATION_MODULES = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Identity: "identity"}
# llama_ffn: activation(fc1) * fc2 is our gated activation of the same name
GATED = {"silu": "swiglu", "gelu": "geglu"}


@dataclass
class GateSpec:
    """One of Tutel's gates: gate_type's dict (or string), checked."""
    kind: str
    top_k: int
    fp32: bool = False
    capacity_factor: float = 1.0
    gate_noise: float = 0.0
    proj_dim: int = 256
    init_t: float = 0.5


@dataclass
class ExpertSpec:
    """Tutel's experts dict, checked. activation: the fast path's activation name, or None: the general path runs
    activation_fn (with the experts module as second argument when with_self)."""
    kind: str
    num_local: int
    hidden: int = 0
    activation: Optional[str] = None
    activation_fn: Optional[Callable] = None
    with_self: bool = False
    fc1_bias: bool = True
    fc2_bias: bool = True
    module: Optional[Callable] = None
    options: Dict[str, Any] = field(default_factory=dict)

    @property
    def fast(self) -> bool:
        """Our stacked experts compute it (else the general path, experts.py)."""
        return self.kind != "custom" and self.activation is not None and self.fc1_bias == self.fc2_bias


def gate_specs(gate_type: Any) -> List[GateSpec]:
    """gate_type: a dict, a list of dicts (one gate each, chosen per call by gate_index), or "TopKGate"."""
    if isinstance(gate_type, str):
        match = re.fullmatch(r"Top(\d+)Gate", gate_type)
        if not match:
            raise ValueError(f"moe_layer: gate_type={gate_type!r} is not a gate: give a dict such as "
                             f"{{'type': 'top', 'k': 2}}, a list of them, or the old strings 'Top1Gate', 'Top2Gate'")
        gate_type = {"type": "top", "k": int(match.group(1))}
    gates = gate_type if isinstance(gate_type, (list, tuple)) else [gate_type]
    if not gates:
        raise ValueError("moe_layer: gate_type=[] has no gate")
    return [_gate_spec(gate, i) for i, gate in enumerate(gates)]


def _gate_spec(gate: Any, index: int) -> GateSpec:
    if not isinstance(gate, dict):
        raise TypeError(f"moe_layer: gate_type[{index}] must be a dict such as {{'type': 'top', 'k': 2}}, got "
                        f"{type(gate).__name__}")
    options = dict(gate)
    kind = options.pop("type", None)
    if kind not in GATE_TYPES:
        hint = " (a custom gate module is not supported by the drop-in)" if kind == "custom" else ""
        raise ValueError(f"moe_layer: gate_type[{index}]['type']={kind!r} is not supported{hint}: use one of "
                         f"{list(GATE_TYPES)}")
    allowed = ("k", "fp32_gate", "capacity_factor", "gate_noise") + (("proj_dim", "init_t") if kind == "cosine_top"
                                                                       else ())
    unknown = [key for key in options if key not in allowed]
    if unknown:
        raise ValueError(f"moe_layer: gate_type[{index}] ({kind}) has unknown options {unknown}; allowed: "
                         f"{list(allowed)}")
    default_cf = float(os.environ.get("CAP_FACTOR", 1.0))     # Tutel's default, as Tutel reads it
    spec = GateSpec(kind, check_int(_whole(options.get("k", 1)), f"gate_type[{index}]['k']", 1),
                    bool(options.get("fp32_gate", False)),
                    _number(options.get("capacity_factor", default_cf), f"gate_type[{index}]['capacity_factor']"),
                    _number(options.get("gate_noise", 0.0), f"gate_type[{index}]['gate_noise']"),
                    check_int(options.get("proj_dim", 256), f"gate_type[{index}]['proj_dim']", 1),
                    _number(options.get("init_t", 0.5), f"gate_type[{index}]['init_t']"))
    if spec.gate_noise < 0:
        raise ValueError(f"moe_layer: gate_type[{index}]['gate_noise']={spec.gate_noise} must be >= 0")
    if spec.init_t <= 0:
        raise ValueError(f"moe_layer: gate_type[{index}]['init_t']={spec.init_t} must be > 0 (the temperature "
                         f"starts at log(1 / init_t))")
    return spec


def expert_spec(experts: Any, model_dim: int) -> ExpertSpec:
    """Tutel's experts dict (type ffn, llama_ffn or custom), checked."""
    if not isinstance(experts, dict):
        raise TypeError(f"moe_layer: experts must be a dict such as {{'type': 'ffn', 'count_per_node': 2, "
                        f"'hidden_size_per_expert': 2048}}, got {type(experts).__name__}")
    options = dict(experts)
    kind = options.pop("type", None)
    if kind not in EXPERT_TYPES:
        raise ValueError(f"moe_layer: experts['type']={kind!r} is not supported: use one of {list(EXPERT_TYPES)}")
    count_key = "count_per_node" if "count_per_node" in options else "num_experts_per_device"
    count = options.pop("count_per_node", options.pop("num_experts_per_device", 1))
    if isinstance(count, bool) or not isinstance(count, int) or count == 0 or count < -1:
        raise ValueError(f"moe_layer: experts[{count_key!r}]={count!r} is not supported: give the experts per process "
                         f"(an integer >= 1; -1 means 1). Negative counts (one expert shared by several processes) "
                         f"slice experts over processes, which the drop-in does not support")
    count = max(count, 1)
    if kind == "custom":
        module = options.pop("module", None)
        if module is None or not callable(module):
            raise ValueError("moe_layer: experts['type']='custom' needs experts['module'], a module class called as "
                             "module(model_dim=, num_experts_per_device=, sharded_count=, **other options)")
        return ExpertSpec(kind, count, module=module, options=options)
    hidden = check_int(options.pop("hidden_size_per_expert", None), "experts['hidden_size_per_expert']", 1)
    if kind == "ffn":
        return _ffn_spec(options, count, hidden, model_dim)
    return _llama_spec(options, count, hidden)


def _ffn_spec(options: dict, count: int, hidden: int, model_dim: int) -> ExpertSpec:
    for gone in ("fused_custom_fn", "implicit_dropout_p"):
        if gone in options:
            raise ValueError(f"moe_layer: experts[{gone!r}] was removed from Tutel's ffn experts; see Tutel's "
                             f"helloworld_from_scratch.py (a custom expert) or a dropout in activation_fn")
    allowed = ("activation_fn", "activation_fn_with_self", "output_dim", "has_fc1_bias", "has_fc2_bias")
    unknown = [key for key in options if key not in allowed]
    if unknown:
        raise ValueError(f"moe_layer: experts (ffn) has unknown options {unknown}; allowed: {list(allowed)}")
    output_dim = options.get("output_dim")
    if output_dim is not None and output_dim != model_dim:
        raise ValueError(f"moe_layer: experts['output_dim']={output_dim!r} is not supported: the drop-in's experts "
                         f"return model_dim={model_dim} columns (leave output_dim unset or equal to model_dim)")
    function, with_self = options.get("activation_fn"), options.get("activation_fn_with_self")
    if function is not None and with_self is not None:
        raise ValueError("moe_layer: experts sets both activation_fn and activation_fn_with_self: keep one")
    name = "relu" if function is None and with_self is None else activation_name(function)
    return ExpertSpec("ffn", count, hidden, name, with_self or function, with_self is not None,
                      bool(options.get("has_fc1_bias", True)), bool(options.get("has_fc2_bias", True)))


def _llama_spec(options: dict, count: int, hidden: int) -> ExpertSpec:
    unknown = [key for key in options if key != "activation_fn"]
    if unknown:
        raise ValueError(f"moe_layer: experts (llama_ffn) has unknown options {unknown}; allowed: ['activation_fn']")
    function = options.get("activation_fn", F.silu)
    name = GATED.get(activation_name(function))
    return ExpertSpec("llama_ffn", count, hidden, name, function, fc1_bias=False, fc2_bias=False)


def activation_name(function: Any) -> Optional[str]:
    """The fast path's name for a known activation callable (torch.relu, F.gelu, nn.SiLU(), ...), else None."""
    if function is None:
        return None
    if not callable(function):
        raise TypeError(f"moe_layer: experts['activation_fn']={function!r} is not callable")
    if isinstance(function, nn.GELU):
        return "gelu" if function.approximate == "none" else None
    if isinstance(function, nn.Module):
        return ACTIVATION_MODULES.get(type(function))
    try:
        return ACTIVATION_FUNCTIONS.get(function)
    except TypeError:      # unhashable callables
        return None


def parallel_degree(parallel_type: Any) -> Union[int, str]:
    """Tutel's parallel_type where every process holds whole experts: "adaptive:0" gathers every expert on each
    process (our parallel=0), "auto" lets our tuner choose between that and expert parallel per load ("auto"), and
    the rest is expert parallel (1); "data" and "model" differ only for experts sliced over processes."""
    if not isinstance(parallel_type, str):
        raise ValueError(f"moe_layer: parallel_type={parallel_type!r} must be 'adaptive:N', 'data', 'model' or 'auto'")
    if parallel_type.startswith("adaptive:"):
        degree = check_int(_parsed_int(parallel_type[len("adaptive:"):], parallel_type), "parallel_type's N", None)
        return min(max(degree, 0), 1)
    if parallel_type == "auto":
        return "auto"
    if parallel_type in ("data", "model"):
        return 1
    raise ValueError(f"moe_layer: parallel_type={parallel_type!r} is not recognized: use 'adaptive:N', 'data', "
                     f"'model' or 'auto'")


def alignment(overlap_degree: int, megablocks_size: int) -> int:
    """Tutel's capacity alignment (one process per expert slice): the overlap degree, rounded up to a multiple of
    megablocks_size, then to a multiple of 128 above 256."""
    up = max(megablocks_size, 1)
    value = (overlap_degree + up - 1) // up * up
    return (value + 127) // 128 * 128 if value > 256 else value


def layer_config(model_dim: int, num_experts: int, ep_size: int, experts: ExpertSpec, gate: GateSpec, *,
                 top_k: int, capacity_factor: float, capacity_alignment: int, is_postscore: bool,
                 batch_prioritized_routing: bool, normalize_gate: bool, is_gshard_loss: bool, overlap_degree: int,
                 use_2dh: bool, parallel: Union[int, str]) -> MoEConfig:
    """The MoEConfig of one call with gate `gate` (top_k and capacity_factor: this call's)."""
    if not is_gshard_loss and gate.gate_noise <= 0:
        raise ValueError("moe_layer: is_gshard_loss=False (Tutel's load_importance loss) needs the gate's gate_noise "
                         "> 0 (its load term divides by the noise)")
    hidden = experts.hidden if experts.kind != "custom" else 1
    return MoEConfig(
        model_dim=model_dim, hidden_size=hidden, num_experts=num_experts, top_k=min(top_k, num_experts),
        capacity_factor=capacity_factor, min_capacity=0, capacity_formula="tutel",
        capacity_alignment=capacity_alignment, router="cosine" if gate.kind == "cosine_top" else "softmax",
        router_proj_dim=gate.proj_dim if gate.kind == "cosine_top" else 0, gate_noise=gate.gate_noise,
        gate_noise_kind="tutel", fp32_router=gate.fp32, normalize_gate=bool(normalize_gate),
        batch_prioritized_routing=batch_prioritized_routing, aux_loss="gshard" if is_gshard_loss else "load_importance",
        aux_loss_coef=1.0, activation=experts.activation if experts.fast else "relu",
        bias=experts.fc1_bias and experts.fast, ep_size=ep_size, parallel=parallel, overlap_degree=overlap_degree,
        a2a="2dh" if use_2dh else "flat", gate_on_input=not is_postscore)


def check_int(value: Any, name: str, minimum: Optional[int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        allowed = "an integer" + ("" if minimum is None else f" >= {minimum}")
        raise ValueError(f"moe_layer: {name}={value!r} is invalid: must be {allowed}")
    return value


def _parsed_int(text: str, whole: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"moe_layer: parallel_type={whole!r}: N in 'adaptive:N' must be an integer") from None


def _whole(value):
    """Tutel takes int(k): 2.0 and "2" are 2 there too; anything else is left for check_int to refuse by name."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"moe_layer: {name}={value!r} is invalid: must be a number")
    return float(value)
