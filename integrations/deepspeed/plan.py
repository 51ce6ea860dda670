"""`moe-plugin plan --deepspeed ds.json --hf-config config.json`: the plan of a DeepSpeed run of a Hugging Face MoE
model whose blocks the "moe" section swaps (hf.py), without starting it.

The model is built from the local config.json on the meta device, in the config's precision (bf16 or fp16 when
enabled, else fp32), as rank 0 of the fake process group, its blocks swapped with the section's settings (the
expert-parallel groups as moe_plugin builds them: blocks of ep_size consecutive ranks, as DeepSpeed's are without
tensor or pipeline parallelism). DeepSpeed pads its partitions evenly, so every rank holds the same: one role.
What each rank holds follows ZeRO's partitioning (Rajbhandari et al., ZeRO; DeepSpeed's memory estimators) of the
dense parameters over all ranks and of the experts over the ranks holding the same experts:

    parameters    16-bit (or fp32) weights; stage 3: partitioned
    gradients     like the weights; stages 2, 3: partitioned
    optimizer     the "optimizer" section's state (Adam, Lamb: two fp32 moments; Adagrad one; SGD its momentum
                  buffer, if any; without a section the client's optimizer, taken as Adam) and an fp32 copy of
                  the weights (ZeRO's optimizers keep one of fp32 weights too; plain stage 0 in fp32 none);
                  stages 1-3: partitioned; a 4-byte step per group (stage 0: per parameter; not SGD's)

The gradients are the most ZeRO holds: at stage 1 every full gradient, as backward hands them to ZeRO (which then
keeps its partition only). Alignment padding and ZeRO's reduction bucket are not counted. The activations,
all-to-all bytes and step time come from moe_plugin.plan's assembly. tests/integrations/deepspeed/test_deepspeed_plan.py
holds the figures to hand counts from the model's own parameters, and to real DeepSpeed runs on 2 ranks (ZeRO 0 and 1
fp32, ZeRO 1, 2 and 3 bf16) and 4 (ZeRO 2 and 3 bf16): parameter, gradient and optimizer bytes and the all-to-all
bytes exactly, the activations within 10% (bf16; docs/planning.md says why not fp32).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict

import torch

from moe_plugin.integrations.deepspeed.hf import check_section_for_model, section_overrides
from moe_plugin.integrations.deepspeed.section import read_moe_section
from moe_plugin.integrations.transformers import swap_moe_blocks
from moe_plugin.parallel.groups import check_ep_size
from moe_plugin.plan.assembly import Collectives, Plan, assemble, split_bytes
from moe_plugin.plan.devices import Device
from moe_plugin.plan.experiment import check_world_size
from moe_plugin.plan.fake_world import fake_world
from moe_plugin.plan.state_bytes import ADAM_STEP_BYTES, StateBytes

MASTER_BYTES = 4            # the fp32 copy of a 16-bit weight
# the fp32 state an optimizer of the "optimizer" section keeps per weight (SGD: its momentum buffer, if any)
STATE_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "onebitadam": 8, "zerooneadam": 8, "lamb": 8,
               "onebitlamb": 8, "adagrad": 4, "sgd": 4}


def optimizer_state(ds: Dict[str, Any]):
    """(fp32 state bytes per weight, whether it keeps a 4-byte step per parameter group) of the config's optimizer;
    without an "optimizer" section (the client's, e.g. HF Trainer's AdamW) Adam's. ValueError for another type."""
    section = ds.get("optimizer")
    if section is None:
        return STATE_BYTES["adam"], True
    kind = section.get("type") if isinstance(section, dict) else None
    key = kind.lower().replace("_", "") if isinstance(kind, str) else None
    if key not in STATE_BYTES:
        raise ValueError(f"DeepSpeed config \"optimizer.type\"={kind!r} is not planned: allowed: Adam, AdamW, "
                         f"FusedAdam, CPUAdam, OneBitAdam, ZeroOneAdam, Lamb, OneBitLamb, Adagrad, SGD")
    if key == "sgd":
        return (STATE_BYTES["sgd"] if (section.get("params") or {}).get("momentum", 0) else 0), False
    return STATE_BYTES[key], True


