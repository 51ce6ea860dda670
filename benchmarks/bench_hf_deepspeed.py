"""A small Mixtral-architecture model under DeepSpeed ZeRO: moe_plugin's backend against DeepSpeed's AutoEP.

One AdamW training step (forward, backward, engine.step) of a 2-layer causal LM (D 256, 32 experts of width
256, top-4, 8 x 256 tokens per process, output_router_logits off), the same weights and tokens on both sides:
  ours:   moe_plugin.integrations.deepspeed.initialize with "moe": {"backend": "tutel", "ep_size": N}
  autoep: deepspeed.initialize with "expert_parallel": {"enabled": true, "autoep_size": N, "preset_model": "mixtral"}
  hf:     (with --hf) HF's own blocks under plain deepspeed.initialize (at stage 3 DeepSpeed's default ZeRO-3 leaf
          modules), the common baseline of this benchmark and bench_zero3.py
Both are dropless. Steps alternate between the engines (round robin) so that load on the machine hits them alike;
the medians are reported with ours / AutoEP (< 1: ours is faster; with --hf also each over HF's blocks), and the
first step's losses (they agree when all compute the same model). --stage sets zero_optimization.stage (default 1),
--ep-size ours' ep_size and AutoEP's autoep_size (default: the world size).

Environment: DeepSpeed 0.19.8's AutoEP fails to initialize on transformers 5.23 (TypeError in
_CanRecordRegistry.get) and works on 5.5.4, so this benchmark runs in its own virtual environment, both sides on
transformers 5.5.4 (a clean venv: one made with --system-site-packages would see the base install's 5.23):

    python -m venv /work/autoep-venv
    PIP_CONSTRAINT=$PWD/constraints.txt /work/autoep-venv/bin/pip install torch==2.13.0 deepspeed==0.19.8 \\
        transformers==5.5.4 setuptools wheel
    PIP_CONSTRAINT=$PWD/constraints.txt /work/autoep-venv/bin/pip install --no-build-isolation -e .

Run (from the repository root):

    OMP_NUM_THREADS=2 /work/autoep-venv/bin/python benchmarks/bench_hf_deepspeed.py            # ep_size 1
    OMP_NUM_THREADS=1 /work/autoep-venv/bin/torchrun --standalone --nproc_per_node 2 \\
        benchmarks/bench_hf_deepspeed.py                                                        # ep_size 2
    OMP_NUM_THREADS=1 /work/autoep-venv/bin/torchrun --standalone --nproc_per_node 2 \\
        benchmarks/bench_hf_deepspeed.py --stage 3 --ep-size 1 --hf                             # ZeRO-3
"""
import argparse
import json
import logging
import os
import statistics
import time

import torch

import moe_plugin.integrations.transformers as hf_moe  # noqa: F401  (first: hides an unloadable torchaudio)
import deepspeed
import transformers
from deepspeed.utils import logger

import moe_plugin.integrations.deepspeed as dsi

VOCAB = 1024


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--stage", type=int, default=1, choices=(0, 1, 2, 3), help="zero_optimization.stage")
    parser.add_argument("--ep-size", type=int, default=None, help="ours' ep_size and AutoEP's autoep_size "
                        "(default: the world size)")
    parser.add_argument("--hf", action="store_true", help="also time HF's own blocks (plain deepspeed.initialize)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def mixtral():
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=32,
                                        num_experts_per_tok=4, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def ds_config(batch, stage, extra):
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, **extra}


def engines(batch, stage, ep_size, hf=False):
    ours = dsi.initialize(model=mixtral(), config=ds_config(batch, stage, {"moe": {"backend": "tutel",
                                                                                  "ep_size": ep_size}}))
    autoep = deepspeed.initialize(model=mixtral(), config=ds_config(batch, stage, {"expert_parallel": {
        "enabled": True, "autoep_size": ep_size, "preset_model": "mixtral"}}))
    out = {"ours": ours[0], "autoep": autoep[0]}
    if hf:
        out["hf"] = deepspeed.initialize(model=mixtral(), config=ds_config(batch, stage, {}))[0]
    return out


def main(argv=None):
    args = parse_args(argv)
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ep_size = world if args.ep_size is None else args.ep_size
    sides = engines(args.batch, args.stage, ep_size, args.hf)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(1 + rank))
    times = {name: [] for name in sides}
    first_loss = {}
    for i in range(args.warmup + args.repeats):
        for name, engine in sides.items():
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
            first_loss.setdefault(name, loss.item())
    ms = {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()}
    result = {"world": world, "stage": args.stage, "ep_size": ep_size, "threads": torch.get_num_threads(), "tokens": f"{args.batch}x{args.seq}",
              "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
              "ms": ms, "ours_over_autoep": round(ms["ours"] / ms["autoep"], 3), "first_loss": first_loss}
    if args.hf:
        result.update(ours_over_hf=round(ms["ours"] / ms["hf"], 3), autoep_over_hf=round(ms["autoep"] / ms["hf"], 3))
    if rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers "
                  f"{transformers.__version__}; {world} process(es), {torch.get_num_threads()} threads each")
            print(f"ZeRO-{args.stage} AdamW step, ep_size {ep_size}: " + ", ".join(f"{k} {v} ms" for k, v in ms.items())
                  + f"; ours / AutoEP = {result['ours_over_autoep']}"
                  + (f", ours / HF = {result['ours_over_hf']}, AutoEP / HF = {result['autoep_over_hf']}"
                     if args.hf else "") + f" (first losses {first_loss})")


if __name__ == "__main__":
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    main()
