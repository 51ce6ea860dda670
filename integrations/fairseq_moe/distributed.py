"""Expert parameters under fairseq's legacy_ddp.

fairseq-fixed's LegacyDistributedDataParallel all-reduces the gradient of every parameter except
those with an `expert` attribute, dividing the sum by the world size W; the trainer then multiplies
every gradient by W / sample_size (sample_size summed over the ranks), so a shared gradient ends as
(sum over all tokens) / sample_size. The expert parameters are marked and hooked by
moe_plugin.parallel.expert_grads, which sums their gradients over the ranks holding the same
experts and divides by W, so after the trainer's multiply an expert's gradient too is (sum over all
tokens) / sample_size.

With --moe-ep-size 1 every rank holds every expert: those are ordinary shared parameters.
"""
from __future__ import annotations

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.utils import safe_getattr

from moe_plugin.parallel.expert_grads import expert_parameters, hook_expert_grads

LEGACY_BACKENDS = ("legacy_ddp", "no_c10d")


def prepare_expert_parameters(model: torch.nn.Module, args) -> int:
    """Mark and hook the expert parameters of the expert-parallel MoE layers; returns how many."""
    if not expert_parameters(model):
        return 0
    backend = safe_getattr(args, "ddp_backend", None)
    if backend is not None and backend not in LEGACY_BACKENDS:
        raise ValueError(f"--moe-ep-size {args.moe_ep_size} needs --ddp-backend legacy_ddp (or no_c10d), got "
                         f"--ddp-backend {backend}: it keeps expert parameters out of the all-reduce")
    flat_fp32_copy = (safe_getattr(args, "fp16", False) or safe_getattr(args, "bf16", False)) and not (
        safe_getattr(args, "memory_efficient_fp16", False) or safe_getattr(args, "memory_efficient_bf16", False)
        or safe_getattr(args, "fp16_no_flatten_grads", False))
    if flat_fp32_copy:
        raise ValueError(f"--fp16/--bf16 with --moe-ep-size {args.moe_ep_size} needs --fp16-no-flatten-grads (or "
                         f"--memory-efficient-fp16): fairseq's flattened fp32 copy of the parameters loses the "
                         f"expert marks, and the expert gradients would enter the gradient norm that fairseq "
                         f"requires to be equal on every rank")
    hooked = hook_expert_grads(model, distributed_utils.get_data_parallel_world_size())
    for _, param in hooked:
        param.expert = True
    return len(hooked)
