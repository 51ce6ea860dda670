"""The small Mixtral of bench_hf_deepspeed.py under DeepSpeed ZeRO: step time at stage 3 (ours against HF's own
blocks, which DeepSpeed runs as ZeRO-3 leaf modules) and the tensor bytes each rank holds at stages 0 to 3.

Model: 2-layer causal LM, D 256, 32 experts of width 256, top-4, 8 x 256 tokens per process, AdamW, dropless.
  time:   one training step (forward, backward, engine.step) at ZeRO-3, ours ("moe": {"backend": "tutel"},
          ep_size 1) and HF's blocks (plain deepspeed.initialize), alternating step by step; medians and
          ours / HF (< 1: ours is faster).
  memory: the bytes of the distinct tensor storages this rank holds: gradients after backward (.grad, ZeRO-2's
          averaged partitions, ZeRO-3's partition buffer), parameters (at stage 3 their partitions) and optimizer
          states with fp32 master copies after the step; for ours at stages 0 (replicated), 1, 2, 3 and ep_size 1
          and world, with HF's blocks at each stage as the dense baseline.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/bench_zero3.py [--json]
"""
import argparse
import gc
import json
import logging
import statistics
import time

import torch

import moe_plugin.integrations.transformers as hf_moe  # noqa: F401  (first: hides an unloadable torchaudio)
import deepspeed
import transformers
from deepspeed.utils import logger

import moe_plugin.integrations.deepspeed as dsi
from bench_hf_deepspeed import VOCAB, mixtral


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def config(batch, stage, moe=None):
    out = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    return out if moe is None else {**out, "moe": moe}


def engine_for(side, batch, stage, ep_size):
    if side == "hf":
        return deepspeed.initialize(model=mixtral(), config=config(batch, stage))[0]
    return dsi.initialize(model=mixtral(), config=config(batch, stage, {"backend": "tutel", "ep_size": ep_size}))[0]


def step(engine, ids):
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def storages(tensors):
    """{storage address: bytes} of the tensors (empty ones left out)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def gradient_bytes(engine):
    """After backward, before step: the gradients this rank holds (.grad, ZeRO-2's averaged partitions, ZeRO-3's
    flat partition buffer)."""
    optimizer = engine.optimizer
    tensors = [p.grad for p in engine.module.parameters()]
    tensors += [t for group in (getattr(optimizer, "averaged_gradients", None) or {}).values() for t in group or []]
    tensors.append(getattr(optimizer, "grad_partitions_flat_buffer", None))
    return sum(storages(tensors).values())


def held_bytes(engine, grads):
    """After step: parameter bytes (at stage 3 their partitions) and optimizer bytes (states and fp32 masters)."""
    params = [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p.data for p in engine.module.parameters()]
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    states = [v for state in inner.state.values() for v in state.values()]
    masters = [t for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
               for t in getattr(optimizer, name, [])]
    out = {"params": sum(storages(params).values()), "grads": grads,
           "optimizer": sum(storages(states + masters).values())}
    out["all"] = sum(out.values())
    return out


def main(argv=None):
    args = parse_args(argv)
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(1 + rank))
    result = {"world": world, "threads": torch.get_num_threads(), "tokens": f"{args.batch}x{args.seq}",
              "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}
    sides = {side: engine_for(side, args.batch, 3, 1) for side in ("ours", "hf")}
    times = {side: [] for side in sides}
    first_loss = {}
    for i in range(args.warmup + args.repeats):
        for side, engine in sides.items():
            start = time.perf_counter()
            loss = step(engine, ids)
            if i >= args.warmup:
                times[side].append(time.perf_counter() - start)
            first_loss.setdefault(side, loss)
    ms = {side: round(statistics.median(t) * 1e3, 1) for side, t in times.items()}
    result.update(zero3_ms=ms, ours_over_hf=round(ms["ours"] / ms["hf"], 3), first_loss=first_loss)
    del sides
    if not args.skip_memory:
        memory = {}
        for stage in (0, 1, 2, 3):
            for side, ep_size in (("hf", 1), ("ours", 1), ("ours", world)):
                engine = engine_for(side, args.batch, stage, ep_size)
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                grads = gradient_bytes(engine)
                engine.step()
                memory[f"stage {stage} {side} ep {ep_size}"] = held_bytes(engine, grads)
                del engine
                gc.collect()
        result["bytes_per_rank"] = memory
    if rank == 0:
        print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
