"""A plan as text for people and as a JSON object (--json)."""
from __future__ import annotations

import dataclasses
from typing import List

from .assembly import Plan

ROLE_FIELDS = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "all_to_all_bytes",
               "all_to_all_bound_bytes", "all_reduce_bytes", "reduce_scatter_bytes", "all_gather_bytes",
               "peak_bytes")


def as_json(plan: Plan) -> dict:
    return {"world_size": plan.world_size, "node_size": plan.node_size, "device": plan.device.name,
            "micro_batch": plan.micro_batch, "tokens_per_rank": plan.tokens_per_rank,
            "roles": [dataclasses.asdict(role) for role in plan.roles],
            "moe_layers": [{**dataclasses.asdict(layer), "activations_bytes": kept}
                           for layer, kept in zip(plan.layers, plan.moe_activations)],
            "other_activations_bytes": other_activations(plan),
            "step_seconds": plan.step.seconds,
            "step_parts": {"compute": plan.step.compute, "all_to_all": plan.step.all_to_all,
                           "gradients": plan.step.gradients, "replicas": plan.step.replicas},
            "skew": None if plan.skews is None else [dataclasses.asdict(s) for s in plan.skews],
            "max_micro_batch": plan.max_micro_batch, "activation_bytes_per_row": plan.activation_bytes_per_row,
            "recompute": {mode: dataclasses.asdict(option) for mode, option in plan.recompute.items()},
            "assumptions": [plan.device.note, *plan.step.assumptions], "warnings": plan.warnings}


def other_activations(plan: Plan) -> int:
    """What the rest of the model (all but the MoE layers) keeps for backward of the micro-batch."""
    return max(0, plan.roles[0].activations_bytes - sum(plan.moe_activations))


def ranks_text(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs, start = [], ranks[0]
    for previous, rank in zip(ranks, ranks[1:] + [None]):
        if rank != previous + 1 if rank is not None else True:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
            start = rank
    return ", ".join(runs)


def size(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def as_text(plan: Plan) -> str:
    lines = [f"world {plan.world_size} ranks ({plan.node_size} per node), device {plan.device.name}; "
             f"micro-batch {plan.micro_batch} rows = {plan.tokens_per_rank} tokens per rank"]
    for role in plan.roles:
        lines.append(f"ranks {ranks_text(role.ranks)}:")
        for name in ROLE_FIELDS:
            lines.append(f"  {name[:-6].replace('_', ' '):<22} {size(getattr(role, name)):>12}")
    described = [f"capacity {layer.capacity} rows per expert; all-to-all rows per pass {layer.rows_balanced} "
                 f"balanced, {layer.rows_bound} at the bound" for layer in plan.layers]
    for text in dict.fromkeys(described):      # layers alike: one line
        lines.append(f"MoE layers {ranks_text([i for i, d in enumerate(described) if d == text])}: {text}")
    kept = [size(n) for n in plan.moe_activations]
    shares = [f"MoE layers {ranks_text([i for i, k in enumerate(kept) if k == text])}: {text} each"
              for text in dict.fromkeys(kept)]
    lines.append(f"activations of the micro-batch: " + "; ".join(shares + [f"the rest of the model: "
                                                                          f"{size(other_activations(plan))}"]))
    step = plan.step
    if plan.skews is not None:
        skews = [f"max_rank_load {s.before:.2f} -> {s.max_rank_load:.2f} with {s.copies} copies" for s in plan.skews]
        for text in dict.fromkeys(skews):
            lines.append(f"MoE layers {ranks_text([i for i, t in enumerate(skews) if t == text])} (--skew): {text}")
    lines.append(f"step {step.seconds * 1e3:.2f} ms = compute {step.compute * 1e3:.2f} + all-to-all "
                 f"{step.all_to_all * 1e3:.2f} + gradients {step.gradients * 1e3:.2f}"
                 + (f" + replicas {step.replicas * 1e3:.2f}" if plan.skews is not None else ""))
    lines.append(f"largest micro-batch that fits {plan.device.memory_bytes / 2**30:.0f} GiB: "
                 f"{plan.max_micro_batch} rows ({size(plan.activation_bytes_per_row)} of activations per row)")
    if plan.recompute:
        lines.append("recompute (MoEConfig.recompute): " + "; ".join(
            f"{mode!r} keeps {size(option.activations_bytes)} of activations, peak {size(option.peak_bytes)}, largest "
            f"micro-batch {option.max_micro_batch} rows, step {option.step_seconds * 1e3:.2f} ms"
            for mode, option in plan.recompute.items()))
    lines.append("assumptions: " + "; ".join([plan.device.note, *step.assumptions]))
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"
