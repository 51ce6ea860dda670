"""The "moe" section of a DeepSpeed config: its keys, their checks, and read_moe_section."""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from moe_plugin.integrations.deepspeed.hook import near_moe_keys
from moe_plugin.parallel.groups import check_ep_size

__all__ = ["SECTION_KEYS", "read_moe_section", "section_key", "check_ep_size_under_deepspeed"]

BACKENDS = ("tutel", "deepspeed")
SECTION_TO_ARGUMENT = {"top_k": "k"}   # section key -> MoE constructor argument, where they differ


def _is_int(value, minimum):
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value, positive):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    return ok and (value > 0 if positive else value >= 0)


# "moe" section key -> (check, what is allowed). Routing keys override every MoE layer's own setting.
SECTION_KEYS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "backend": (lambda v: v in BACKENDS, "\"tutel\" or \"deepspeed\""),
    "num_experts": (lambda v: _is_int(v, 1), "an integer >= 1 equal to every MoE layer's num_experts"),
    "ep_size": (lambda v: _is_int(v, 1), "an integer >= 1 equal to every MoE layer's ep_size"),
    "top_k": (lambda v: _is_int(v, 1), "an integer between 1 and num_experts"),
    "capacity_factor": (lambda v: _is_number(v, positive=True), "a number > 0"),
    "eval_capacity_factor": (lambda v: _is_number(v, positive=True), "a number > 0"),
    "min_capacity": (lambda v: _is_int(v, 0), "an integer >= 0"),
    "drop_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "router": (lambda v: v in ("softmax", "sigmoid", "cosine"),
               "\"softmax\", \"sigmoid\" or \"cosine\" (backend tutel; deepspeed has softmax only)"),
    "aux_loss_coef": (lambda v: _is_number(v, positive=False), "a number >= 0"),
    "parallel": (lambda v: v in ("auto", "auto_once") or _is_int(v, 0),
                 "\"auto\", \"auto_once\" or an integer >= 0"),
    "overlap_degree": (lambda v: v in ("auto", "auto_once") or _is_int(v, 1),
                       "\"auto\", \"auto_once\" or an integer >= 1"),
    "a2a": (lambda v: v in ("flat", "2dh", "auto"), "\"flat\", \"2dh\" or \"auto\""),
    "node_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "expert_bias_update_rate": (lambda v: _is_number(v, positive=False) and v != float("inf"),
                                "a finite number >= 0 (backend tutel)"),
    "num_groups": (lambda v: _is_int(v, 1), "an integer >= 1 dividing num_experts (backend tutel)"),
    "topk_groups": (lambda v: _is_int(v, 1), "an integer between 1 and num_groups (backend tutel)"),
    "route_scale": (lambda v: _is_number(v, positive=True) and v != float("inf"),
                    "a finite number > 0 (backend tutel)"),
    "aux_loss": (lambda v: v in ("gshard", "switch", "seq"), "\"gshard\", \"switch\" or \"seq\" (backend tutel)"),
    "recompute": (lambda v: v in ("none", "experts"), "\"none\" or \"experts\" (backend tutel)"),
    "aux_loss_scope": (lambda v: v in ("local", "global"), "\"local\" or \"global\" (backend tutel)"),
    "redundant_experts": (lambda v: v == "auto" or _is_int(v, 0), "an integer >= 0 or \"auto\" (backend tutel)"),
    # not a layer setting: checked by routing.routing_alarm, left out of read_moe_section's dict
    "routing_alarm": (lambda v: True, "true, false or an object (routing.py)"),
}
TUTEL_ONLY_KEYS = ("expert_bias_update_rate", "num_groups", "topk_groups", "route_scale", "aux_loss", "recompute",
                   "aux_loss_scope", "redundant_experts")


def read_moe_section(config: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The validated "moe" section of a DeepSpeed config dict (None when there is none).

    Only the keys given are returned, but routing_alarm (not a layer setting: routing.py); "backend" is required.
    """
    near = near_moe_keys(config)
    if near:
        raise ValueError(f"DeepSpeed config has a top-level key {near[0]!r}, which DeepSpeed ignores; moe_plugin reads "
                         f"its MoE settings from \"moe\" (lower case): rename {near[0]!r} to \"moe\"")
    section = config.get("moe")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"DeepSpeed config \"moe\" must be an object, got {type(section).__name__}")
    for key in section:
        if key not in SECTION_KEYS:
            close = difflib.get_close_matches(str(key), list(SECTION_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"DeepSpeed config \"moe\" has no key {key!r}{hint}; known keys: "
                             f"{', '.join(SECTION_KEYS)}")
    if "backend" not in section:
        raise ValueError("DeepSpeed config \"moe.backend\" is required: \"tutel\" (moe_plugin's layer) or "
                         "\"deepspeed\" (DeepSpeed's native layer)")
    for key, value in section.items():
        check, allowed = SECTION_KEYS[key]
        if key in ("capacity_factor", "eval_capacity_factor") and _is_number(value, positive=False) and value == 0:
            raise ValueError(f"DeepSpeed config \"moe.{key}\"={value!r} is invalid: must be {allowed}; for dropless "
                             f"routing set \"moe.drop_tokens\": false (DeepSpeed's own key; moe_plugin's "
                             f"capacity_factor 0 elsewhere)")
        if not check(value):
            raise ValueError(f"DeepSpeed config \"moe.{key}\"={value!r} is invalid: must be {allowed}")
    if section["backend"] == "deepspeed" and section.get("router", "softmax") != "softmax":
        raise ValueError(f"DeepSpeed config \"moe.router\"={section['router']!r} needs \"moe.backend\": \"tutel\"; "
                         f"DeepSpeed's native gate is softmax")
    if section["backend"] == "deepspeed":
        for key in TUTEL_ONLY_KEYS:
            if key in section:
                raise ValueError(f"DeepSpeed config \"moe.{key}\"={section[key]!r} needs \"moe.backend\": "
                                 f"\"tutel\"; DeepSpeed's native gate has no {key}")
    return {key: value for key, value in section.items() if key != "routing_alarm"}


def section_key(argument: str) -> str:
    return {v: k for k, v in SECTION_TO_ARGUMENT.items()}.get(argument, argument)


def check_ep_size_under_deepspeed(ep_size: int, setting: str) -> None:
    """moe_plugin's ep_size check (ValueError naming setting and the number of processes) for DeepSpeed's expert
    groups, which split the processes of each pipeline stage; run where DeepSpeed would fail with a bare
    AssertionError. Needs torch.distributed started (deepspeed.init_distributed) when ep_size > 1."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size
    check_ep_size(ep_size, setting, stages=bwc_pipeline_parallel_world_size(groups.mpu))
