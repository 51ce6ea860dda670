"""Hugging Face MoE blocks that need the layer's less common features (gpt_oss: swiglu_oai + biases; llama4:
gating the expert input; nemotron_h: relu2; families_special.py) against the same blocks swapped onto
moe_plugin's layer, in one run.

Each block alone, forward + backward on T tokens, fp32: HF's "grouped_mm" experts (transformers' default where
the experts class takes an implementation: gpt_oss, nemotron_h), HF's "eager" experts, and ours (the HF block
swapped, same weights). Llama 4's experts class has no implementations: HF runs every expert on every token
(a dense bmm over [E, T, D]), so its "grouped_mm" and "eager" are the same code.

Shapes (Mixtral-like sizes, the families' routing):
  gpt_oss     D 512, E 32, k 4, H 512, swiglu limit 7, alpha 1.702, router and expert biases
  llama4      D 512, E 16, k 1, H 1024, shared MLP 1024, sigmoid gating the expert input
  nemotron_h  D 512, E 64, k 6, H 256, shared MLP 512, relu2, sigmoid with 8 groups of which 4 chosen

train (--case train): an AdamW training step (forward, backward, step) of a small causal LM of each family (2
layers, D 256, 8 x 128 tokens, router aux loss on): HF (grouped_mm experts where the family has them) vs the same
model swapped. gpt_oss: 32 experts of 256, top-4; llama4: 16 experts of 256, top-1, both layers MoE; nemotron_h:
an attention and an MoE layer, 32 experts of 128, top-4, shared MLP 256.

Runs alternate between the variants (round robin) so that load on the machine hits them alike; the median
of each is reported with ours / HF grouped_mm (< 1: ours is faster).

    python benchmarks/bench_hf_special.py --threads 1 --repeats 10
    python benchmarks/bench_hf_special.py --threads 1 --repeats 6 --case train
"""
import argparse
import os
import sys

import torch

import moe_plugin.integrations.transformers as hf_moe   # hides an unloadable torchaudio first
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hf import Holder, hf_block, report, timed  # noqa: E402  (one HF block, interleaved medians)

SHAPES = {
    "gpt_oss": lambda: transformers.GptOssConfig(hidden_size=512, intermediate_size=512, num_local_experts=32,
                                                 num_experts_per_tok=4),
    "llama4": lambda: transformers.Llama4TextConfig(hidden_size=512, intermediate_size=1024, num_local_experts=16,
                                                    num_experts_per_tok=1),
    "nemotron_h": lambda: transformers.NemotronHConfig(hidden_size=512, moe_intermediate_size=256,
                                                       moe_shared_expert_intermediate_size=512, n_routed_experts=64,
                                                       num_experts_per_tok=6, n_group=8, topk_group=4,
                                                       routed_scaling_factor=2.5, norm_topk_prob=True),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES) + ["all"], default="all")
    parser.add_argument("--case", choices=("block", "train"), default="block")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per block call")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def output(y):
    """gpt_oss and llama4 blocks return (hidden states, router scores or logits); Llama 4's as [T, D]."""
    return y[0] if isinstance(y, tuple) else y


def bench(shape_name, args):
    config = SHAPES[shape_name]()
    variants = {"hf_grouped_mm": hf_block(config, "grouped_mm"), "hf_eager": hf_block(config, "eager"),
                "ours": hf_moe.swap_moe_blocks(Holder(config, hf_block(config, "eager"))).block}
    if shape_name == "llama4":       # no experts implementations: one HF variant
        del variants["hf_eager"]
    x = torch.randn(1, args.tokens, config.hidden_size)
    grad = torch.randn_like(x)
    with torch.no_grad():   # the same function: check before timing
        want = output(variants["hf_grouped_mm"](x)).view(x.shape)
        diff = (output(variants["ours"](x)).view(x.shape) - want).abs().max() / want.abs().max()
    assert diff < 1e-4, f"ours differs from HF by {float(diff):.3g}"

    def step(block):
        xi = x.detach().requires_grad_()
        output(block(xi)).view(x.shape).backward(grad)
        block.zero_grad(set_to_none=True)

    seconds = timed(step, variants, args.repeats, args.warmup)
    return {"case": f"block/{shape_name}", "tokens": args.tokens, "max_rel_diff": float(diff),
            "ms": {k: round(v * 1e3, 2) for k, v in seconds.items()},
            "ours_over_grouped_mm": round(seconds["ours"] / seconds["hf_grouped_mm"], 3)}


SMALL = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=256, output_router_logits=True, router_aux_loss_coef=0.01)
TRAIN_MODELS = {
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, intermediate_size=256, num_local_experts=32,
                                                 num_experts_per_tok=4, layer_types=["full_attention"] * 2),
    "llama4": lambda: transformers.Llama4TextConfig(**SMALL, intermediate_size=256, intermediate_size_mlp=512,
                                                    num_local_experts=16, num_experts_per_tok=1),
    "nemotron_h": lambda: transformers.NemotronHConfig(**{**SMALL, "num_hidden_layers": 2}, moe_intermediate_size=128,
                                                       moe_shared_expert_intermediate_size=256, n_routed_experts=32,
                                                       num_experts_per_tok=4, n_group=4, topk_group=2,
                                                       layers_block_type=["attention", "moe"]),
}


def train_model(name, swap):
    torch.manual_seed(0)
    options = {} if name == "llama4" else {"experts_implementation": "grouped_mm"}   # Llama 4's experts have none
    model = transformers.AutoModelForCausalLM.from_config(TRAIN_MODELS[name](), **options)
    if swap:
        hf_moe.swap_moe_blocks(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def bench_train(name, args):
    ids = torch.randint(0, 1024, (8, 128), generator=torch.Generator().manual_seed(1))
    variants = {"hf_grouped_mm": train_model(name, False), "ours": train_model(name, True)}
    first = {key: float(model(ids, labels=ids).loss) for key, (model, _) in variants.items()}
    assert abs(first["ours"] - first["hf_grouped_mm"]) < 1e-4 * abs(first["hf_grouped_mm"]), first

    def step(variant):
        model, optimizer = variant
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed(step, variants, args.repeats, args.warmup)
    return {"case": f"train/{name}", "tokens": "8x128", "ms": {k: round(v * 1e3, 1) for k, v in seconds.items()},
            "ours_over_grouped_mm": round(seconds["ours"] / seconds["hf_grouped_mm"], 3)}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = sorted(SHAPES) if args.shape == "all" else [args.shape]
    results = [(bench if args.case == "block" else bench_train)(name, args) for name in names]
    report(results, args.json, width=18)


if __name__ == "__main__":
    main()
