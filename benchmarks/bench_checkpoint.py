"""Checkpoint save and load of `moe-plugin train`: the old gather design against the sharded one.

    python benchmarks/bench_checkpoint.py [--hidden 512 1024 2048] [--processes 1 2 4] [--repeats 2]

The model: the trainer's TransformerLM, dim 256, 4 blocks, every block MoE with 8 experts of the
given hidden size, AdamW state filled in; parallel.ep_size = the number of processes (gloo on CPU,
one folder on the local disk). Per design, model size and number of processes: the slowest rank's
save and load seconds (median of the repeats), and the largest extra memory one process needed
during the save or load (its peak resident memory, reset just before via /proc/self/clear_refs,
minus its resident memory then).

gather (the design before sharded checkpoints): every expert is gathered onto every rank, every
rank's expert optimizer state and RNG states go to rank 0 by all_gather_object, rank 0 writes one
file; on load every rank reads the whole file and keeps its share.
sharded: moe_plugin.train.save / restore (torch.distributed.checkpoint, each rank its own experts).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_plugin import train
from moe_plugin.checkpoint import ensure_optimizer_state
from moe_plugin.parallel.expert_grads import expert_parameters


def config(hidden: int, processes: int):
    return train.load_config(None, ["model.dim=256", "model.layers=4", "model.heads=4", "model.moe_every=1",
                                    "model.ffn_hidden=256", "model.seq_len=64", "moe.num_experts=8",
                                    f"moe.hidden_size={hidden}", f"parallel.ep_size={processes}",
                                    "train.batch_size=2", "train.eval_batches=1", "log.progress=false"])


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured(procs, action):
    """(seconds of the slowest rank, the largest extra peak memory of one rank in MB)."""
    if procs.world_size > 1:
        dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")   # reset VmHWM to the current resident memory
    base = rss_kib("VmRSS")
    start = time.perf_counter()
    action()
    if procs.world_size > 1:
        dist.barrier()
    seconds, extra_mb = time.perf_counter() - start, (rss_kib("VmHWM") - base) / 1024
    both = torch.tensor([seconds, extra_mb], dtype=torch.float64)
    if procs.world_size > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both.tolist()


# ---------------------------------------------------------------- the old design (the baseline)

def gather_save(parts, procs, path: Path) -> None:
    model_state = train.full_state_dict(parts.model)
    experts = {id(p) for _, p in expert_parameters(parts.model)}
    params = [p for group in parts.optimizer.param_groups for p in group["params"]]
    mine = {"expert_optimizer": {i: dict(parts.optimizer.state[p]) for i, p in enumerate(params) if id(p) in experts},
            "torch_rng": torch.get_rng_state()}
    ranks = [mine]
    if procs.world_size > 1:
        ranks = [None] * procs.world_size
        dist.all_gather_object(ranks, mine)
    if procs.rank == 0:
        state = {"model": model_state, "optimizer": parts.optimizer.state_dict(), "ranks": ranks}
        handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
        os.replace(tmp, path)


def gather_load(parts, procs, path: Path) -> None:
    state = torch.load(path, map_location="cpu", weights_only=True)
    train.load_full_state_dict(parts.model, state["model"])
    state["optimizer"]["state"].update(state["ranks"][procs.rank]["expert_optimizer"])
    parts.optimizer.load_state_dict(state["optimizer"])


# ---------------------------------------------------------------- one run

def worker(rank, processes, port, hidden, repeats, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if processes > 1:
        dist.init_process_group("gloo", rank=rank, world_size=processes)
    cfg = config(hidden, processes)
    procs = train.Processes(rank, processes, torch.device("cpu"), False)
    parts = train.build(cfg, procs)
    ensure_optimizer_state(parts.optimizer)
    for state in parts.optimizer.state.values():
        state["exp_avg"].normal_()
        state["exp_avg_sq"].uniform_()
    local_values = sum(p.numel() for p in parts.model.parameters())
    root = Path(out_dir)
    results = {}
    for design in ("gather", "sharded"):
        saves, loads = [], []
        for repeat in range(repeats):
            if design == "gather":
                path = root / "gather.pt"
                saves.append(measured(procs, lambda: gather_save(parts, procs, path)))
                fresh = train.build(cfg, procs)
                loads.append(measured(procs, lambda: gather_load(fresh, procs, path)))
            else:
                saves.append(measured(procs, lambda: train.save(parts, procs, cfg, root, 1, train.Window())))
                fresh = train.build(cfg, procs)
                path = train.checkpoint_path(root, 1)
                loads.append(measured(procs, lambda: train.restore(fresh, procs, cfg, path)))
        size = (root / "gather.pt").stat().st_size if design == "gather" else \
            sum(f.stat().st_size for f in train.checkpoint_path(root, 1).iterdir())
        results[design] = {"save_s": statistics.median(s for s, _ in saves), "save_mb": max(m for _, m in saves),
                           "load_s": statistics.median(s for s, _ in loads), "load_mb": max(m for _, m in loads),
                           "file_mb": size / 1e6}
    if rank == 0:
        results["values_per_process"] = local_values
        (root / "result.json").write_text(json.dumps(results))
    if processes > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| expert hidden | model MB (fp32) | processes | design | save s | save extra MB/process | "
          "load s | load extra MB/process | on disk MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hidden in args.hidden:
        full = sum(p.numel() for p in train.build(config(hidden, 1), train.Processes(0, 1, torch.device("cpu"),
                                                                                        False)).model.parameters())
        for processes in args.processes:
            out = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
            try:
                mp.spawn(worker, args=(processes, free_port(), hidden, args.repeats, str(out)), nprocs=processes)
                result = json.loads((out / "result.json").read_text())
            finally:
                shutil.rmtree(out, ignore_errors=True)
            for design in ("gather", "sharded"):
                r = result[design]
                print(f"| {hidden} | {full * 4 / 1e6:.0f} | {processes} | {design} | {r['save_s']:.2f} | "
                      f"{r['save_mb']:.0f} | {r['load_s']:.2f} | {r['load_mb']:.0f} | {r['file_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
