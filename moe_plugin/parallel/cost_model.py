"""Time estimates for one expert-parallel all-to-all (flat or 2DH) and one MoE layer under a parallel
degree r and an overlap degree d: the run-time tuner orders its search by them, and
benchmarks/a2a_cost_model.py fits them and projects them to large clusters.

Legend: S bytes one rank sends in one all-to-all (S/W to each rank, itself included), W ranks,
L ranks per node, N = W / L nodes, p peers a rank exchanges with in one step, R rows a rank routes
(kept ones), D model dim, H expert hidden dim, E experts, r parallel degree, d overlap degree.

One step in which a rank sends k messages of x bytes each over one link level, while it talks to
p peers in all, costs
    m(k, x, p) = k * (a + g * p) + k * x / B
a: start-up of one message; g: what every further peer adds to each message's start-up (more
connections and queues in flight per rank, incast at the receivers; this is why a flat exchange
slows down faster than its byte count grows at scale); B: the link's bandwidth per rank.

    flat = t0 + combine(m_intra(L-1, S/W, W-1), m_inter(W-L, S/W, W-1))
    2dh  = 2 t0 + 2 S / B_copy + m_intra(L-1, S/L, L-1) + m_inter(N-1, S/N, N-1)
t0: fixed cost of one collective call (launch and completion). combine = max when the two link
levels move data at the same time (NVLink next to InfiniBand), sum when they share one resource
(gloo on one host). 2DH: a stride copy groups the chunks by local destination, an intra-node
exchange, a second stride copy groups them by destination node, an inter-node exchange among the
ranks with the same local index; the copies run at B_copy bytes copied per second. With N = 1 or
L = 1 the layer runs the flat exchange for "2dh" (dispatchers/all_to_all.py), and so does this
model.

A layer (forward + backward) under degree r (dispatchers/all_to_all.py):
    r = 0: every rank gathers all E experts (an all-gather forward, an all-reduce of the gathered
           gradients backward, one of each per weight tensor: w1, b1, w2, b2), no token exchange;
    r >= 1: rows go by all-to-all (r copies of each when experts are sliced), weights are gathered
           over the G = (W / E) / r ranks that make one compute slice.
The expert compute is the same for every r: 2 * R * D * H * matrices flops forward, twice that
backward. With overlap degree d the exchange and the compute are cut into d chunks; chunk c + 1
travels while chunk c is computed:
    pass(d) = 2 a + f + (d - 1) * max(2 a, f)
a: one chunk's all-to-all (S / d bytes), f: one chunk's compute. d = 1 gives 2 a + f (nothing
hidden); with compute-bound chunks only the first dispatch and the last combine show. Where the
exchange and the compute share the same cores (Params.overlap False) the chunks run one by one:
d * (2 a + f).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

ALGORITHMS = ("flat", "2dh")
US = 1e-6
GB = 1e9
TFLOP = 1e12


@dataclass(frozen=True)
class Params:
    """Link and compute rates; times in microseconds, rates in GB/s (1e9 bytes/s) and TFLOP/s."""

    intra_startup_us: float
    intra_per_peer_us: float
    intra_gbps: float
    inter_startup_us: float
    inter_per_peer_us: float
    inter_gbps: float
    copy_gbps: float
    call_us: float
    compute_tflops: float
    levels_concurrent: bool = True
    overlap: bool = True        # exchange and compute can run at the same time (False: chunks run one by one)
    cores: float = 0.0          # > 0: all ranks share this many cores (one host), 0: each rank has its own

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "cores":
                if not value >= 0:
                    raise ValueError(f"Params.cores must be >= 0, got {value!r}")
            elif f.name in ("levels_concurrent", "overlap"):
                if not isinstance(value, bool):
                    raise TypeError(f"Params.{f.name} must be a bool, got {value!r}")
            elif f.name.endswith("_us"):
                if not value >= 0:
                    raise ValueError(f"Params.{f.name} must be >= 0, got {value!r}")
            elif not value > 0:
                raise ValueError(f"Params.{f.name} must be > 0, got {value!r}")

    def with_(self, **changes) -> "Params":
        return replace(self, **changes)


# Azure NDm A100 v4 (the Tutel paper's cluster): 8 A100s per node on NVSwitch, one 200 Gb/s HDR
# InfiniBand NIC per GPU. Fixed from the hardware and from statements in the paper; the growth of
# the inter-node start-up per peer is fitted to the paper's 4.25x layer gain of 2DH at 2,048 GPUs
# (`python benchmarks/a2a_cost_model.py --paper` shows the fit and every check against the paper).
NDM_A100_V4 = Params(
    intra_startup_us=3.0,       # NVLink message start-up
    intra_per_peer_us=0.02,     # assumed; at scale flat hides its 7 intra-node messages behind its network ones
    intra_gbps=196.0,           # paper: a 128 MiB exchange inside one node of 8 takes ~600 us
    inter_startup_us=5.0,       # InfiniBand RDMA message start-up
    inter_per_peer_us=0.00722,  # fitted: 2DH layer gain 4.25x at 128 MiB, 2,048 GPUs
    inter_gbps=25.0,            # 200 Gb/s per GPU
    copy_gbps=300.0,            # stride copies of small chunks, well below HBM's 2 TB/s
    call_us=25.0,               # one NCCL collective: launch and completion
    compute_tflops=150.0,       # fp16 expert GEMMs at D = H = 2048
)

# This machine: gloo processes on 2 shared CPU cores. Fitted by `python benchmarks/a2a_cost_model.py
# --measure` (4 gloo processes, node_size 2, 16 KiB to 16 MiB per rank; 2026-11-24). A call's fixed
# cost (~1.7 ms: 4 processes taking turns on 2 cores) swamps the per-message start-up, which the fit
# puts at 0; 2DH's regrouping copies (index_select on the host) run at ~0.3 GB/s.
GLOO_HERE = Params(
    intra_startup_us=0.0,
    intra_per_peer_us=0.0,
    intra_gbps=0.40,
    inter_startup_us=0.0,
    inter_per_peer_us=0.0,
    inter_gbps=0.40,
    copy_gbps=0.30,
    call_us=1750.0,
    compute_tflops=0.028,       # one thread's fp32 GEMM rate
    levels_concurrent=False,
    overlap=False,              # no spare core: chunking only adds calls (benchmarks/RESULTS.md, bench_parallel)
    cores=2.0,                  # 4 ranks on 2 cores: the busiest rank computes alone only when the others idle
)


def _check_sizes(bytes_per_rank, world_size, node_size):
    if not bytes_per_rank >= 0:
        raise ValueError(f"bytes_per_rank must be >= 0, got {bytes_per_rank!r}")
    for name, value in (("world_size", world_size), ("node_size", node_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if world_size % node_size:
        raise ValueError(f"world_size ({world_size}) must be a multiple of node_size ({node_size})")


def _messages(count, nbytes, peers, startup_us, per_peer_us, gbps) -> float:
    """m(k, x, p) in seconds: `count` messages of `nbytes`, the rank talking to `peers` peers."""
    return count * ((startup_us + per_peer_us * peers) * US + nbytes / (gbps * GB))


def _runs_flat(algorithm: str, world_size: int, node_size: int) -> bool:
    return algorithm == "flat" or node_size in (1, world_size)


def a2a_parts(algorithm: str, bytes_per_rank: float, world_size: int, node_size: int,
              params: Params) -> Dict[str, float]:
    """The terms of a2a_seconds, in seconds: call, copies, intra, inter (flat: the levels before
    they are combined)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    _check_sizes(bytes_per_rank, world_size, node_size)
    W, L, S, P = world_size, node_size, float(bytes_per_rank), params
    N = W // L
    if W == 1:
        return {"call": 0.0, "copies": 0.0, "intra": 0.0, "inter": 0.0}
    if _runs_flat(algorithm, W, L):
        return {"call": P.call_us * US, "copies": 0.0,
                "intra": _messages(L - 1, S / W, W - 1, P.intra_startup_us, P.intra_per_peer_us, P.intra_gbps),
                "inter": _messages(W - L, S / W, W - 1, P.inter_startup_us, P.inter_per_peer_us, P.inter_gbps)}
    return {"call": 2 * P.call_us * US, "copies": 2 * S / (P.copy_gbps * GB),
            "intra": _messages(L - 1, S / L, L - 1, P.intra_startup_us, P.intra_per_peer_us, P.intra_gbps),
            "inter": _messages(N - 1, S / N, N - 1, P.inter_startup_us, P.inter_per_peer_us, P.inter_gbps)}


