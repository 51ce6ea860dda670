"""Train a small MoE transformer through DeepSpeed with "moe.backend" "deepspeed" and "tutel" in one run.

Every rank builds both engines from the same seed (DeepSpeed's native MoE layers; the "tutel" one is
swapped by moe_plugin.integrations.deepspeed.initialize) and alternates between them step by step
on the same batches. A step is forward + backward + optimizer step, timed on each rank up to a
barrier (so the slowest rank counts); rank 0 prints the median ms/step of each backend and the
ratio deepspeed / tutel (> 1: tutel is faster).

    python benchmarks/bench_deepspeed.py --world 2            # spawns 2 gloo ranks on this machine
    torchrun --nproc_per_node 8 benchmarks/bench_deepspeed.py  # or under a launcher (NCCL on GPUs)
"""
import argparse
import logging
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

BACKENDS = ("deepspeed", "tutel")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn when not run under a launcher")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024, help="expert hidden size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--ep-size", type=int, default=None, help="default: the world size")
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per backend")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per backend first")
    parser.add_argument("--layer-only", action="store_true",
                        help="time the first MoE layer alone (forward + backward on batch x seq-len tokens)")
    return parser.parse_args(argv)


def bench(args):
    import deepspeed
    from deepspeed.utils import logger

    from moe_plugin.integrations.deepspeed import initialize
    from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss, synthetic_batch
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    section = {"num_experts": args.experts, "ep_size": args.ep_size or world, "top_k": args.top_k,
               "capacity_factor": args.capacity_factor, "eval_capacity_factor": args.capacity_factor,
               "min_capacity": 4, "drop_tokens": True}
    engines = {}
    for backend in BACKENDS:
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10 ** 9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": args.zero_stage}, "moe": {"backend": backend, **section}}
        torch.manual_seed(0)
        model = MoETransformerLM(section, vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                                 hidden=args.hidden, seq_len=args.seq_len)
        engines[backend] = initialize(model=model, config=config)[0]
    generator = torch.Generator().manual_seed(1000 + rank)
    device = engines["tutel"].device
    data = [synthetic_batch(generator, args.batch, args.seq_len, args.vocab).to(device) for _ in range(10)]

    x_TD = torch.randn(args.batch * args.seq_len, args.dim, generator=generator).to(device).requires_grad_()

    def step(engine, tokens):
        if args.layer_only:
            ffn = engine.module.blocks[0].ffn
            (ffn(x_TD).square().mean() + ffn.l_aux).backward()
            return None
        loss = lm_loss(engine, tokens)
        engine.backward(loss + 0.01 * engine.module.l_aux())
        engine.step()
        return loss

    times = {backend: [] for backend in BACKENDS}
    for backend, engine in engines.items():
        for tokens in data[:args.warmup]:
            step(engine, tokens)
    for index in range(args.steps):   # alternate step by step, so that load from elsewhere hits both alike
        tokens = data[index % len(data)]
        for backend in (BACKENDS if index % 2 == 0 else BACKENDS[::-1]):
            dist.barrier()
            start = time.perf_counter()
            step(engines[backend], tokens)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
            times[backend].append(time.perf_counter() - start)
    if rank == 0:
        report(args, world, section, device, times)


def report(args, world, section, device, times):
    tokens = args.batch * args.seq_len * world
    print(f"world {world} ({device}, {torch.get_num_threads()} threads/rank), D={args.dim} H={args.hidden} "
          f"E={section['num_experts']} ep_size={section['ep_size']} top-{args.top_k} cf={args.capacity_factor}, "
          f"{args.layers} MoE layers, {args.batch}x{args.seq_len} tokens/rank, ZeRO {args.zero_stage}, "
          f"{args.steps} steps/backend{', first MoE layer only (forward + backward)' if args.layer_only else ''}")
    print(f"{'backend':10} {'median ms/step':>15} {'p10':>8} {'p90':>8} {'tokens/s':>10}")
    medians = {}
    for backend, seconds in times.items():
        ms = sorted(1000 * s for s in seconds)
        medians[backend] = statistics.median(ms)
        print(f"{backend:10} {medians[backend]:15.1f} {ms[len(ms) // 10]:8.1f} {ms[(9 * len(ms)) // 10]:8.1f} "
              f"{tokens / medians[backend] * 1000:10.0f}")
    print(f"ratio deepspeed / tutel: {medians['deepspeed'] / medians['tutel']:.2f}x")


def _spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    bench(args)


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ:
        bench(args)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
