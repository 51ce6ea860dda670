"""Images per second of SwinV2-MoE (configs/experiments/swinv2_moe.yaml: Swinv2ForImageClassification whose MLPs
in every other block of the last two stages are MoE blocks of 8 experts, top-1, cosine router, capacity factor
1.25, batch-prioritized routing) against the dense Swinv2 of the same config (the same widths: each expert is
as wide as the MLP it replaces): forward (cross-entropy + aux loss) and backward on random images, and with
--optimizer-step also AdamW's step; both models timed in one run, interleaved round by round (the order
alternating); prints each round and the medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_swinv2_moe.py [--batch 32] [--rounds 5] [--steps 5]
                                                            [--optimizer-step] [key=value ...]

key=value: overrides of the experiment config, e.g. moe.top_k=2 hf.embed_dim=64 data.image_size=64.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from moe_plugin import aux_loss
from moe_plugin.train import load_config
from moe_plugin.train.hf_image import build_image_model

CONFIG = "configs/experiments/swinv2_moe.yaml"


def images_per_s(model, optimizer, x_BCHW, y_B, steps: int) -> float:
    """optimizer None: forward and backward only."""
    start = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x_BCHW), y_B) + aux_loss(model)
        model.zero_grad(set_to_none=True)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
    return steps * len(y_B) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="training steps per model and round")
    parser.add_argument("--optimizer-step", action="store_true", help="time AdamW's step too")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    cfg = load_config(args.config, args.overrides)
    torch.manual_seed(0)
    models = {"moe": build_image_model(cfg)}
    cfg.upcycle = None
    models["dense"] = build_image_model(cfg)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) if args.optimizer_step else None
                  for name, m in models.items()}
    size = cfg.data.image_size
    x_BCHW, y_B = torch.randn(args.batch, 1, size, size), torch.randint(0, 10, (args.batch,))
    for name in models:   # warm-up
        images_per_s(models[name], optimizers[name], x_BCHW, y_B, 1)
    rounds = {name: [] for name in models}
    for r in range(args.rounds):
        for name in ("dense", "moe") if r % 2 == 0 else ("moe", "dense"):
            rounds[name].append(images_per_s(models[name], optimizers[name], x_BCHW, y_B, args.steps))
        if not args.json:
            print(f"round {r + 1}: dense {rounds['dense'][-1]:.1f} images/s, moe {rounds['moe'][-1]:.1f} images/s, "
                  f"moe / dense {rounds['moe'][-1] / rounds['dense'][-1]:.3f}")
    median = {name: statistics.median(values) for name, values in rounds.items()}
    ratios = [m / d for m, d in zip(rounds["moe"], rounds["dense"])]
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    layer = models["moe"].moe_layers()[0].config
    result = {"batch": args.batch, "image_size": size, "optimizer_step": args.optimizer_step,
              "threads": torch.get_num_threads(),
              "moe_layers": len(models["moe"].moe_layers()), "num_experts": layer.num_experts, "top_k": layer.top_k,
              "params_dense": params["dense"], "params_moe": params["moe"],
              "dense_images_per_s": median["dense"], "moe_images_per_s": median["moe"],
              "ratio_of_medians": median["moe"] / median["dense"], "median_round_ratio": statistics.median(ratios),
              "round_ratio_min": min(ratios), "round_ratio_max": max(ratios)}
    if args.json:
        print(json.dumps(result))
        return
    print(f"SwinV2-MoE ({result['moe_layers']} MoE blocks, {layer.num_experts} experts, top-{layer.top_k}, "
          f"{params['moe'] / 1e6:.2f} M parameters) vs dense Swinv2 ({params['dense'] / 1e6:.2f} M), "
          f"batch {args.batch} "
          f"of {size}x{size}, {'forward+backward+AdamW' if args.optimizer_step else 'forward+backward'}, "
          f"{result['threads']} thread(s): median {median['moe']:.1f} vs {median['dense']:.1f} "
          f"images/s; moe / dense = {result['median_round_ratio']:.3f} (median of rounds; "
          f"{result['round_ratio_min']:.3f} to {result['round_ratio_max']:.3f})")


if __name__ == "__main__":
    main()
