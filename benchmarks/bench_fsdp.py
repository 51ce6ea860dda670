"""FSDP2 (fully_shard_moe) against DDP on gloo CPU processes: bytes held per rank and step time.

    python benchmarks/bench_fsdp.py [--worlds 2 4] [--eps 1 2] [--steps 6] [--hf [--hf-model mixtral|fine]]
    (--worlds --hf: HF's only; on GPUs: --worlds --hf --device cuda --hf-world N --bf16 --hf-model mixtral_gpu;
    --compile: each decoder layer torch.compile'd on both sides)

For each world size W and ep_size: the moe-plugin train model (TransformerLM, the sizes below) in DDP mode
(parts.data_parallel: DDP plus the expert-gradient hooks) and in FSDP2 mode (fully_shard_moe), one AdamW step
each to create the optimizer state, then the bytes this rank holds (parameters, gradients, AdamW state: the
local shards under FSDP2) and the median step time of --steps steps. Both modes run in the same processes,
one after the other. --hf: an HF MoE model (--hf-model: the tiny Mixtral, or a fine-grained Qwen3-MoE),
swapped (fully_shard_moe) against HF's own blocks under the same FSDP2 sharding (plain fully_shard per decoder
layer, then the root), at ep_size 1; step time, the two models' steps interleaved in the same processes, their
first losses checked equal. Prints one table row per case, ratios FSDP2 / DDP and swapped / HF
(`--worlds` with no value: the --hf comparison only).
"""
from __future__ import annotations

import argparse
import os
import queue as queue_module
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

DIM, LAYERS, HEADS, SEQ, FFN, EXPERTS, HIDDEN, BATCH = 256, 4, 4, 64, 1024, 8, 1024, 4


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _native(rank, world, ep, fsdp, steps):
    from moe_plugin import aux_loss, train
    overrides = [f"model.dim={DIM}", f"model.layers={LAYERS}", f"model.heads={HEADS}", f"model.seq_len={SEQ}",
                 f"model.ffn_hidden={FFN}", f"moe.num_experts={EXPERTS}", f"moe.hidden_size={HIDDEN}",
                 f"train.batch_size={BATCH}", f"parallel.ep_size={ep}", f"parallel.fsdp={str(fsdp).lower()}"]
    cfg = train.load_config(None, overrides)
    procs = train.Processes(rank, world, torch.device("cpu"), False)
    parts = train.build(cfg, procs)
    model, optimizer = parts.model, parts.optimizer
    wrapped = train.data_parallel(model, procs)
    times = []
    for _ in range(steps + 1):
        x_BS, y_BS = parts.data.train.next()
        dist.barrier()
        tick = time.perf_counter()
        loss = F.cross_entropy(wrapped(x_BS).flatten(0, 1), y_BS.flatten()) + aux_loss(model)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - tick)
    params = list(model.parameters())
    state = [v for p in params for v in optimizer.state[p].values() if v.dim() > 0]
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _bytes(state), "step_s": statistics.median(times[1:])}


# --hf-model: the HF config and the tokens (batch, sequence) per rank. "mixtral": tiny, 8 experts x 512, top-2,
# where the MoE is ~22% of the step; "fine": fine-grained like Qwen3-MoE / DeepSeek-V3 / OLMoE, 64 experts x 256,
# top-8, enough tokens that the MoE dominates the step.
HF_MODELS = {
    "mixtral": ("mixtral", "MixtralConfig", "MixtralForCausalLM", (BATCH, SEQ),
                dict(vocab_size=256, hidden_size=DIM, intermediate_size=HIDDEN // 2, num_hidden_layers=2,
                     num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=EXPERTS,
                     num_experts_per_tok=2, max_position_embeddings=SEQ)),
    "fine": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", (8, 256),
             dict(vocab_size=256, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=64,
                  num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=256)),
    # GPU sizes (--device cuda): a small Mixtral and a fine-grained Qwen3-MoE on HF's grouped_mm experts
    "mixtral_gpu": ("mixtral", "MixtralConfig", "MixtralForCausalLM", (4, 1024),
                    dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=1024)),
    "fine_gpu": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", (4, 1024),
                 dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, num_experts=64,
                      num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=1024)),
}


