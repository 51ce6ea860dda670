"""Analytic cost of one expert-parallel all-to-all: flat vs 2D-hierarchical (2DH).

Legend (all per rank, one all-to-all):
    S       bytes a rank sends in total, split evenly over all W ranks (S/W per peer)
    W       world size (ranks = GPUs), W = N * L
    N       nodes
    L       GPUs (ranks) per node
    a_i     intra-node per-message latency (alpha), seconds      (NVLink)
    b_i     intra-node bandwidth per direction per GPU, bytes/s  (NVLink)
    a_e     inter-node per-message latency, seconds              (InfiniBand)
    b_e     inter-node bandwidth per GPU (its own NIC), bytes/s  (InfiniBand)
    b_m     local copy rate, bytes copied per second             (HBM)
    m(k, x, a, b) = k * (a + x / b)     k messages of x bytes issued back to back on one link

Flat all-to-all (one send per peer, e.g. NCCL send/recv in a group):
    L-1 peers share the node, W-L do not; every message carries S/W bytes.
    intra = m(L-1, S/W, a_i, b_i)
    inter = m(W-L, S/W, a_e, b_e)
    flat  = max(intra, inter)      the two link levels work in parallel (default)
          = intra + inter          with serial=True (--serial): one engine issues both levels

2DH all-to-all (Tutel, "Tutel: Adaptive Mixture-of-Experts at Scale"). Rank (n, l) starts with
chunks ordered by destination rank (n', l'), node-major, and must end with chunks ordered by
source rank, node-major:
    copy 1   stride copy [n'][l'] -> [l'][n']: the N chunks for local peer l' become contiguous
    phase 1  intra-node all-to-all: to each local peer l', its N chunks, S/L bytes in one message
             -> now holds, for every local source l'', the chunks for (n', l): layout [l''][n']
    copy 2   stride copy [l''][n'] -> [n'][l'']: the L chunks for node n' become contiguous
    phase 2  inter-node all-to-all among the ranks with the same l: to each other node, S/N bytes
             -> receives from node n'' its L chunks [l''], so the buffer is [n''][l''] = the
                source-rank order a flat all-to-all produces; no third copy is needed
    2dh = m(L-1, S/L, a_i, b_i) + 2 * S / b_m + m(N-1, S/N, a_e, b_e)
Both copies are transposes of an N x L (or L x N) grid of chunks, so they are identities when
N = 1 or L = 1 and cost nothing there; 2DH then equals flat exactly (Tutel's kernel also falls
back to the flat all-to-all in those cases). The inter-node bytes are the same for both,
S * (W-L)/W = S * (N-1)/N; 2DH trades W-L inter-node latencies for N-1, paying for it with
larger intra-node traffic (S*(L-1)/L instead of S*(L-1)/W) and two local copies.

Assumptions:
    - Uniform traffic: every rank sends S/W bytes to every rank (itself included).
    - The chunk a rank keeps for itself costs nothing in flat (it is S/W at memory speed); in 2DH
      it rides along in the two copies, which move all S bytes.
    - Each GPU has its own NIC (one 200 Gb/s NIC per GPU = 25 GB/s); no contention in the
      network core; links are full duplex, so sends and receives overlap.
    - Messages to different peers on one link level go back to back (no pipelining of the
      alpha terms across peers); this is what makes many tiny messages expensive.
    - Units: MB = 1e6 bytes, GB/s = 1e9 bytes/s (bytes, not bits).
Defaults: NVLink a_i = 3 us, b_i = 150 GB/s; InfiniBand a_e = 10 us, b_e = 25 GB/s; b_m = 1000 GB/s.

    python benchmarks/a2a_cost_model.py --message-mb 1 16 64 --gpus-per-node 8 [--json]
"""

import argparse
import json
from dataclasses import asdict, dataclass

MB = 1e6
GB = 1e9
US = 1e-6