def a2a_seconds(algorithm: str, bytes_per_rank: float, world_size: int, node_size: int,
                params: Params) -> float:
    """Estimated seconds of one all-to-all in which every rank sends bytes_per_rank bytes in all."""
    parts = a2a_parts(algorithm, bytes_per_rank, world_size, node_size, params)
    concurrent = params.levels_concurrent and _runs_flat(algorithm, world_size, node_size)
    links = max(parts["intra"], parts["inter"]) if concurrent else parts["intra"] + parts["inter"]
    return parts["call"] + parts["copies"] + links


def allgather_seconds(gathered_bytes: float, group_size: int, node_size: int, params: Params,
                      calls: int = 1) -> float:
    """Ring all-gathers (`calls` of them) in which every rank ends with gathered_bytes in all (its own
    1/group_size share included); the slowest link of the ring sets the pace. A reduce-scatter costs
    the same; an all-reduce is a reduce-scatter then an all-gather. Nothing to gather is no call."""
    if group_size <= 1 or gathered_bytes <= 0:
        return 0.0
    inside = group_size <= node_size
    gbps = params.intra_gbps if inside else params.inter_gbps
    startup = params.intra_startup_us if inside else params.inter_startup_us
    steps = group_size - 1
    return calls * (params.call_us + steps * startup) * US + steps * gathered_bytes / group_size / (gbps * GB)