def _hf_model(name, swapped, device="cpu", bf16=False, compile=False):
    import importlib
    import moe_plugin.integrations.transformers as hf_moe   # first: it hides an unloadable torchaudio
    from torch.distributed.fsdp import fully_shard
    from moe_plugin.parallel import fully_shard_moe
    family, config_class, model_class, _, kwargs = HF_MODELS[name]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    config = getattr(modeling, config_class)(**kwargs)
    if device != "cpu":
        config._experts_implementation = "grouped_mm"
    with torch.device(device):
        model = getattr(modeling, model_class)(config)
    policy = {}
    if bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if swapped:
        hf_moe.swap_moe_blocks(model)
    if compile:       # each decoder layer, then FSDP2 (torchtitan's order)
        for layer in model.model.layers:
            layer.compile()
    if swapped:
        return fully_shard_moe(model, **policy)
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    return fully_shard(model, **policy)


class BlockClock:
    """The time a step spends inside some modules' forward and backward (the MoE blocks): CUDA events on the
    device, the host's clock on CPU, taken by module hooks (a forward's start and end, a backward's)."""

    def __init__(self, blocks, device):
        self.cuda = device != "cpu"
        self.marks = []
        for block in blocks:
            block.register_forward_pre_hook(lambda *_: self._mark())
            block.register_forward_hook(lambda *_: self._mark())
            block.register_full_backward_pre_hook(lambda *_: self._mark())
            block.register_full_backward_hook(lambda *_: self._mark())

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def take(self) -> float:
        """Seconds inside the blocks since the last take (after the device has finished: call after a sync)."""
        pairs, self.marks = list(zip(self.marks[0::2], self.marks[1::2])), []
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in pairs) / 1000
        return sum(end - start for start, end in pairs)


class NoClock:
    def take(self) -> float:
        return float("nan")


def _moe_blocks(model, swapped):
    import moe_plugin.integrations.transformers as hf_moe
    if swapped:
        return [m for m in model.modules() if isinstance(m, hf_moe.HFMoEBlock)]
    names = {entry.block for entry in hf_moe.FAMILIES.values()}
    return [m for m in model.modules() if type(m).__name__ in names]


def _hf(rank, world, name, steps, device="cpu", bf16=False, compile=False):
    """HF's own blocks and the swapped ones in the same processes, one step of each per round (the machine's
    load moves both alike); returns the median over rounds of swapped / own, and each one's median step and the
    median time of it spent in the MoE blocks (forward and backward: what swapping changes; the rest of the step
    is the same model). The first round's losses must agree (same weights, same tokens; bf16 parameters: to 1%).
    compile: each decoder layer torch.compile'd on both sides (the blocks' time is then not taken: hooks inside a
    compiled layer would break its graph)."""
    models = [_hf_model(name, False, device, bf16, compile), _hf_model(name, True, device, bf16, compile)]
    blocks = [_moe_blocks(model, swapped) for model, swapped in zip(models, (False, True))]
    if not all(blocks):
        raise RuntimeError(f"no MoE block to time: {len(blocks[0])} of HF's own, {len(blocks[1])} swapped")
    clocks = [NoClock() if compile else BlockClock(found, device) for found in blocks]
    batch, seq = HF_MODELS[name][3]
    vocab = HF_MODELS[name][4]["vocab_size"]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in models]
    generator = torch.Generator().manual_seed(rank)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    times, in_blocks, first_losses = [[], []], [[], []], []
    for round_ in range(steps + 1):
        ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
        for model, optimizer, spent, clock, blocks_spent in zip(models, optimizers, times, clocks, in_blocks):
            dist.barrier()
            sync()
            clock.take()
            tick = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sync()
            spent.append(time.perf_counter() - tick)
            blocks_spent.append(clock.take())
            if round_ == 0:
                first_losses.append(loss.item())
    if abs(first_losses[0] - first_losses[1]) > (1e-2 if bf16 else 1e-4) * abs(first_losses[0]):
        raise RuntimeError(f"first losses differ: HF's own {first_losses[0]}, swapped {first_losses[1]}")
    own, swapped = times[0][1:], times[1][1:]
    return {"own_s": statistics.median(own), "swapped_s": statistics.median(swapped),
            "own_moe_s": statistics.median(in_blocks[0][1:]), "swapped_moe_s": statistics.median(in_blocks[1][1:]),
            "ratio": statistics.median(b / a for a, b in zip(own, swapped)), "losses": first_losses,
            "ratios": [b / a for a, b in zip(own, swapped)]}


