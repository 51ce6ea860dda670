"""Kernel launches of one forward + backward on the CUDA code path, counted on CPU (moe_plugin/ops/launches.py):
our layer, Hugging Face's Mixtral block on its grouped_mm experts, and the bare grouped GEMMs (the expert
FFN alone on rows already grouped by expert), side by side, for the configurations issue 33 budgets.

    python benchmarks/count_launches.py                 # a table
    python benchmarks/count_launches.py --by-op         # and each variant's launches by kernel
    python benchmarks/count_launches.py --json
    python benchmarks/count_launches.py --host         # host time of our CUDA code path, one node against two

Sets TRITON_INTERPRET=1 itself (before triton is imported): the Triton kernels run under the interpreter.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import moe_plugin.integrations.transformers  # noqa: E402,F401  (hides an unloadable torchaudio first)
from moe_plugin import MoEConfig, MoELayer  # noqa: E402
from moe_plugin.ops.choice import simulated_cuda  # noqa: E402
from moe_plugin.ops.launches import count_launches, kernels_replaced  # noqa: E402

# configuration -> (MoEConfig overrides, parameter dtype, autocast dtype or None, the budget of issue 33)
CASES = {
    "dropless_bf16": (dict(capacity_factor=0.0, bias=False), torch.bfloat16, None, 30),
    "bias_fixed_bf16": (dict(capacity_factor=1.25, bias=True), torch.bfloat16, None, 40),
    "autocast_fp32": (dict(capacity_factor=0.0, bias=False), torch.float32, torch.bfloat16, 45),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model-dim", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=96)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--by-op", action="store_true", help="print each variant's launches by kernel")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--host", action="store_true",
                        help="instead: host microseconds per forward + backward of ours on the CUDA code path with "
                             "every kernel a no-op, the one-node path (one_process/node_cuda.py) against the two-node")
    parser.add_argument("--rounds", type=int, default=7, help="--host: interleaved rounds of 100 steps each")
    return parser.parse_args(argv)


def count_step(forward, inputs, autocast_dtype=None):
    """(forward launches, backward launches, by kernel) of outputs = forward(); backward(outputs, inputs)."""
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with simulated_cuda(), autocast:   # a warm-up step on the counted path, backward included: lazy state and
        outputs = forward()            # the fused kernels' one-time timings (ops/fused_gemms.py) stay uncounted
        torch.autograd.backward(outputs, [torch.randn_like(out) for out in outputs])
    for leaf in leaves(outputs):       # as after optimizer.zero_grad(): the counted backward accumulates nothing
        leaf.grad = None
    with count_launches() as fwd:
        with autocast:
            outputs = forward()
    grads = [torch.randn_like(out) for out in outputs]
    with count_launches() as bwd:
        torch.autograd.backward(outputs, grads)
    return fwd, bwd


def leaves(outputs) -> list:
    """The leaf tensors outputs' graph accumulates gradients into."""
    found, seen = [], set()
    stack = [out.grad_fn for out in outputs if out.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def ours(args, overrides, dtype):
    config = MoEConfig(model_dim=args.model_dim, hidden_size=args.hidden_size, num_experts=args.num_experts,
                       top_k=args.top_k, activation="swiglu", **overrides)
    layer = MoELayer(config).to(dtype)
    x = torch.randn(args.tokens, args.model_dim, dtype=dtype, requires_grad=True)

    def forward():
        y = layer(x)
        return y, layer.aux_loss
    return forward


def hf_mixtral(args, dtype):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = transformers.MixtralConfig(hidden_size=args.model_dim, intermediate_size=args.hidden_size,
                                        num_local_experts=args.num_experts, num_experts_per_tok=args.top_k)
    config._experts_implementation = "grouped_mm"
    block = MixtralSparseMoeBlock(config).to(dtype)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.02)
    x = torch.randn(1, args.tokens, args.model_dim, dtype=dtype, requires_grad=True)
    return lambda: (block(x),)


