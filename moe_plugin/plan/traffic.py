"""The bytes one training step hands to collectives on one rank: the MoE layers' all-to-alls (from each layer's
MoEConfig and the tokens of one micro-batch, as dispatch.py and dispatchers/all_to_all.py route them) and the
gradient reductions (from the rank's gradient bytes).

Legend: T tokens a rank routes in one layer call, K top-k, E experts, E_local experts per rank, C capacity per
expert, D model dim, W ranks in the expert-parallel group.

A layer call at parallel degree r = 1 sends each kept row (a token's copy for one expert) once to the rank holding
its expert and gets its output back: two all-to-alls forward (dispatch, combine) and their two gradients backward,
each carrying the rows * D * element bytes a rank sends (its own share included). At degree r > 1 each row goes
to r hidden slices (r times the bytes); at r = 0 nothing is exchanged. "2dh" passes the bytes twice (inside the
node, then across nodes).
    balanced: every expert gets T*K/E of a rank's rows, kept up to C: what every rank sends and receives;
    bound:    the most one rank can receive: every rank fills each of its E_local experts up to C (dropless:
              up to T), at most all W ranks' T*K rows.
Beyond what the layer keeps for backward on one rank (every expert local: computed from the token rows), the
exchange keeps the rows it received ([rows, D], the experts' input), the rows the combine brought back ([rows, D]:
the gates' gradient reads them) and two int64 row indexes (measured on the real layer:
tests/plan/test_plan_real_runs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import MoEConfig
from ..dispatch import fixed_capacity

PASSES = 4      # dispatch and combine forward, and their gradients backward
INDEX_BYTES = 8


@dataclass
class LayerTraffic:
    rows_kept: int          # rows a rank routes and keeps, routing balanced (what its experts compute)
    rows_balanced: int      # kept rows one rank sends in one all-to-all, routing balanced (0: no exchange)
    rows_bound: int         # rows the busiest rank can receive in one all-to-all, at the capacity bound
    capacity: int           # C (dropless: T)
    bytes_balanced: int     # of one step, all four passes
    bytes_bound: int
    kept_bytes: int         # what the exchange keeps for backward beyond the local path (see above)


def parallel_degree(config: MoEConfig) -> int:
    """The degree the traffic is counted at: the configured one; "auto"/"auto_once" are counted at 1."""
    return config.parallel if isinstance(config.parallel, int) else 1


def exchanges(config: MoEConfig, node_size: int) -> int:
    """All-to-alls per pass: 2 for a two-step "2dh" exchange (several nodes of several ranks), else 1."""
    return 2 if config.a2a == "2dh" and 1 < node_size < config.ep_size else 1


def capacity(config: MoEConfig, tokens: int) -> int:
    """C at `tokens` tokens per rank, as the layer computes it (its formula, alignment, min_capacity; dropless: T)."""
    if not config.capacity_factor:
        return tokens
    return fixed_capacity(abs(config.capacity_factor), tokens, config.num_experts, config.top_k, config.min_capacity,
                          config.capacity_formula, config.capacity_alignment)


def check_capacity(config: MoEConfig, tokens: int, key: str, batch_key: str) -> None:
    """ValueError when a fixed capacity gives each expert no slot at `tokens` tokens per rank: every token
    dropped. key: the setting of capacity_factor in the host's config, batch_key: of the micro-batch."""
    cf, T, E, K = config.capacity_factor, tokens, config.num_experts, config.top_k
    if not cf or capacity(config, T) > 0:
        return
    per_expert = -(-T // E)
    raise ValueError(f"{key}={cf} gives each expert 0 slots at {T} tokens per rank (capacity_formula="
                     f"{config.capacity_formula!r}: {K} * int({abs(cf)} * ceil({T} / {E})) = 0, min_capacity="
                     f"{config.min_capacity}): every token would be dropped; allowed: |{key}| >= {1 / per_expert:.4g} "
                     f"at this micro-batch, a larger {batch_key}, or min_capacity >= 1")


def layer_traffic(config: MoEConfig, tokens: int, element_bytes: int, node_size: int) -> LayerTraffic:
    T, K, E, W = tokens, config.top_k, config.num_experts, config.ep_size
    C = capacity(config, T)
    share, extra = divmod(T * K, E)         # loads as even as whole rows allow
    balanced = extra * min(share + 1, C) + (E - extra) * min(share, C)
    local_experts = max(1, E // W)
    bound = min(W * T * K, W * local_experts * min(C, T))
    kept, r = balanced, parallel_degree(config)
    if W == 1 or r == 0:
        balanced = bound = 0
    scale = PASSES * r * exchanges(config, node_size) * config.model_dim * element_bytes
    saved = r * balanced * (2 * config.model_dim * element_bytes + 2 * INDEX_BYTES)
    return LayerTraffic(kept, balanced, bound, C, balanced * scale, bound * scale, saved)
