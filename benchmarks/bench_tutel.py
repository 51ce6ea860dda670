"""The Tutel drop-in (moe_plugin.tutel.moe_layer) against MoELayer and real Tutel, forward+backward, interleaved in
one run; prints each one's median ms per step, and the median over rounds of its time / MoELayer's in the same round
(robust to a machine that others load in bursts). Issue 43: the drop-in at most 1.03x.

    OMP_NUM_THREADS=1 python benchmarks/bench_tutel.py [--shape default] [--rounds 7] [--warmup 2]

Shapes: default (bench_peers.py's: T 4096, D 1024, H 4096, E 8, top-2, ReLU with biases, capacity factor 1.25), small
(T 512, D 256, H 512). fp32 on CPU. Candidates, all with the same weights:
  moe_plugin    MoELayer with the MoEConfig the drop-in builds (Tutel's capacity formula), loaded through names.py
  drop_in       moe_plugin.tutel.moe_layer(gate_type={"type": "top", ...}, experts={"type": "ffn", ...})
  tutel         tutel.moe.moe_layer with the same arguments, where Tutel is installed (else a row says why)
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from moe_plugin import MoELayer
from moe_plugin.cli import bench
from moe_plugin import tutel as drop_in
from moe_plugin.tutel import names

SHAPES = {"default": dict(tokens=4096, model_dim=1024, hidden_size=4096, num_experts=8, top_k=2, capacity_factor=1.25),
          "small": dict(tokens=512, model_dim=256, hidden_size=512, num_experts=8, top_k=2, capacity_factor=1.25)}


def arguments(shape):
    gate = {"type": "top", "k": shape["top_k"], "capacity_factor": shape["capacity_factor"]}
    experts = {"type": "ffn", "count_per_node": shape["num_experts"], "hidden_size_per_expert": shape["hidden_size"],
               "activation_fn": F.relu}
    return gate, experts


def tutel_layer(shape, state):
    try:
        from tutel import moe as tutel_moe
    except Exception as error:      # not installed, or its extension failed to load
        return f"skipped (tutel: {type(error).__name__}: {error})"
    gate, experts = arguments(shape)
    layer = tutel_moe.moe_layer(gate_type=gate, model_dim=shape["model_dim"], experts=experts)
    layer.load_state_dict(state, strict=True)
    return layer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    gate, experts = arguments(shape)
    ours = drop_in.moe_layer(gate_type=gate, model_dim=shape["model_dim"], experts=experts)
    plain = MoELayer(ours.config)
    plain.load_state_dict(names.tutel_to_moe(ours.state_dict()), strict=True)
    x_TD = torch.randn(shape["tokens"], shape["model_dim"])
    grad_TD = torch.randn_like(x_TD)
    assert torch.equal(plain(x_TD), ours(x_TD)), "the two must compute the same"
    layers = {"moe_plugin": plain, "drop_in": ours, "tutel": tutel_layer(shape, ours.state_dict())}
    steps = {name: bench._step(layer.parameters(), x_TD, grad_TD, layer) for name, layer in layers.items()
             if not isinstance(layer, str)}
    times = {name: [] for name in steps}
    for round_index in range(args.warmup + args.rounds):     # interleaved, as bench.interleaved_median_ms
        for name, step in steps.items():
            seconds = step()
            if round_index >= args.warmup:
                times[name].append(seconds)
    median_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    paired = {name: statistics.median(a / b for a, b in zip(t, times["moe_plugin"])) for name, t in times.items()}
    print(f"shape {args.shape}: {shape}, fp32 CPU, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds after {args.warmup} warmup")
    for name, layer in layers.items():
        if isinstance(layer, str):
            print(f"  {name:11s} {layer}")
        else:
            print(f"  {name:11s} {median_ms[name]:9.1f} ms   median of rounds' ratios {paired[name]:.3f}x moe_plugin "
                  f"(ratio of medians {median_ms[name] / median_ms['moe_plugin']:.3f})")


if __name__ == "__main__":
    main()
