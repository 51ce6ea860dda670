"""Hugging Face MoE blocks against the same blocks on moe_plugin's layer (swap_moe_blocks), in one run.

block: one sparse-MoE block alone, forward + backward on T tokens: HF's "eager" experts, HF's
  "grouped_mm" experts (transformers' default) and ours (the HF block swapped, same weights).
  Shapes (--shapes): mixtral (D 512, E 8, k 2, H 1024) and deepseek (D 512, E 64, k 8, H 256, one
  shared expert, 8 groups of which 4 chosen) by default; tiny (D 64, E 8, k 2, H 64) with --tokens 32
  measures each side's host overhead per call.
train: an AdamW training step (forward, backward, step) of a small Mixtral-architecture causal LM
  (2 layers, D 256, 32 experts of 256, top-4, 8 x 256 tokens): HF grouped_mm vs ours.
generate: greedy generate of 32 tokens, batch 1, by a tiny Mixtral (2 layers, D 64, 8 experts of 64, top-2):
  ms per generated token, HF's own model vs the same model swapped (the tokens are checked equal).

Runs alternate between the variants (round robin) so that load on the machine hits them alike; the
median of each is reported with ours / HF grouped_mm (< 1: ours is faster).

    python benchmarks/bench_hf.py                     # both cases
    python benchmarks/bench_hf.py --case block --repeats 30
    python benchmarks/bench_hf.py --case block --shapes tiny --tokens 32 --repeats 400 --warmup 50 --threads 1
    python benchmarks/bench_hf.py --case generate --repeats 40 --warmup 2 --threads 1
"""
import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

import moe_plugin.integrations.transformers as hf_moe   # hides an unloadable torchaudio first
import transformers

BLOCK_SHAPES = {
    "mixtral": dict(family="mixtral", D=512, E=8, k=2, H=1024),
    "deepseek": dict(family="deepseek_v3", D=512, E=64, k=8, H=256, shared=1, groups=8, topk_groups=4),
    # so small that the GEMMs cost little: the time is each side's host overhead per call (with --tokens 32)
    "tiny": dict(family="mixtral", D=64, E=8, k=2, H=64),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("block", "train", "generate", "all"), default="all")
    parser.add_argument("--shapes", default="mixtral,deepseek",
                        help=f"block shapes, comma-separated, of: {', '.join(BLOCK_SHAPES)}")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per block call")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def block_config(shape):
    if shape["family"] == "mixtral":
        return transformers.MixtralConfig(hidden_size=shape["D"], intermediate_size=shape["H"],
                                          num_local_experts=shape["E"], num_experts_per_tok=shape["k"])
    return transformers.DeepseekV3Config(hidden_size=shape["D"], moe_intermediate_size=shape["H"],
                                         n_routed_experts=shape["E"], num_experts_per_tok=shape["k"],
                                         n_shared_experts=shape["shared"], n_group=shape["groups"],
                                         topk_group=shape["topk_groups"], norm_topk_prob=True,
                                         routed_scaling_factor=2.5)


class Holder(nn.Module):
    """One HF block with the config swap_moe_blocks reads."""

    def __init__(self, config, block):
        super().__init__()
        self.config, self.block = config, block


def hf_block(config, implementation):
    family = hf_moe.FAMILIES[config.model_type]
    config = copy.deepcopy(config)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = family.block_class()(config)
    with torch.no_grad():
        for name, tensor in block.named_parameters():
            tensor.normal_(0, 0.02)
        for name, tensor in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.01)
    return block