def _worker(rank, world, port, cases, steps, queue, device="cpu", bf16=False, compile=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world)
    out = []
    for kind, ep, flag in cases:
        out.append(_native(rank, world, ep, flag, steps) if kind == "native" else
                   _hf(rank, world, flag, steps, device if device == "cpu" else f"cuda:{rank}", bf16, compile))
    queue.put((rank, out))
    dist.destroy_process_group()


def run(world, cases, steps, device="cpu", bf16=False, compile=False):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_worker, args=(r, world, port, cases, steps, queue, device, bf16, compile))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 1800
    while len(results) < world:
        try:
            rank, out = queue.get(timeout=5)
            results[rank] = out
        except queue_module.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a worker failed or hung; exit codes {[p.exitcode for p in procs]}")
    for p in procs:
        p.join()
    return results[0]   # rank 0's figures (ranks hold the same amounts; step times are barrier-aligned)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])   # none: --hf only
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--hf-model", choices=sorted(HF_MODELS), default="mixtral")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the --hf comparison on --hf-world GPUs over NCCL")
    parser.add_argument("--hf-world", type=int, default=2, help="processes of the --hf comparison")
    parser.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision: bf16 parameters, fp32 reduction")
    parser.add_argument("--compile", action="store_true",
                        help="--hf: each decoder layer torch.compile'd on both sides, before FSDP2")
    args = parser.parse_args()
    mib = 2 ** 20
    if args.worlds:
        print(f"model: dim {DIM}, layers {LAYERS} (MoE every 2nd), experts {EXPERTS} x hidden {HIDDEN}, "
              f"batch {BATCH}x{SEQ} per rank; MiB per rank (rank 0), step = median of {args.steps}")
        print(f"{'W':>2} {'ep':>2}  {'mode':5} {'params':>8} {'grads':>8} {'adam':>8} {'total':>8} {'step s':>7}  "
              f"{'total/DDP':>9} {'step/DDP':>8}")
    for world in args.worlds:
        cases = [("native", ep, fsdp) for ep in args.eps if world % ep == 0 for fsdp in (False, True)]
        results = run(world, cases, args.steps)
        for (_, ep, fsdp), r in zip(cases, results):
            total = r["params"] + r["grads"] + r["optimizer"]
            if not fsdp:
                ddp_total, ddp_step = total, r["step_s"]
            print(f"{world:>2} {ep:>2}  {'fsdp2' if fsdp else 'ddp':5} {r['params'] / mib:8.2f} "
                  f"{r['grads'] / mib:8.2f} {r['optimizer'] / mib:8.2f} {total / mib:8.2f} {r['step_s']:7.3f}  "
                  f"{total / ddp_total:9.3f} {r['step_s'] / ddp_step:8.3f}")
    if args.hf:
        r = run(args.hf_world, [("hf", 1, args.hf_model)], args.steps, args.device, args.bf16, args.compile)[0]
        batch, seq = HF_MODELS[args.hf_model][3]
        print(f"{HF_MODELS[args.hf_model][2]} ({args.hf_model}, {batch}x{seq} tokens per rank) under FSDP2 on "
              f"{args.hf_world} {args.device} processes{' (bf16 parameters)' if args.bf16 else ''}"
              f"{', decoder layers compiled' if args.compile else ''}, ep_size 1, "
              f"{args.steps} interleaved rounds: HF's own "
              f"{r['own_s']:.3f} s, swapped {r['swapped_s']:.3f} s (medians), swapped / HF = {r['ratio']:.3f} "
              f"(median of the rounds' ratios); first losses {r['losses'][0]:.6f} / {r['losses'][1]:.6f}")
        if not args.compile:
            print(f"of which in the MoE blocks (forward and backward): HF's own {r['own_moe_s']:.3f} s "
                  f"({r['own_moe_s'] / r['own_s']:.0%} of its step), swapped {r['swapped_moe_s']:.3f} s "
                  f"({r['swapped_moe_s'] / r['swapped_s']:.0%}); the rest of the step: HF's own "
                  f"{r['own_s'] - r['own_moe_s']:.3f} s, swapped {r['swapped_s'] - r['swapped_moe_s']:.3f} s")
        print("rounds' ratios:", " ".join(f"{x:.3f}" for x in r["ratios"]))


if __name__ == "__main__":
    main()