def gather_weights_seconds(weight_bytes: float, group_size: int, node_size: int, params: Params,
                           tensors: int) -> float:
    """What parallel/expert_parallel.py's weight gather costs, forward + backward: per weight tensor an
    all-gather, and in the backward an all-reduce of the gathered gradients (twice the ring steps)."""
    forward = allgather_seconds(weight_bytes, group_size, node_size, params, calls=tensors)
    backward = allgather_seconds(2 * weight_bytes, group_size, node_size, params, calls=tensors)
    return forward + backward


def replica_seconds(copies: int, expert_bytes: float, world_size: int, node_size: int, params: Params) -> float:
    """What replicas of hot experts (parallel/replicas.py) cost one layer call, forward + backward: the owner
    sending the most copies sends `copies` experts' weights (one message each, in one all-to-all) and gets their
    gradients back the same way; over the network when the ep group spans nodes. No copy is no call."""
    if copies <= 0 or world_size <= 1:
        return 0.0
    inside = world_size <= node_size
    startup = params.intra_startup_us if inside else params.inter_startup_us
    gbps = params.intra_gbps if inside else params.inter_gbps
    return 2 * (params.call_us * US + copies * (startup * US + expert_bytes / (gbps * GB)))


def row_seconds(model_dim: int, hidden_dim: int, matrices: int, dtype_bytes: int, world_size: int, node_size: int,
                params: Params) -> float:
    """What one routed row costs the rank that computes it, forward + backward: its expert compute (3 x 2 x D x H x
    matrices flops) and its share of the four all-to-all passes the rank receives (D x dtype_bytes each; over the
    network when the ep group spans nodes). A copy of a hot expert pays where it moves more rows off the busiest
    rank than replica_seconds / row_seconds."""
    inside = world_size <= node_size
    gbps = params.intra_gbps if inside else params.inter_gbps
    return 6.0 * model_dim * hidden_dim * matrices / (params.compute_tflops * TFLOP) + \
        4 * model_dim * dtype_bytes / (gbps * GB)


@dataclass(frozen=True)
class Workload:
    """One layer call as the slowest rank sees it: rows_per_rank rows (kept, all k choices counted)
    to exchange and compute, the expert shape and the element size. local_rows: the rows a rank
    routes from its own tokens, which r = 0 computes (default rows_per_rank); with skewed routing
    the slowest rank's rows_per_rank exceeds it. total_rows: the rows all ranks compute together
    (default world_size * local_rows); it matters only where ranks share cores (Params.cores)."""

    rows_per_rank: int
    model_dim: int
    hidden_dim: int
    num_experts: int
    dtype_bytes: int = 2
    matrices: int = 2           # 2: w1, w2; 3 for a gated (SwiGLU) expert
    local_rows: Optional[int] = None
    weight_tensors: int = 4     # gathered one by one: w1, b1, w2, b2
    total_rows: Optional[int] = None

    def __post_init__(self):
        for name in ("rows_per_rank", "local_rows", "total_rows"):
            value = getattr(self, name)
            if value is None and name != "rows_per_rank":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Workload.{name} must be an integer >= 0, got {value!r}")
        for name in ("model_dim", "hidden_dim", "num_experts", "dtype_bytes", "matrices", "weight_tensors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be an integer >= 1, got {value!r}")

    @property
    def a2a_bytes(self) -> int:
        """Bytes a rank sends in one all-to-all at degree r = 1."""
        return self.rows_per_rank * self.model_dim * self.dtype_bytes

    @property
    def expert_bytes(self) -> int:
        return self.matrices * self.model_dim * self.hidden_dim * self.dtype_bytes

    def forward_flops(self, rows: Optional[int] = None) -> float:
        rows = self.rows_per_rank if rows is None else rows
        return 2.0 * rows * self.model_dim * self.hidden_dim * self.matrices