def timed(fn, variants, repeats, warmup):
    """Median seconds of fn(variant) per variant, calls interleaved round robin."""
    times = {name: [] for name in variants}
    for i in range(warmup + repeats):
        for name, variant in variants.items():
            start = time.perf_counter()
            fn(variant)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_block(shape_name, args):
    shape = BLOCK_SHAPES[shape_name]
    config = block_config(shape)
    eager, grouped = hf_block(config, "eager"), hf_block(config, "grouped_mm")
    ours = hf_moe.swap_moe_blocks(Holder(config, hf_block(config, "eager"))).block
    x = torch.randn(1, args.tokens, shape["D"])
    grad = torch.randn_like(x)
    with torch.no_grad():   # the same function: check before timing
        diff = (ours(x) - grouped(x)).abs().max() / grouped(x).abs().max()
    assert diff < 1e-4, f"ours differs from HF by {float(diff):.3g}"

    def step(block):
        xi = x.detach().requires_grad_()
        block(xi).backward(grad)
        block.zero_grad(set_to_none=True)

    seconds = timed(step, {"hf_eager": eager, "hf_grouped_mm": grouped, "ours": ours}, args.repeats, args.warmup)
    return {"case": f"block/{shape_name}", **{k: v for k, v in shape.items()}, "tokens": args.tokens,
            "ms": {k: round(v * 1e3, 2) for k, v in seconds.items()},
            "ours_over_grouped_mm": round(seconds["ours"] / seconds["hf_grouped_mm"], 3),
            "ours_over_eager": round(seconds["ours"] / seconds["hf_eager"], 3)}


def train_model(implementation, swap):
    config = transformers.MixtralConfig(vocab_size=1024, hidden_size=256, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        num_local_experts=32, num_experts_per_tok=4, max_position_embeddings=256,
                                        output_router_logits=True, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    if swap:
        hf_moe.swap_moe_blocks(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def bench_train(args):
    ids = torch.randint(0, 1024, (8, 256), generator=torch.Generator().manual_seed(1))
    variants = {"hf_grouped_mm": train_model("grouped_mm", False), "ours": train_model("grouped_mm", True)}
    losses = {}

    def step(variant):
        model, optimizer = variant
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[id(model)] = float(loss.detach())

    seconds = timed(step, variants, max(3, args.repeats // 2), args.warmup)
    return {"case": "train/mixtral", "layers": 2, "D": 256, "E": 32, "H": 256, "k": 4, "tokens": "8x256",
            "ms": {k: round(v * 1e3, 1) for k, v in seconds.items()},
            "ours_over_grouped_mm": round(seconds["ours"] / seconds["hf_grouped_mm"], 3)}


def generate_model(swap):
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
                                        num_experts_per_tok=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm").eval()
    return hf_moe.swap_moe_blocks(model) if swap else model


def bench_generate(args):
    """Greedy generate, batch 1: seconds per generated token, HF's own tiny Mixtral vs the same swapped."""
    prompt = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    variants = {"hf_grouped_mm": generate_model(False), "ours": generate_model(True)}
    new_tokens, outputs = 32, {}

    def generate(model):
        with torch.no_grad():
            outputs[id(model)] = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                do_sample=False, pad_token_id=0)
    seconds = timed(generate, variants, max(3, args.repeats // 4), args.warmup)
    same = torch.equal(*(outputs[id(m)] for m in variants.values()))
    return {"case": "generate/mixtral_tiny", "layers": 2, "D": 64, "E": 8, "H": 64, "k": 2, "tokens": new_tokens,
            "ms": {k: round(v * 1e3 / new_tokens, 3) for k, v in seconds.items()}, "same_tokens": same,
            "ours_over_grouped_mm": round(seconds["ours"] / seconds["hf_grouped_mm"], 3)}


def main(argv=None):
    args = parse_args(argv)
    shapes = [name for name in args.shapes.split(",") if name]
    unknown = sorted(set(shapes) - set(BLOCK_SHAPES))
    if unknown:
        raise SystemExit(f"--shapes: unknown {', '.join(unknown)}; allowed: {', '.join(BLOCK_SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    if args.case in ("block", "all"):
        results += [bench_block(name, args) for name in shapes]
    if args.case in ("train", "all"):
        results.append(bench_train(args))
    if args.case in ("generate", "all"):
        results.append(bench_generate(args))
    report(results, args.json)


def report(results, as_json: bool, width: int = 16) -> None:
    """The results as one JSON object, or one line per case."""
    if as_json:
        print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                          "transformers": transformers.__version__, "results": results}))
        return
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    for r in results:
        times = ", ".join(f"{k} {v} ms" for k, v in r["ms"].items())
        print(f"{r['case']:{width}s} {times}; ours / HF grouped_mm = {r['ours_over_grouped_mm']}")


if __name__ == "__main__":
    main()
