"""A training step's predicted time on one device profile, from parallel/cost_model.py's terms, nothing overlapped:

    compute     3 x the forward's FLOPs / the device's rate: torch's FlopCounterMode on the forward without data,
                plus the expert GEMMs it does not see (moe_plugin's grouped_mm custom op): 2 x rows kept x D x H x
                matrices per MoE layer (3 matrices gated, 2 otherwise; cost_model.Workload.forward_flops), and with
                MoEConfig.recompute "experts" the first projection once more in backward (2 x rows x D x H x 2
                gated, x 1 otherwise)
    all-to-all  each MoE layer's four exchanges at balanced routing (cost_model.a2a_seconds, flat or 2dh)
    skew        with --skew (skew.py), each MoE layer's expert compute and exchange bytes times the busiest rank's
                max_rank_load (after its replicas), and the replicas' weight traffic (cost_model.replica_seconds)
    gradients   DDP: a ring all-reduce of the dense gradients over the world and of the experts' over the ranks
                holding them; FSDP2: an all-gather of the parameters forward and backward (the root unit's,
                which torch keeps gathered after forward, only forward) and a reduce-scatter of the gradients
                (cost_model.allgather_seconds; an all-reduce costs two of them)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..config import GATED_ACTIVATIONS, MoEConfig
from ..parallel.cost_model import TFLOP, Params, Workload, a2a_seconds, allgather_seconds
from .skew import LayerSkew
from .traffic import PASSES, LayerTraffic

ASSUMPTIONS = ("compute at the device's rate for every FLOP (attention and expert GEMMs alike)",
               "no overlap of communication with compute",
               "routing balanced (each expert gets T*K/E rows of every rank)",
               "parallel/overlap 'auto' counted as degree 1, overlap 1")


@dataclass
class StepTime:
    compute: float
    all_to_all: float
    gradients: float
    assumptions: Sequence[str] = ASSUMPTIONS
    replicas: float = 0.0       # with --skew: the copies' weights out and gradients back

    @property
    def seconds(self) -> float:
        return self.compute + self.all_to_all + self.gradients + self.replicas


def ring_node_size(group_size: int, stride: int, node_size: int) -> int:
    """node_size for cost_model.allgather_seconds: the group's own size when its ranks (`stride` apart) share one
    node, else 1 (the ring crosses nodes)."""
    return group_size if group_size * stride <= node_size else 1


def step_time(params: Params, world_size: int, node_size: int, forward_flops: float, configs: List[MoEConfig],
              layers: List[LayerTraffic], dense_bytes: int, expert_bytes: int, ep_size: int,
              fsdp: bool, root_bytes: int = 0, skews: Optional[List[LayerSkew]] = None) -> StepTime:
    """root_bytes: with fsdp, the trainable bytes of the root unit (dense, outside the blocks). skews: each MoE
    layer's (skew.py), with --skew."""
    factors = [1.0] * len(configs) if skews is None else [s.max_rank_load for s in skews]
    experts = recomputed = 0.0
    for config, traffic, factor in zip(configs, layers, factors):
        matrices = 3 if config.activation in GATED_ACTIVATIONS else 2
        flops = factor * Workload(traffic.rows_kept, config.model_dim, config.hidden_size, config.num_experts,
                                  matrices=matrices).forward_flops()
        experts += flops
        if config.recompute == "experts":
            recomputed += flops * (matrices - 1) / matrices
    compute = (3 * (forward_flops + experts) + recomputed) / (params.compute_tflops * TFLOP)
    exchange = 0.0
    for config, traffic, factor in zip(configs, layers, factors):
        if traffic.bytes_balanced:
            ep_node = min(node_size, config.ep_size)
            algorithm = "2dh" if config.a2a == "2dh" else "flat"
            per_pass = factor * traffic.bytes_balanced / PASSES
            exchange += PASSES * a2a_seconds(algorithm, per_pass, config.ep_size, ep_node, params)
    holders = world_size // ep_size
    dense_ring = ring_node_size(world_size, 1, node_size)
    expert_ring = ring_node_size(holders, ep_size, node_size)
    if fsdp:
        gradients = (2 * allgather_seconds(dense_bytes, world_size, dense_ring, params)
                     + allgather_seconds(dense_bytes - root_bytes, world_size, dense_ring, params)
                     + 3 * allgather_seconds(expert_bytes, holders, expert_ring, params))
    else:
        gradients = (2 * allgather_seconds(dense_bytes, world_size, dense_ring, params)
                     + 2 * allgather_seconds(expert_bytes, holders, expert_ring, params))
    replicas = 0.0 if skews is None else sum(s.replica_seconds for s in skews)
    assumptions = ASSUMPTIONS if skews is None else (
        *(a for a in ASSUMPTIONS if not a.startswith("routing balanced")),
        "routing skewed as --skew says: the busiest rank's expert compute and all-to-all bytes times its "
        "max_rank_load after the replicas")
    return StepTime(compute, exchange, gradients, assumptions, replicas)