def read_json(path: str, what: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        with open(path) as handle:
            value = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{what} {path!r} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path!r} must hold a JSON object, got {type(value).__name__}")
    return value


def precision(ds: Dict[str, Any]) -> torch.dtype:
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled"):
            return dtype
    return torch.float32


def hf_model_config(path: str):
    """The transformers config of a local config.json (or a folder holding one)."""
    import transformers
    values = read_json(os.path.join(path, "config.json") if os.path.isdir(path) else path, "--hf-config")
    model_type = values.pop("model_type", None)
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"--hf-config {path!r} (model_type {model_type!r}): {error}") from None


def plan_deepspeed(ds_path: str, hf_path: str, world_size: int, node_size: int, seq_len: int,
                   device: Device) -> Plan:
    import transformers
    check_world_size(world_size, node_size)
    ds = read_json(ds_path, "--deepspeed")
    rows = ds.get("train_micro_batch_size_per_gpu")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"DeepSpeed config \"train_micro_batch_size_per_gpu\"={rows!r} is invalid: must be an "
                         f"integer >= 1 (the plan's micro-batch)")
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed config \"zero_optimization.stage\"={stage!r} is invalid: must be 0, 1, 2 or 3")
    state, steps = optimizer_state(ds)
    section = read_moe_section(ds) or {"backend": "tutel"}
    ep_size = section.get("ep_size", 1)
    check_ep_size(ep_size, "DeepSpeed config \"moe.ep_size\"", world_size, processes_from="plan with --world-size N")
    config, dtype = hf_model_config(hf_path), precision(ds)
    overrides = section_overrides(section)

    def build(ep: int):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        check_section_for_model(model, section)
        return swap_moe_blocks(model, **{**overrides, "ep_size": ep})

    with fake_world(0, world_size, node_size):
        with torch.device("meta"):
            first = build(ep_size)
    dense, experts = split_bytes(first)
    element = torch.finfo(dtype).bits // 8
    # ZeRO's optimizers (stages 1-3, and stage 0 in 16 bits) keep an fp32 copy of their partition, fp32 weights too
    master = MASTER_BYTES if stage >= 1 or element < 4 else 0
    optimizer_per_byte = (state + master) / element
    groups = 2 if experts else 1        # DeepSpeed splits the parameter group: dense, experts (moe param groups)
    tensors = sum(1 for p in first.parameters() if p.requires_grad)   # stage 0: torch's optimizer, a step each
    holders = world_size // ep_size

    def share(dense_part: float, expert_part: float, partitioned: bool) -> int:
        """This rank's bytes: partitioned, the dense part over all ranks and the experts' over their holders."""
        if not partitioned:
            return int(dense_part + expert_part)
        return math.ceil(dense_part / world_size) + math.ceil(expert_part / holders)

    held = StateBytes(parameters=share(dense, experts, stage >= 3), gradients=share(dense, experts, stage >= 2),
                      optimizer=share(dense * optimizer_per_byte, experts * optimizer_per_byte, stage >= 1)
                      + (ADAM_STEP_BYTES * (groups if stage >= 1 else tensors) if steps else 0))
    if stage == 0:      # DeepSpeed's data parallelism: dense gradients over all ranks, experts' over their holders
        collectives = Collectives(all_reduce=(dense if world_size > 1 else 0) + (experts if holders > 1 else 0))
    else:               # reduce-scattered gradients; updated partitions gathered (stage 3: forward and backward)
        gathers = 2 if stage == 3 else 1
        collectives = Collectives(reduce_scatter=dense + experts, all_gather=gathers * (dense + experts))
    return assemble(first, [(list(range(world_size)), held)], collectives, rows, seq_len, lambda: build(1),
                    world_size, node_size, device, stage == 3, "train_micro_batch_size_per_gpu",
                    "\"moe.ep_size\" (experts over more ranks), a higher \"zero_optimization.stage\", "
                    "bf16, \"moe.recompute\": \"experts\" (see the recompute line), a smaller \"moe.capacity_factor\"",
                    "DeepSpeed config \"moe.capacity_factor\"")
