"""A DeepSpeed MoE checkpoint loaded in another layout (its optimizer state converted) against a same-layout load.

    python benchmarks/bench_deepspeed_reshard.py [--dim 512] [--hidden 2048] [--experts 8] [--layers 2] [--stage 2]
        [--into 3]

(--stage: the saved ZeRO stage; --into: the converted loads' ZeRO stage, by default the saved one, or 2 for a
ZeRO-3 checkpoint.)

The model: integrations/deepspeed/model.py's MoETransformerLM (every block's FFN a "moe" section layer, backend
tutel, fp32, Adam). It trains one step on 2 gloo processes at ep_size 2 and saves; the checkpoint is then loaded with
engine.load_checkpoint(dir) on 2 processes at ep_size 2 (the saved layout: DeepSpeed's own load), on 2 at ep_size 1
and on 1 at ep_size 1 (converted by reshard.py). Per load: the slowest rank's seconds; the bytes the busiest rank
read (read() calls, /proc/self/io rchar, plus the tensor bytes copied out of mmap'ed files, reshard.ReadCounter);
the largest extra resident memory of one process during the load (its peak, reset just before through
/proc/self/clear_refs, minus its resident memory then; pages of mmap'ed files count while mapped), against the
checkpoint's size on disk; and the anonymous memory the load added (RssAnon after minus before: the optimizer state
it created, which a same-layout load creates too).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def read_chars() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def engine(args, ep_size: int, world: int, stage: int):
    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM
    section = {"backend": "tutel", "num_experts": args.experts, "top_k": 2, "drop_tokens": False, "ep_size": ep_size}
    config = {"train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": 1e-6, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "moe": section}
    model = MoETransformerLM(section, dim=args.dim, hidden=args.hidden, layers=args.layers, heads=4, seed=1)
    return dsi.initialize(model=model, config=config)[0]


def worker(rank: int, world: int, port: int, args, mode: str, folder: str, ep_size: int, stage: int, results):
    import logging

    import deepspeed
    from deepspeed.utils import logger

    from moe_plugin.integrations.deepspeed.model import lm_loss, synthetic_batch
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOE_PLUGIN_KERNELS="torch")
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    run = engine(args, ep_size, world, stage)
    if mode == "save":
        tokens = synthetic_batch(torch.Generator().manual_seed(rank), 4 // world, 32, 64)
        run.backward(lm_loss(run, tokens))
        run.step()
        run.save_checkpoint(folder, tag="global_step1")
    else:
        measure_load(run, rank, world, folder, results)
    # leave together and skip the interpreter's teardown: gloo may abort a process whose peer already left
    dist.barrier()
    dist.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)


def measure_load(run, rank: int, world: int, folder: str, results) -> None:
    from moe_plugin.integrations.deepspeed.reshard import ReadCounter
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")   # reset VmHWM to the current resident memory
    base_rss, base_anon, base_read, ReadCounter.bytes = rss_kib("VmRSS"), rss_kib("RssAnon"), read_chars(), 0
    start = time.perf_counter()
    run.load_checkpoint(folder)
    dist.barrier()
    seconds = time.perf_counter() - start
    numbers = torch.tensor([seconds, read_chars() - base_read + ReadCounter.bytes,
                            (rss_kib("VmHWM") - base_rss) * 1024.0, (rss_kib("RssAnon") - base_anon) * 1024.0],
                           dtype=torch.float64)
    if world > 1:
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put(numbers.tolist())


def launch(world: int, args, mode: str, folder: str, ep_size: int, stage: int):
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [context.Process(target=worker, args=(rank, world, port, args, mode, folder, ep_size, stage, results))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    numbers = results.get(timeout=1800) if mode == "load" else None
    for proc in procs:
        proc.join(timeout=600)
        if proc.exitcode != 0:
            raise RuntimeError(f"{mode} on {world} process(es) at ep_size {ep_size} failed ({proc.exitcode})")
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3),
                        help="the saved ZeRO stage")
    parser.add_argument("--into", type=int, choices=(0, 1, 2, 3),
                        help="the converted loads' ZeRO stage (default: the saved one; 2 for a ZeRO-3 checkpoint)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_ds_reshard_")
    try:
        folder = os.path.join(root, "ckpt")
        launch(2, args, "save", folder, 2, args.stage)
        converted = args.into if args.into is not None else 2 if args.stage == 3 else args.stage
        size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
        experts = 2 * args.dim * args.hidden * args.experts * args.layers * 4
        print(f"ZeRO-{args.stage}, {args.layers} MoE layers of {args.experts} experts {args.dim} x {args.hidden}: "
              f"{experts / 1e6:.0f} MB of expert weights, checkpoint {size / 1e6:.0f} MB (saved on 2 at ep_size 2)")
        print("| load | seconds | bytes read (busiest rank) | peak extra resident memory (one process) | "
              "anonymous memory kept after the load |")
        print("| --- | --- | --- | --- | --- |")
        for world, ep_size, stage, what in (
                (2, 2, args.stage, "2 processes, ep_size 2 (saved layout, DeepSpeed's load)"),
                (2, 1, converted, f"2 processes, ep_size 1, ZeRO-{converted} (converted)"),
                (1, 1, converted, f"1 process, ep_size 1, ZeRO-{converted} (converted)")):
            seconds, read, extra, kept = launch(world, args, "load", folder, ep_size, stage)
            print(f"| {what} | {seconds:.1f} | {read / 1e6:.0f} MB ({read / size:.2f}x the checkpoint) | "
                  f"{extra / 1e6:.0f} MB ({extra / size:.2f}x) | {kept / 1e6:.0f} MB |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
