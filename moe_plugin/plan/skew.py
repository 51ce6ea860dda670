"""`moe-plugin plan --skew`: routing that is not even, charged to the step. A skew is a number, the busiest
expert-parallel rank's routed rows over the mean rank's (max_rank_load; the plan then gives rank 0's experts that
share, evenly, and the other experts the rest, evenly), or a routing report (`moe-plugin checkpoint routing`'s
routing.json: each MoE layer's load per expert; one layer's applies to every layer).

Per MoE layer the plan charges the busiest rank: its expert compute and its all-to-all bytes are max_rank_load times
the balanced ones, max_rank_load as the layer's replicas (MoEConfig.redundant_experts; parallel/replicas.py's plan
on the skewed load) leave it, and the copies' weight traffic (cost_model.replica_seconds: the rank sending or
receiving the most copies). Legend: W ranks of the ep group, E experts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

import torch

from ..config import GATED_ACTIVATIONS, MoEConfig
from ..parallel import cost_model
from ..parallel.replicas import busiest_copies, split_rows

ROWS = 1 << 22      # rows of the synthetic load: enough that rounding does not show


@dataclass
class LayerSkew:
    max_rank_load: float            # after the replicas, as the plan charges it
    before: float                   # without replicas
    copies: int
    replica_seconds: float          # the copies' weights out and gradients back, one step


def read_skew(value: str) -> Union[float, List[List[float]]]:
    """--skew: a number >= 1, or the path of a routing report (each layer's load per expert)."""
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None:
        if not math.isfinite(number) or number < 1:
            raise ValueError(f"--skew={value!r} is invalid: must be a number >= 1 (max_rank_load) or a routing "
                             f"report (routing.json)")
        return number
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--skew={value!r} is invalid: not a number >= 1 and no such file (a routing report, "
                         f"routing.json of `moe-plugin checkpoint routing`)")
    try:
        layers = json.loads(path.read_text())["layers"]
        return [[float(n) for n in layer["load"]] for layer in layers.values()]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"--skew={value!r}: not a routing report (routing.json with layers.<name>.load): "
                         f"{error}") from None


def skewed_load(config: MoEConfig, skew: Union[float, List[float]]) -> torch.Tensor:
    """[W, E] the rows each rank routes to each expert, every rank alike, ROWS in all."""
    E, W = config.num_experts, config.ep_size
    if isinstance(skew, float):
        if skew > W:
            raise ValueError(f"--skew={skew} is invalid for an MoE layer at ep_size={W}: max_rank_load is at most "
                             f"ep_size (one rank taking every row)")
        local = max(1, E // W)
        hot = skew / W if E > local else 1.0
        load_E = torch.full((E,), (1 - hot) / max(E - local, 1), dtype=torch.float64)
        load_E[:local] = hot / local
    else:
        if len(skew) != E:
            raise ValueError(f"--skew's routing report has a layer of {len(skew)} experts, the plan's MoE layer "
                             f"{E}")
        load_E = torch.tensor(skew, dtype=torch.float64) / max(sum(skew), 1.0)
    return (load_E * ROWS / W).round().long().expand(W, E)


def layer_skew(config: MoEConfig, skew: Union[float, List[float]], params: cost_model.Params, dtype_bytes: int,
               rows_per_rank: int, node_size: int) -> LayerSkew:
    """What a skew costs one MoE layer: the busiest rank's share without and with the layer's replicas (rows_per_rank:
    the kept rows a rank routes, balanced)."""
    W, E = config.ep_size, config.num_experts
    if W == 1 or E < W:
        return LayerSkew(1.0, 1.0, 0, 0.0)
    counts_WE = skewed_load(config, skew)
    local = E // W
    owned_W = counts_WE.sum(0).view(W, local).sum(1).double()
    before = float(owned_W.max() / owned_W.mean())
    matrices = 3 if config.activation in GATED_ACTIVATIONS else 2
    expert_bytes = (matrices * config.model_dim * config.hidden_size
                    + (config.hidden_size * (matrices - 1) + config.model_dim) * config.bias) * dtype_bytes
    node = min(node_size, W)
    most, copy_rows = _budget(config, params, expert_bytes, dtype_bytes, node,
                              float(counts_WE.sum()) / max(W * rows_per_rank, 1))
    if not most or config.parallel == 0:
        return LayerSkew(before, before, 0, 0.0)
    split = split_rows(counts_WE, local, most, copy_rows)
    rows_W = sum(split.rank_rows(w) for w in range(W)).double()
    seconds = cost_model.replica_seconds(busiest_copies(split.copies, local, W), expert_bytes, W, node, params)
    return LayerSkew(float(rows_W.max() / rows_W.mean()), before, len(split.copies), seconds)


def _budget(config: MoEConfig, params: cost_model.Params, expert_bytes: int, dtype_bytes: int, node_size: int,
            scale: float) -> tuple:
    """replicas.worth_copying for a planned layer, in the synthetic load's rows (scale: its rows per real row)."""
    if config.redundant_experts != "auto":
        return config.redundant_experts, 0.0
    matrices = 3 if config.activation in GATED_ACTIVATIONS else 2
    row = cost_model.row_seconds(config.model_dim, config.hidden_size, matrices, dtype_bytes, config.ep_size,
                                 node_size, params)
    return math.inf, cost_model.replica_seconds(1, expert_bytes, config.ep_size, node_size, params) / row * scale


def layer_skews(configs: List[MoEConfig], skew: Optional[Union[float, List[List[float]]]], params,
                dtype_bytes: List[int], rows_per_rank: List[int], node_size: int) -> Optional[List[LayerSkew]]:
    """Each MoE layer's LayerSkew (None without --skew). A routing report's layers go to the plan's in order (one
    layer's to all)."""
    if skew is None:
        return None
    if isinstance(skew, list):
        if len(skew) not in (1, len(configs)):
            raise ValueError(f"--skew's routing report has {len(skew)} MoE layers, the plan {len(configs)}: give a "
                             f"report of the same model, or of one layer")
        skew = skew * len(configs) if len(skew) == 1 else skew
    else:
        skew = [skew] * len(configs)
    return [layer_skew(c, s, params, b, rows, node_size)
            for c, s, b, rows in zip(configs, skew, dtype_bytes, rows_per_rank)]
