"""Routing in four kernels (ops/triton_route.py) as one autograd function, on the CUDA path in eager mode (on CPU
in eager mode the same in a few torch ops, ops/torch_route.py): the router's logits, softmax and top-k, the
balance and z losses, the plan (slots, loads, offsets) and the final gates. It replaces, for the configurations it covers (eligible), Router.forward -> dispatch.plan_routes ->
router.finalize_gates, which stay the reference (tests compare them) and the path everywhere else.

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, E experts, K top-k).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import dispatch
from .fused_experts import NoGraph
from ..ops import torch_route
from ..ops.choice import device_kind, eager_triton, triton_modules
from ..ops.launches import LaunchCounter
from ..router import counts_globally, finalize_gates

MAX_EXPERTS = 512
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def eligible(layer, routed_TD: torch.Tensor) -> bool:
    """Whether the fused routing computes what the reference path would for this call."""
    return _kernels(routed_TD.device) is not None and _plain_dispatch() and routed_as_configured(layer, routed_TD)


def routed_as_configured(layer, routed_TD: torch.Tensor) -> bool:
    """eligible's checks of the layer, its router and the input (a caller that has chosen the kernels already).
    A balance loss counted over every process (aux_loss_scope "global", counts_globally) takes the reference path,
    whose router all-reduces its counts (the kernels count this process's)."""
    cfg, router = layer.config, layer.router
    if routed_TD.shape[0] == 0:
        return False
    noisy = router.training and (cfg.gate_noise > 0 or getattr(router, "noise_policy", None) is not None)
    hooked = bool(router._forward_hooks or router._forward_pre_hooks)   # the fused path never calls the router
    return (cfg.router == "softmax" and not noisy and not hooked and router.bias_E is None
            and router.input_scale_D is None
            and router.gate_scale_E is None and not router.bias_routes and cfg.topk_groups >= cfg.num_groups
            and cfg.aux_loss in ("gshard", "switch", "none") and not cfg.batch_prioritized_routing
            and not cfg.gate_on_input and not layer.is_parallel and cfg.num_experts <= MAX_EXPERTS
            and routed_TD.dtype == router.weight_ED.dtype and routed_TD.dtype in DTYPES
            and (cfg.fp32_router or routed_TD.dtype == torch.float32) and not counts_globally(router))


def _kernels(device: torch.device):
    """triton_route for CUDA in eager mode, torch_route for CPU in eager mode, else None."""
    if eager_triton(device) is not None:
        return triton_modules()[1]
    if device_kind(device) == "cpu" and not torch.compiler.is_compiling():
        return torch_route
    return None


def _plain_dispatch() -> bool:
    """No tensor subclass mode but the launch counter's (fake tensors and tracing need the reference path)."""
    if not torch._C._len_torch_dispatch_stack() and torch._C._functorch.peek_interpreter_stack() is None:
        return True
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return torch._C._functorch.peek_interpreter_stack() is None and \
        all(isinstance(mode, LaunchCounter) for mode in _get_current_dispatch_mode_stack())


def route(layer, routed_TD: torch.Tensor, capacity_factor: float, gate_dtype: torch.dtype
          ) -> Tuple[torch.Tensor, torch.Tensor, dispatch.Plan]:
    """(final gates [T, K] in gate_dtype, aux loss (coefficients applied), plan)."""
    spec, cap, fixed = route_spec(layer.config, routed_TD.shape[0], capacity_factor, gate_dtype)
    # no graph recorded (eligible() has ruled out compiling and functorch): forward itself, without apply's host work
    # the loads, kept rows and aux value go straight into the layer's persistent stats (CUDA graphs' replays write
    # them too)
    stats = (*layer._stats_rows, layer._aux_value) if layer._stats_2E.device == routed_TD.device else None
    args = routed_TD, layer.router.weight_ED, spec, stats
    outputs = FusedRoute.apply(*args) if torch.is_grad_enabled() else FusedRoute.forward(NoGraph(), *args)
    final_TK, aux, pos_TK, kept_TK, load_E, kept_E, offs_E = outputs
    return final_TK, aux, dispatch.Plan(pos_TK, kept_TK, load_E, kept_E, offs_E, cap, capacity_factor, fixed)


def route_spec(cfg, T: int, capacity_factor: float, gate_dtype: torch.dtype) -> Tuple[tuple, int, int]:
    """(spec, cap, fixed) of the routing of T tokens: spec = (K, normalize, route scale, cap, aux kind, aux scale,
    z-loss scale, gate dtype), what the fused routing's kernels take; cap the slot limit, fixed the fixed capacity."""
    K, E = cfg.top_k, cfg.num_experts
    fixed = dispatch.fixed_capacity(abs(capacity_factor), T, E, K, cfg.min_capacity, cfg.capacity_formula,
                                    cfg.capacity_alignment) if capacity_factor else T
    cap = T * K if capacity_factor == 0 else fixed
    counted = {"gshard": T, "switch": T * K, "none": 0}[cfg.aux_loss]
    aux_scale = cfg.aux_loss_coef * E / (T * counted) if counted else 0.0
    spec = (K, cfg.normalize_gate, cfg.route_scale, cap, cfg.aux_loss, aux_scale, cfg.z_loss_coef / T, gate_dtype)
    return spec, cap, fixed


class FusedRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_ED, spec, stats=None):
        """stats: (load_E, kept_E, aux_value): int64 tensors the Triton routing writes its loads into, and an fp32 []
        tensor it writes the aux loss's value into; or None."""
        kernels = _kernels(x_TD.device)
        x_TD, w_ED = x_TD.contiguous(), w_ED.contiguous()
        ctx.spec, ctx.kernels = spec, kernels
        ctx.set_materialize_grads(False)
        if kernels.__name__.endswith("torch_route"):
            outputs, (expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E) = kernels.route(x_TD, w_ED, *spec)
        else:
            outputs, (expert_TK, gate_TK, probs_TE, lse_T, aux_grad_E) = kernels.route(x_TD, w_ED, *spec,
                                                                                       stats=stats or ())
        ctx.save_for_backward(x_TD, w_ED, expert_TK, gate_TK, outputs[2], probs_TE, lse_T, aux_grad_E)
        ctx.mark_non_differentiable(*outputs[2:])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_final_TK, grad_aux, *_):
        x_TD, w_ED, expert_TK, gate_TK, pos_TK, probs_TE, lse_T, aux_grad_E = ctx.saved_tensors
        K, normalize, scale, cap, aux_kind, aux_scale, z_scale, gate_dtype = ctx.spec
        if grad_final_TK is None and grad_aux is None:
            return None, None, None, None
        grad_TE = ctx.kernels.route_backward(
            None if grad_final_TK is None else grad_final_TK.contiguous(), grad_aux, expert_TK, gate_TK, pos_TK,
            probs_TE, lse_T, aux_grad_E, normalize, scale, z_scale, x_TD.dtype)
        # Triton: the logits' gradient in x's dtype; torch: in fp32, the GEMMs too (as the reference's fp32 router)
        grad_x_TD = (grad_TE @ w_ED.to(grad_TE.dtype)).to(x_TD.dtype) if ctx.needs_input_grad[0] else None
        grad_w_ED = (grad_TE.t() @ x_TD.to(grad_TE.dtype)).to(w_ED.dtype) if ctx.needs_input_grad[1] else None
        return grad_x_TD, grad_w_ED, None, None


def reference(layer, routed_TD: torch.Tensor, capacity_factor: float, gate_dtype: torch.dtype,
              seq_len: Optional[int] = None, sequence_T: Optional[torch.Tensor] = None):
    """What route computes, on the reference path: Router.forward, dispatch.plan_routes, router.finalize_gates."""
    cfg = layer.config
    routes = layer.router(routed_TD, seq_len=seq_len, sequence_T=sequence_T)
    priority_T = routes.scores_TE.max(-1).values.detach() if cfg.batch_prioritized_routing else None
    plan = dispatch.plan_routes(routes.expert_TK, cfg.num_experts, capacity_factor, cfg.min_capacity, priority_T,
                                cfg.capacity_formula, cfg.capacity_alignment)
    gate_TK = finalize_gates(routes.gate_TK, plan.kept_TK, cfg.normalize_gate, cfg.route_scale)
    aux = cfg.aux_loss_coef * routes.aux_loss + cfg.z_loss_coef * routes.z_loss
    return gate_TK.to(gate_dtype), aux, plan, routes
