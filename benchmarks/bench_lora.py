"""LoRA fine-tuning on the experts: ours against PEFT on Hugging Face's grouped_mm experts, in one run.

Variants (the same weights and the same adapter values, checked equal before timing):
  peft      PEFT 0.21 LoraConfig(target_parameters=[experts' gate_up_proj, down_proj]) on HF's grouped_mm experts
            (each forward folds W + s B A into a new weight, and its backward runs the full weight gradient)
  backend   the same PEFT model with experts_implementation="moe_plugin" (the backend reads PEFT's A and B)
  swap      swap_moe_blocks, then the same get_peft_model (PEFT targets the swapped layer's experts by HF's names)
  layer     swap_moe_blocks, then moe_plugin.lora.add_lora on the experts (attention adapters, in the train case,
            from PEFT's target_modules as in the others)
Cases:
  block     the Mixtral-like block of bench_hf.py (D 512, E 8, top-2, H 1024), forward + backward, r 16 on the experts
  train     a small Mixtral (2 layers), r 16 on every expert and attention projection: forward, backward, Adam step
Step time: medians of calls interleaved round robin (wall and this process's CPU time). Peak memory: each variant
in a fresh process, the peak resident memory (VmHWM) of its steps above the resident memory once the model and
its inputs are built (tracemalloc cannot see tensors: torch allocates outside Python's allocator), and the peak
tensor bytes of one step (LiveTensors: the storages its ops create, alive at once; free of the allocator's and the
C library's caching, which blur resident memory by +-10 %). Ratios are ours / PEFT (< 1: ours better).

    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py --threads 1
"""
import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hf import BLOCK_SHAPES, Holder, block_config, hf_block  # noqa: E402  (imports the backend too)

import moe_plugin.integrations.transformers as hf_moe  # noqa: E402
from moe_plugin.integrations.transformers.peft import from_peft  # noqa: E402
from moe_plugin.lora import add_lora  # noqa: E402

VARIANTS = ("peft", "backend", "swap", "layer")
RANK, ALPHA = 16, 32
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TRAIN = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("block", "train", "all"), default="all")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per block call")
    parser.add_argument("--batch", type=int, default=8, help="train case: sequences of --length tokens")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--memory-of", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def lora_config(targets_experts: bool, attention: bool, prefix: str):
    import peft
    return peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION if attention else None,
                           target_parameters=[f"{prefix}experts.gate_up_proj", f"{prefix}experts.down_proj"]
                           if targets_experts else None, init_lora_weights=False)


def copy_adapters(peft_model, swapped, num_experts):
    """The PEFT model's expert adapters into the swapped model's (same values: the variants compute one function)."""
    wrappers = {name: module for name, module in peft_model.named_modules() if type(module).__name__ == "ParamWrapper"}
    layers = {name: module for name, module in swapped.named_modules() if isinstance(module, hf_moe.HFMoEBlock)}
    with torch.no_grad():
        for name, block in layers.items():
            lora = block.moe.experts.lora
            for param, (a, b) in (("gate_up_proj", ("up_a_EDQ", "up_b_EQF")), ("down_proj", ("down_a_EHQ", "down_b_EQD"))):
                wrapper = next(w for n, w in wrappers.items() if n.startswith(_peft_name(name)) and
                               w.parameter_name == param)
                a_t, b_t = from_peft(wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight, num_experts)
                getattr(lora, a).copy_(a_t)
                getattr(lora, b).copy_(b_t)


def _peft_name(swapped_name):
    """A block's name in the PEFT model (the swapped model may be a PEFT model itself)."""
    return "base_model.model." + swapped_name.removeprefix("base_model.model.") + "."


def build(case, variant, args):
    """(model, step function, inputs)."""
    import peft
    import transformers
    torch.manual_seed(0)
    if case == "block":
        config = block_config(BLOCK_SHAPES["mixtral"])
        base = Holder(config, hf_block(config, "grouped_mm"))
        x = torch.randn(1, args.tokens, config.hidden_size)
        grad = torch.randn_like(x)
        make_peft = lambda model: peft.get_peft_model(model, lora_config(True, False, "block."))  # noqa: E731
        forward = lambda model: (model.block(x) if variant == "layer" else  # noqa: E731
                                 model.base_model.model.block(x))
    else:
        config = transformers.MixtralConfig(**TRAIN)
        base = transformers.MixtralForCausalLM(config)
        ids = torch.randint(0, TRAIN["vocab_size"], (args.batch, args.length),
                            generator=torch.Generator().manual_seed(1))
        make_peft = lambda model: peft.get_peft_model(model, lora_config(True, True, "mlp."))  # noqa: E731
        forward = lambda model: model(ids, labels=ids).loss  # noqa: E731
    E = config.num_local_experts
    torch.manual_seed(1)
    reference = make_peft(copy.deepcopy(base))
    if variant == "peft":
        model = reference
    elif variant == "backend":
        hf = copy.deepcopy(base)
        if case == "train":
            hf.set_experts_implementation("moe_plugin")
        else:
            hf.block.experts.config._experts_implementation = "moe_plugin"
        torch.manual_seed(1)
        model = make_peft(hf)
    elif variant == "swap":
        model = make_peft(hf_moe.swap_moe_blocks(copy.deepcopy(base)))
        theirs = dict(reference.named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.requires_grad:
                    param.copy_(theirs[name])
    else:
        model = hf_moe.swap_moe_blocks(copy.deepcopy(base))
        if case == "train":
            import peft as peft_module
            torch.manual_seed(1)
            model = peft_module.get_peft_model(model, peft_module.LoraConfig(
                r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION, init_lora_weights=False))
        else:
            for param in model.parameters():
                param.requires_grad_(False)
        add_lora(model, rank=RANK, alpha=ALPHA)
        copy_adapters(reference, model, E)
        if case == "train":
            swapped_attention = {n: p for n, p in model.named_parameters() if "lora_" in n}
            with torch.no_grad():
                for n, p in reference.named_parameters():
                    if n in swapped_attention:
                        swapped_attention[n].copy_(p)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-4) if case == "train" else None

    def step():
        out = forward(model)
        if case == "block":
            out = (out * grad).sum()
        out.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        return out.detach()

    return model, step, forward, sum(p.numel() for p in params)


def rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


class LiveTensors(TorchDispatchMode):
    """The bytes of tensor storage that ops run inside it created and that are still alive, and their peak: what
    the autograd graph, the activations and the gradients hold, free of the allocator's and the C library's
    caching (which blur resident memory); temporaries inside one kernel are not seen."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()
        gc.collect()
        self.before = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())   # the model, its inputs
                       for t in gc.get_objects() if isinstance(t, torch.Tensor) and not t.is_meta}

    def _free(self, key, nbytes):
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if storage.nbytes() and key not in self.seen and key not in self.before:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def memory_of(case, variant, args):
    """Peak memory of warmup + 2 steps, in MB (this process only): (resident memory above the built model's,
    peak tensor bytes of the last step above those alive before it (LiveTensors))."""
    model, step, _, _ = build(case, variant, args)
    base = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(args.warmup + 1):
        step()
    with LiveTensors() as tensors:
        step()
    return (rss_kib("VmHWM") - base) / 1024, tensors.peak / 2**20


def bench(case, args):
    built = {v: build(case, v, args) for v in VARIANTS}
    with torch.no_grad():
        outs = {v: built[v][2](built[v][0]) for v in VARIANTS}
    diffs = {v: float((outs[v] - outs["peft"]).abs().max() / outs["peft"].abs().max()) for v in VARIANTS}
    assert max(diffs.values()) < 1e-4, f"the variants differ: {diffs}"
    times = {clock: {v: [] for v in VARIANTS} for clock in ("wall", "cpu")}
    for i in range(args.warmup + args.repeats):
        for v in VARIANTS:
            wall, cpu = time.perf_counter(), time.process_time()
            built[v][1]()
            if i >= args.warmup:
                times["wall"][v].append(time.perf_counter() - wall)
                times["cpu"][v].append(time.process_time() - cpu)
    memory = {}
    for v in VARIANTS:
        command = [sys.executable, __file__, "--memory-of", case, v, "--tokens", str(args.tokens), "--batch",
                   str(args.batch), "--length", str(args.length), "--warmup", str(args.warmup)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        memory[v] = [float(mb) for mb in subprocess.run(command, check=True, capture_output=True,
                                                         text=True).stdout.split()[-2:]]
    medians = {clock: {v: statistics.median(t) for v, t in by.items()} for clock, by in times.items()}
    return {"case": case, "max_rel_diff": max(diffs.values()),
            "trainable": {v: built[v][3] for v in VARIANTS},
            **{f"{clock}_ms": {v: round(s * 1e3, 1) for v, s in m.items()} for clock, m in medians.items()},
            **{f"{clock}_ratio": {v: round(m[v] / m["peft"], 3) for v in VARIANTS[1:]} for clock, m in medians.items()},
            "peak_mb": {v: round(mb[0], 1) for v, mb in memory.items()},
            "peak_ratio": {v: round(memory[v][0] / memory["peft"][0], 3) for v in VARIANTS[1:]},
            "tensor_peak_mb": {v: round(mb[1], 1) for v, mb in memory.items()},
            "tensor_peak_ratio": {v: round(memory[v][1] / memory["peft"][1], 3) for v in VARIANTS[1:]}}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        print(*memory_of(*args.memory_of, args))
        return
    cases = ("block", "train") if args.case == "all" else (args.case,)
    results = [bench(case, args) for case in cases]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__, "results": results}))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, LoRA r {RANK}, alpha {ALPHA}")
    for r in results:
        print(f"{r['case']}: max rel diff {r['max_rel_diff']:.2g}; trainable {r['trainable']}")
        for key in ("wall_ms", "cpu_ms", "wall_ratio", "cpu_ratio", "peak_mb", "peak_ratio", "tensor_peak_mb",
                    "tensor_peak_ratio"):
            print(f"  {key:10s} {r[key]}")


if __name__ == "__main__":
    main()
