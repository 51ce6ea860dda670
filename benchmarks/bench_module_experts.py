"""The general expert path (any module, MoELayer(config, expert=module)) against the fast path on the same MLP,
forward + backward on one process, both timed in one run; prints ms per step and the ratio.

    OMP_NUM_THREADS=1 python benchmarks/bench_module_experts.py D H E K T
"""
import sys
import time
import warnings

import torch
from torch import nn

from moe_plugin import MoEConfig, MoELayer


def ms_per_step(layer: MoELayer, x_TD: torch.Tensor, steps: int = 5) -> float:
    def step():
        layer(x_TD.clone().requires_grad_()).sum().backward()
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    D, H, E, K, T = map(int, sys.argv[1:6])
    torch.manual_seed(0)
    config = MoEConfig(model_dim=D, hidden_size=H, num_experts=E, top_k=K, capacity_factor=1.25, activation="relu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the general path's once-per-class "slower path" warning
        layers = {"fast": MoELayer(config),
                  "general": MoELayer(config, expert=nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)))}
    x_TD = torch.randn(T, D)
    best = {name: min(ms_per_step(layer, x_TD) for _ in range(3)) for name, layer in layers.items()}
    print(f"fast {best['fast']:.1f} ms, general {best['general']:.1f} ms, general / fast = "
          f"{best['general'] / best['fast']:.2f}")


if __name__ == "__main__":
    main()