@dataclass(frozen=True)
class Links:
    """Latency (microseconds) and bandwidth (GB/s) of each link level; see the module legend."""

    intra_latency_us: float = 3.0
    intra_gbps: float = 150.0
    inter_latency_us: float = 10.0
    inter_gbps: float = 25.0
    mem_gbps: float = 1000.0

    def __post_init__(self):
        for name in ("intra_latency_us", "inter_latency_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("intra_gbps", "inter_gbps", "mem_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def _check(message_bytes, world_size, gpus_per_node):
    if not message_bytes > 0:
        raise ValueError(f"message_bytes must be > 0, got {message_bytes!r}")
    for name, value in (("gpus_per_node", gpus_per_node), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if world_size % gpus_per_node:
        raise ValueError(
            f"world_size ({world_size}) must be a multiple of gpus_per_node ({gpus_per_node})")


def _messages(count, nbytes, latency_us, gbps):
    """m(k, x, a, b): `count` messages of `nbytes` each, back to back on one link, in seconds."""
    return count * (latency_us * US + nbytes / (gbps * GB))


def flat_seconds(message_bytes, world_size, gpus_per_node, links=Links(), serial=False):
    """Seconds for a flat all-to-all where each rank sends `message_bytes` in total."""
    _check(message_bytes, world_size, gpus_per_node)
    W, L, S = world_size, gpus_per_node, message_bytes
    intra = _messages(L - 1, S / W, links.intra_latency_us, links.intra_gbps)
    inter = _messages(W - L, S / W, links.inter_latency_us, links.inter_gbps)
    return intra + inter if serial else max(intra, inter)


def hier_seconds(message_bytes, world_size, gpus_per_node, links=Links()):
    """Seconds for a 2DH all-to-all: copy, intra-node phase, copy, inter-node phase."""
    _check(message_bytes, world_size, gpus_per_node)
    W, L, S = world_size, gpus_per_node, message_bytes
    N = W // L
    phase1 = _messages(L - 1, S / L, links.intra_latency_us, links.intra_gbps)
    copies = 0.0 if N == 1 or L == 1 else 2 * S / (links.mem_gbps * GB)
    phase2 = _messages(N - 1, S / N, links.inter_latency_us, links.inter_gbps)
    return phase1 + copies + phase2


def table(message_mb, gpus_per_node=8, max_gpus=2048, links=Links(), serial=False):
    """Rows for W = L, 2L, 4L, ... <= max_gpus at one message size (MB per rank)."""
    if not message_mb > 0:
        raise ValueError(f"message_mb must be > 0, got {message_mb!r}")
    _check(message_mb * MB, gpus_per_node, gpus_per_node)
    if not max_gpus >= gpus_per_node:
        raise ValueError(f"max_gpus ({max_gpus!r}) must be >= gpus_per_node ({gpus_per_node!r})")
    rows = []
    world_size = gpus_per_node
    while world_size <= max_gpus:
        flat = flat_seconds(message_mb * MB, world_size, gpus_per_node, links, serial)
        hier = hier_seconds(message_mb * MB, world_size, gpus_per_node, links)
        rows.append({
            "message_mb": message_mb,
            "gpus": world_size,
            "nodes": world_size // gpus_per_node,
            "flat_ms": flat * 1e3,
            "2dh_ms": hier * 1e3,
            "speedup": flat / hier if hier else 1.0,  # W = 1: nothing moves
        })
        world_size *= 2
    return rows


def format_table(rows):
    lines = [f"{'W':>6} {'nodes':>6} {'flat ms':>10} {'2dh ms':>10} {'flat/2dh':>9}"]
    for r in rows:
        lines.append(f"{r['gpus']:>6} {r['nodes']:>6} {r['flat_ms']:>10.3f} "
                     f"{r['2dh_ms']:>10.3f} {r['speedup']:>8.2f}x")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--message-mb", type=float, nargs="+", default=[64.0],
                        help="bytes each rank sends in total, in MB (1e6 bytes); several allowed")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--max-gpus", type=int, default=2048)
    defaults = Links()
    parser.add_argument("--intra-latency-us", type=float, default=defaults.intra_latency_us)
    parser.add_argument("--intra-gbps", type=float, default=defaults.intra_gbps,
                        help="intra-node GB/s (bytes) per direction per GPU")
    parser.add_argument("--inter-latency-us", type=float, default=defaults.inter_latency_us)
    parser.add_argument("--inter-gbps", type=float, default=defaults.inter_gbps,
                        help="inter-node GB/s (bytes) per GPU")
    parser.add_argument("--mem-gbps", type=float, default=defaults.mem_gbps,
                        help="local copy rate in GB/s (bytes copied per second)")
    parser.add_argument("--serial", action="store_true",
                        help="flat: sum intra- and inter-node time instead of taking the max")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)

    try:
        links = Links(args.intra_latency_us, args.intra_gbps, args.inter_latency_us,
                      args.inter_gbps, args.mem_gbps)
        tables = [table(mb, args.gpus_per_node, args.max_gpus, links, args.serial)
                  for mb in args.message_mb]
    except ValueError as err:
        parser.error(str(err))

    if args.json:
        print(json.dumps({"links": asdict(links), "serial": args.serial,
                          "rows": [row for rows in tables for row in rows]}, indent=2))
        return
    print(f"links: {asdict(links)}, flat levels {'serial' if args.serial else 'parallel'}")
    for mb, rows in zip(args.message_mb, tables):
        print(f"\n{mb:g} MB per rank, {args.gpus_per_node} GPUs per node")
        print(format_table(rows))


if __name__ == "__main__":
    main()
