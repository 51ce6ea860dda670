"""A fine-grained DeepSeek-style MoE layer against the bare GEMMs of its own routed rows plus the
shared expert's GEMMs, forward+backward, interleaved in one run; medians and ratios.

Workload (issue 11): D=512, 64 experts of H=256, top-8 inside the best 2 of 4 groups, sigmoid router
with the balancing bias on (random bias, counted in training mode), route_scale, one shared expert of
width 512, 8192 tokens, dropless, relu, no biases, fp32.

The baseline computes exactly the layer's GEMMs: each expert's routed rows (the counts the layer's
router gave, pre-gathered, one contiguous block per expert) through [D, H] -> relu -> [H, D], one
torch.mm per expert with its own leaf weights (no stacking, no gather, no scatter), and the shared
expert's [T, D] -> [D, Hs] -> relu -> [Hs, D]; input and weight gradients.

    python benchmarks/bench_fine_grained.py --rounds 5 --threads 2

Legend: T tokens, D model dim, H expert hidden, E experts, R routed rows.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.cli.bench import interleaved_median_ms


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def timed(params, x, grad, forward):
    params = list(params)
    x = x.detach().requires_grad_()

    def step():
        for p in params + [x]:
            p.grad = None
        start = time.perf_counter()
        forward(x).backward(grad)
        return time.perf_counter() - start
    return step


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = MoEConfig(model_dim=512, hidden_size=256, num_experts=64, top_k=8, num_groups=4, topk_groups=2,
                       router="sigmoid", expert_bias_update_rate=0.001, route_scale=2.5, shared_hidden_size=512,
                       capacity_factor=0.0, activation="relu", bias=False)
    layer = MoELayer(config)
    layer.router.expert_bias_E.copy_(0.05 * torch.randn(config.num_experts))
    x_TD = torch.randn(args.tokens, config.model_dim)
    grad_TD = torch.randn_like(x_TD)
    rows_per_expert = torch.bincount(layer.router(x_TD).expert_TK.reshape(-1), minlength=64).tolist()

    w1 = [w.detach().clone().requires_grad_() for w in layer.experts.w1_EDH]
    w2 = [w.detach().clone().requires_grad_() for w in layer.experts.w2_EHD]
    s1_DH = layer.shared_expert.w1_DH.detach().clone().requires_grad_()
    s2_HD = layer.shared_expert.w2_HD.detach().clone().requires_grad_()
    x_blocks = [torch.randn(n, config.model_dim).requires_grad_() for n in rows_per_expert]
    grad_blocks = [torch.randn_like(x) for x in x_blocks]

    def routed_gemms():
        for t in w1 + w2 + x_blocks:
            t.grad = None
        start = time.perf_counter()
        outs = [torch.mm(torch.relu(torch.mm(x_ND, w1[e])), w2[e]) for e, x_ND in enumerate(x_blocks)]
        torch.autograd.backward(outs, grad_blocks)
        return time.perf_counter() - start

    def shared_gemms(x_TD):
        return torch.mm(F.relu(torch.mm(x_TD, s1_DH)), s2_HD)

    candidates = {
        "moe_plugin": timed(layer.parameters(), x_TD, grad_TD, layer),
        "routed_gemms": routed_gemms,
        "shared_gemms": timed([s1_DH, s2_HD], x_TD, grad_TD, shared_gemms),
    }
    ms = interleaved_median_ms(candidates, args.warmup, args.rounds)
    bare = ms["routed_gemms"] + ms["shared_gemms"]
    print(f"fine-grained MoE forward+backward, fp32, {torch.get_num_threads()} threads, T={args.tokens} D=512 "
          f"H=256 E=64 k=8 groups 4/2 sigmoid+bias shared 512, median of {args.rounds} rounds")
    print(f"routed rows {sum(rows_per_expert)} (dropless), per expert min {min(rows_per_expert)} "
          f"max {max(rows_per_expert)}")
    for name, value in ms.items():
        print(f"{name:<14} {value:>9.1f} ms")
    print(f"bare (routed + shared) {bare:>9.1f} ms")
    print(f"moe_plugin / bare = {ms['moe_plugin'] / bare:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
