"""Train a small MoE transformer LM through DeepSpeed; the config's "moe.backend" picks the MoE layer.

The model is built with DeepSpeed's native MoE layers; moe_plugin.integrations.deepspeed.initialize
swaps them for moe_plugin's layer when "moe.backend" is "tutel". On CPU DeepSpeed picks its CPU
accelerator (gloo); on GPUs, NCCL. ep_size must divide the number of processes.

    torchrun --nproc_per_node 2 examples/deepspeed/train_moe.py --deepspeed_config configs/deepspeed/moe_tutel.json
    deepspeed --num_gpus 2 examples/deepspeed/train_moe.py --deepspeed_config configs/deepspeed/moe_tutel.json
"""
import argparse
import json
import logging
import time

import deepspeed
import torch
from deepspeed.utils import logger

from moe_plugin.integrations.deepspeed import initialize, read_moe_section
from moe_plugin.integrations.deepspeed.model import MoETransformerLM, lm_loss, synthetic_batch


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128, help="expert hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default=None, help="engine.save_checkpoint here at the end")
    parser.add_argument("--load-dir", default=None, help="engine.load_checkpoint from here first")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    with open(args.deepspeed_config) as file:
        section = read_moe_section(json.load(file)) or {"backend": "deepspeed"}
    aux_loss_coef = section.get("aux_loss_coef", 0.01)

    torch.manual_seed(args.seed)
    model = MoETransformerLM(section, vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                             hidden=args.hidden, seq_len=args.seq_len, seed=args.seed)
    engine, _, _, _ = initialize(args=args, model=model)
    if args.load_dir:
        engine.load_checkpoint(args.load_dir)
    batch = engine.train_micro_batch_size_per_gpu()
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)   # each rank its own data
    if rank == 0:
        layer = type(engine.module.blocks[0].ffn.moe)
        print(f"backend {section['backend']}: {layer.__module__}.{layer.__name__}, "
              f"world {torch.distributed.get_world_size()}, device {engine.device}", flush=True)

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = synthetic_batch(generator, batch, args.seq_len, args.vocab).to(engine.device)
        loss = lm_loss(engine, tokens)
        engine.backward(loss + aux_loss_coef * engine.module.l_aux())
        engine.step()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            elapsed = (time.perf_counter() - start) / step
            print(f"step {step} loss {loss.item():.4f} l_aux {engine.module.l_aux().item():.4f} "
                  f"{1000 * elapsed:.1f} ms/step", flush=True)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)


if __name__ == "__main__":
    main()
