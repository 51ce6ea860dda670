"""The routing path of moe_plugin.integrations.deepspeed.MoE, forward + backward on one CPU thread (issue 31).

The layer reads DeepSpeed's l_aux from a hook on its router, so it runs the router module (the reference routing:
Router -> plan_routes -> finalize_gates); the fused routing never calls the router, and l_aux went stale there.
Compared in one run, interleaved: DeepSpeed's own layer (the baseline), ours as it runs, and ours with the hook
removed (the fused routing; l_aux not read). CPU seconds per step (less sensitive to a busy machine), medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_deepspeed_routing.py [ROUNDS]
"""
import statistics
import sys
import time

import torch
from torch import nn

import moe_plugin.integrations.deepspeed as dsi
from deepspeed.moe.layer import MoE as NativeMoE

D, H, E, T = 256, 512, 8, 2048
SETTINGS = dict(num_experts=E, k=2, capacity_factor=1.25, min_capacity=0, use_rts=False,
                top2_2nd_expert_sampling=False)


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    native, ours = NativeMoE(D, mlp, **SETTINGS), dsi.MoE(D, mlp, **SETTINGS)
    x = torch.randn(T, D)
    hooks = dict(ours.deepspeed_moe.router._forward_hooks)

    def step(layer, hooked=True):
        if not hooked:
            ours.deepspeed_moe.router._forward_hooks.clear()
        start = time.process_time()
        layer(x)[0].square().mean().backward()
        seconds = time.process_time() - start
        ours.deepspeed_moe.router._forward_hooks.update(hooks)
        return seconds

    variants = {"DeepSpeed's layer": lambda: step(native), "ours (router runs, l_aux read)": lambda: step(ours),
                "ours, fused routing (hook removed)": lambda: step(ours, hooked=False)}
    for run in variants.values():   # warm-up
        run()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(run())
    base = statistics.median(times["DeepSpeed's layer"])
    print(f"D={D} H={H} E={E} T={T} top-2, capacity 1.25, fp32, 1 thread, {rounds} rounds")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name}: {median * 1e3:.1f} ms CPU, {median / base:.3f} of DeepSpeed's layer")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
