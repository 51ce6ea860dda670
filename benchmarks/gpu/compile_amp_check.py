"""Which gradients torch.compile gets wrong on CUDA with fp32 expert weights under bf16 autocast (found on an H200,
torch 2.11, 2026-11-28: every expert weight's gradient at relative error 1.0 against eager, eager itself right).

    python benchmarks/gpu/compile_amp_check.py [--json FILE]

At the default shape (T 4096, D 1024, H 4096, E 8, top-2, ReLU with biases, capacity factor 1.25), each variant's
outputs and gradients against fp32 eager without autocast, per tensor (bf16 rounding alone gives a few 1e-2):
  eager_amp                   eager under autocast (the reference the compiled runs should match)
  compiled_amp                torch.compile as users run it (the layer runs its expert path eagerly here)
  compiled_amp_whole          the expert path compiled too (moe_plugin.layer.EAGER_EXPERTS_UNDER_COMPILED_AUTOCAST
                              emptied): the case that was wrong
  compiled_amp_whole_bwd_off  the same with torch._functorch.config.backward_pass_autocast = "off" (the compiled
                              backward outside the forward's autocast, as eager runs it)
  compiled_bf16               bf16 parameters, no autocast (no weight cast): against eager bf16
A variant that fails to run gets its error instead.

Legend: T tokens, D model dim.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_step import relative_error  # noqa: E402

import moe_plugin.layer as layer_module  # noqa: E402
from moe_plugin import MoEConfig, MoELayer  # noqa: E402

CONFIG = dict(model_dim=1024, hidden_size=4096, num_experts=8, top_k=2, activation="relu", capacity_factor=1.25,
              bias=True)
TOKENS = 4096


def outputs_and_grads(layer, forward, x_TD, grad_TD, amp):
    """([output, aux loss], {name: gradient}) of one step on a copy of x_TD."""
    params = dict(layer.named_parameters())
    x_TD = x_TD.detach().clone().requires_grad_()
    for p in params.values():
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False, enabled=amp):
        outputs = [forward(x_TD), layer.aux_loss]
    torch.autograd.backward(outputs, [grad_TD.to(outputs[0].dtype), torch.ones((), device="cuda")])
    grads = {name: p.grad.detach().float().clone() for name, p in params.items()}
    grads["x"] = x_TD.grad.detach().float().clone()
    return [o.detach().float().clone() for o in outputs], grads


def errors(got, reference) -> dict:
    return {"outputs": [relative_error(a, b) for a, b in zip(got[0], reference[0])],
            "gradients": {name: relative_error(got[1][name], reference[1][name]) for name in reference[1]}}


def compiled_run(layer, x_TD, grad_TD, amp, whole=False, backward_autocast=None):
    import torch._functorch.config as functorch_config
    before = (layer_module.EAGER_EXPERTS_UNDER_COMPILED_AUTOCAST, functorch_config.backward_pass_autocast)
    try:
        if whole:
            layer_module.EAGER_EXPERTS_UNDER_COMPILED_AUTOCAST = ()
        if backward_autocast is not None:
            functorch_config.backward_pass_autocast = backward_autocast
        torch._dynamo.reset()
        compiled = torch.compile(layer)
        for _ in range(3):
            result = outputs_and_grads(layer, compiled, x_TD, grad_TD, amp)
        return result
    finally:
        layer_module.EAGER_EXPERTS_UNDER_COMPILED_AUTOCAST, functorch_config.backward_pass_autocast = before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("compile_amp_check.py runs on a GPU: no CUDA device is available")
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**CONFIG)).cuda()
    x_TD = torch.randn(TOKENS, CONFIG["model_dim"], device="cuda")
    grad_TD = torch.randn_like(x_TD)
    fp32 = outputs_and_grads(layer, layer, x_TD, grad_TD, amp=False)
    variants = {
        "eager_amp": lambda: outputs_and_grads(layer, layer, x_TD, grad_TD, amp=True),
        "compiled_amp": lambda: compiled_run(layer, x_TD, grad_TD, amp=True),
        "compiled_amp_whole": lambda: compiled_run(layer, x_TD, grad_TD, amp=True, whole=True),
        "compiled_amp_whole_bwd_off": lambda: compiled_run(layer, x_TD, grad_TD, amp=True, whole=True,
                                                           backward_autocast="off"),
    }
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": CONFIG, "variants": {}}
    for name, run in variants.items():
        try:
            result["variants"][name] = errors(run(), fp32)
        except Exception as error:      # a variant that cannot run: its row says why
            result["variants"][name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print(name, result["variants"][name], flush=True)
    bf16 = MoELayer(MoEConfig(**CONFIG)).cuda().bfloat16()
    x16_TD = x_TD.bfloat16()
    try:
        reference = outputs_and_grads(bf16, bf16, x16_TD, grad_TD, amp=False)
        result["variants"]["compiled_bf16"] = errors(compiled_run(bf16, x16_TD, grad_TD, amp=False), reference)
    except Exception as error:
        result["variants"]["compiled_bf16"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    print("compiled_bf16", result["variants"]["compiled_bf16"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