def bare_grouped_gemms(args, dtype):
    """The expert FFN alone (SwiGLU, no bias) on T*K rows already grouped by expert: two grouped GEMMs."""
    E, D, H, R = args.num_experts, args.model_dim, args.hidden_size, args.tokens * args.top_k
    w1 = torch.randn(E, D, 2 * H, dtype=dtype, requires_grad=True)
    w2 = torch.randn(E, H, D, dtype=dtype, requires_grad=True)
    x = torch.randn(R, D, dtype=dtype, requires_grad=True)
    offs = torch.arange(1, E + 1, dtype=torch.int32) * (R // E)
    offs[-1] = R

    def forward():
        gate, up = F.grouped_mm(x, w1, offs=offs).chunk(2, dim=-1)
        return (F.grouped_mm(F.silu(gate) * up, w2, offs=offs),)
    return forward


class NoKernel:
    """A Triton kernel whose launches do nothing (kernel[grid](...) returns at once)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)


def host_us(args) -> dict:
    """Median microseconds of host work per forward + backward of ours (dropless SwiGLU, bf16) on the CUDA code path,
    the Triton kernels and grouped GEMMs no-ops (what is left: our Python, autograd, torch's dispatch and the few aten
    ops, on CPU tensors); the one-node path against the two-node one (node_cuda.ENABLED off), interleaved."""
    import statistics
    import time
    from moe_plugin.one_process import node_cuda
    forward = ours(args, dict(capacity_factor=0.0, bias=False), torch.bfloat16)
    outputs = forward()
    grads = [torch.randn_like(out) for out in outputs]
    params = leaves(outputs)

    def step():
        for leaf in params:
            leaf.grad = None
        torch.autograd.backward(forward(), grads)
    grouped_mm = torch._grouped_mm
    times = {"one_node": [], "two_nodes": []}
    with simulated_cuda():
        step()                       # the fused kernels' one-time timings, with the kernels running
        with kernels_replaced(lambda kernel, name: NoKernel(kernel)):
            try:
                torch._grouped_mm = lambda a, b, offs=None, **_: a.new_empty(a.shape[0], b.shape[-1]) \
                    if a.dim() == 2 and b.dim() == 3 else a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])
                for _ in range(args.rounds):
                    for variant in times:
                        node_cuda.ENABLED = variant == "one_node"
                        step()
                        start = time.perf_counter()
                        for _ in range(100):
                            step()
                        times[variant].append((time.perf_counter() - start) / 100 * 1e6)
            finally:
                node_cuda.ENABLED = True
                torch._grouped_mm = grouped_mm
    return {variant: statistics.median(t) for variant, t in times.items()}


def main(argv=None):
    args = parse_args(argv)
    if args.host:
        us = host_us(args)
        print(f"host us per forward + backward, CUDA code path with no-op kernels, T {args.tokens}, D {args.model_dim}, "
              f"H {args.hidden_size}, E {args.num_experts}, k {args.top_k}, SwiGLU bf16: one node {us['one_node']:.0f}, "
              f"two nodes {us['two_nodes']:.0f}, ratio {us['one_node'] / us['two_nodes']:.3f}")
        return
    rows = []
    for name, (overrides, dtype, autocast_dtype, budget) in CASES.items():
        torch.manual_seed(0)
        variants = {"ours": ours(args, overrides, dtype), "hf_grouped_mm": hf_mixtral(args, dtype),
                    "bare_grouped_gemms": bare_grouped_gemms(args, dtype)}
        if overrides["bias"]:        # HF's Mixtral has no expert biases: its row would not be the same layer
            del variants["hf_grouped_mm"]
        for variant, forward in variants.items():
            fwd, bwd = count_step(forward, None, autocast_dtype)
            rows.append(dict(case=name, variant=variant, forward=fwd.total, backward=bwd.total,
                             total=fwd.total + bwd.total, budget=budget if variant == "ours" else None,
                             syncs=sum(fwd.syncs.values()) + sum(bwd.syncs.values()),
                             forward_by_op=dict(fwd.by_name), backward_by_op=dict(bwd.by_name)))
    report(rows, args)


def report(rows, args):
    if args.json:
        print(json.dumps({"torch": torch.__version__, "tokens": args.tokens, "rows": rows}))
        return
    print(f"kernel launches, one forward + backward on the CUDA code path (counted on CPU), T {args.tokens}, "
          f"D {args.model_dim}, H {args.hidden_size}, E {args.num_experts}, k {args.top_k}, SwiGLU")
    print(f"{'case':16s} {'variant':20s} {'fwd':>4s} {'bwd':>4s} {'total':>5s} {'budget':>6s} {'syncs':>5s}")
    for r in rows:
        budget = "" if r["budget"] is None else str(r["budget"])
        print(f"{r['case']:16s} {r['variant']:20s} {r['forward']:4d} {r['backward']:4d} {r['total']:5d} "
              f"{budget:>6s} {r['syncs']:5d}")
        if args.by_op:
            for phase in ("forward_by_op", "backward_by_op"):
                ops = ", ".join(f"{op} {n}" for op, n in sorted(r[phase].items(), key=lambda kv: -kv[1]))
                print(f"    {phase.split('_')[0]}: {ops}")


if __name__ == "__main__":
    main()