def degrees(world_size: int, num_experts: int) -> List[int]:
    """The parallel degrees r a layer can run on world_size ranks (as groups.ExpertLayout.degrees)."""
    slices = max(1, world_size // num_experts)
    return [0] + [r for r in range(1, slices + 1) if slices % r == 0]


def pipelined_seconds(a2a_chunk: float, compute_chunk: float, overlap_degree: int, overlap: bool = True) -> float:
    """One pass (forward or backward) of d chunks: dispatch, compute, combine, overlapped (or one
    chunk after the other when overlap is False)."""
    if not overlap:
        return overlap_degree * (2 * a2a_chunk + compute_chunk)
    return 2 * a2a_chunk + compute_chunk + (overlap_degree - 1) * max(2 * a2a_chunk, compute_chunk)


def layer_parts(r: int, overlap_degree: int, algorithm: str, workload: Workload, world_size: int,
                node_size: int, params: Params) -> Dict[str, float]:
    """The terms of layer_seconds, in seconds: gather (forward all-gather + backward
    all-reduce of weights), forward, backward (exchange and compute, overlapped), a2a (one
    unchunked all-to-all, for reference) and compute (forward + backward, unoverlapped)."""
    _check_sizes(workload.a2a_bytes, world_size, node_size)
    if isinstance(overlap_degree, bool) or not isinstance(overlap_degree, int) or overlap_degree < 1:
        raise ValueError(f"overlap_degree must be an integer >= 1, got {overlap_degree!r}")
    if r not in degrees(world_size, workload.num_experts):
        raise ValueError(f"parallel degree r={r!r} is not possible with num_experts={workload.num_experts} on "
                         f"world_size={world_size}; possible: {degrees(world_size, workload.num_experts)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    W, E, d = world_size, workload.num_experts, overlap_degree
    local = workload.rows_per_rank if workload.local_rows is None else workload.local_rows
    total = W * local if workload.total_rows is None else workload.total_rows

    def compute_seconds(rows):
        """The slowest rank's forward compute; on shared cores no faster than all ranks' rows on them."""
        rows = max(rows, total / params.cores) if params.cores else rows
        return workload.forward_flops(rows) / (params.compute_tflops * TFLOP)

    compute_f = compute_seconds(workload.rows_per_rank)
    if r == 0:
        own_f = compute_seconds(local)
        gather = gather_weights_seconds(E * workload.expert_bytes, W, node_size, params, workload.weight_tensors)
        return {"gather": gather, "forward": own_f, "backward": 2 * own_f, "a2a": 0.0, "compute": 3 * own_f}
    slices = max(1, W // E)
    group = slices // r
    gather = gather_weights_seconds(workload.expert_bytes / r, group, node_size, params, workload.weight_tensors)
    sent = r * workload.a2a_bytes
    chunk = a2a_seconds(algorithm, sent / d, W, node_size, params)
    return {"gather": gather,
            "forward": pipelined_seconds(chunk, compute_f / d, d, params.overlap),
            "backward": pipelined_seconds(chunk, 2 * compute_f / d, d, params.overlap),
            "a2a": a2a_seconds(algorithm, sent, W, node_size, params),
            "compute": 3 * compute_f}


def layer_seconds(r: int, overlap_degree: int, algorithm: str, workload: Workload, world_size: int,
                  node_size: int, params: Params) -> float:
    """Estimated seconds of one layer call, forward + backward, under (r, d, algorithm)."""
    parts = layer_parts(r, overlap_degree, algorithm, workload, world_size, node_size, params)
    return parts["gather"] + parts["forward"] + parts["backward"]


Candidate = Tuple[int, int, str]


def rank_candidates(candidates: Iterable[Candidate], workload: Workload, world_size: int, node_size: int,
                    params: Params) -> List[Tuple[Candidate, float]]:
    """(candidate, estimated seconds) for each (r, d, algorithm), fastest first (ties keep the
    given order)."""
    timed = [((r, d, a), layer_seconds(r, d, a, workload, world_size, node_size, params))
             for r, d, a in candidates]
    return sorted(timed, key=lambda item: item[1])


def best_candidate(candidates: Sequence[Candidate], workload: Workload, world_size: int, node_size: int,
                   params: Params) -> Tuple[Candidate, float]:
    return rank_candidates(candidates, workload, world_size, node_size, params)[0]
