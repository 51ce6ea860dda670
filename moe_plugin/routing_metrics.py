"""Routing metrics per MoE layer and logging window (issue 44): RoutingMonitor(model) hooks every MoELayer;
each training forward adds its routing into a device tensor (no host synchronization); read() sums the window
over the processes (one all_reduce, one device read) and returns per-layer metrics; scalars() names them
moe/<layer>/<metric> with a whole-model summary under moe/all/<metric>.

Per layer and window (sums over every training forward of the window, every micro-batch, every process):
    max_load                 the busiest expert's tokens over the mean (1.0 balanced; E when one expert takes all)
    experts_without_tokens   how many experts got no token
    dropped_fraction         routed choices dropped by capacity, over all choices
    capacity_used            kept choices over the capacity's slots
    router_entropy           mean entropy of the router's distribution per token (nats; log(E) at most)
    balance_loss, z_loss     unweighted, as configured (aux_loss not "none"; z_loss_coef > 0), averaged over forwards
    expert_bias_spread       with expert bias balancing: max - min of the bias (when read)

Entropy and z-loss are recomputed from the router's input in the hook (one [T, E] router product, no noise drawn);
the balance loss is the layer's own (its aux loss less the z-loss term, over aux_loss_coef), recomputed from the
router's noise-free choice only where aux_loss_coef is 0. Shape legend: moe_plugin/shapes.py.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .layer import MoELayer
from .router import balance_loss, best_groups_only, load_importance_loss

METRICS = ("max_load", "experts_without_tokens", "dropped_fraction", "capacity_used", "router_entropy",
           "balance_loss", "z_loss", "expert_bias_spread")
# the whole-model summary: the worst layer for these, the sum for experts_without_tokens, the mean for the rest
WORST = {"max_load": max, "expert_bias_spread": max, "experts_without_tokens": sum}
# after each layer's load_E and kept_E (2E values), its window holds these sums
SUMS = ("choices", "slots", "entropy", "tokens", "balance_loss", "z_loss", "forwards")
NOT_SUMMING_TO_ONE = ("sigmoid", "sqrt_softplus")      # routers whose scores are not a softmax (router.py)


class RoutingMonitor:
    """Watches every MoELayer of model (names: the modules' qualified names). Only training forwards count;
    a forward re-run by activation checkpointing inside backward is not counted twice. Built after torch.compile
    was called (or imported), its hook runs eagerly under it (a graph break after each MoE layer)."""

    def __init__(self, model: nn.Module):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
        self.windows_L: Dict[str, Optional[torch.Tensor]] = {name: None for name in self.layers}
        # prepend: before hooks that others put on the layer, such as ZeRO-3's release of its gathered parameters
        self.handles = [layer.register_forward_hook(self._hook(name), with_kwargs=True, prepend=True)
                        for name, layer in self.layers.items()]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _hook(self, name: str):
        def hook(layer, args, kwargs, output):
            if layer.training and layer._routing is not None and torch._C._current_graph_task_id() < 0:
                with torch.no_grad():
                    sums = _forward_sums(layer, args, kwargs)
                window = self.windows_L[name]
                self.windows_L[name] = sums if window is None else window + sums.to(window.device)
        # eager under torch.compile (a graph break per layer): the window outlives the step, which a CUDA graph's
        # outputs do not (the next replay overwrites them). Only where the compiler is loaded already: its import
        # costs a second of every process's start (build the monitor after torch.compile)
        return torch.compiler.disable(hook) if "torch._dynamo" in sys.modules else hook

    def read(self, group=None) -> Dict[str, dict]:
        """{layer name: {metric: value, "tokens_per_expert": [...]}} of the window since the last read, summed
        over the processes of group (default: all, when torch.distributed is initialized: every process must
        call it then, with the same layers); {} when no training forward ran in it anywhere. Starts a new window."""
        return {name: metrics_from_sums(sums) for name, sums in self._take(reduce=True, group=group).items()}

    def take_sums(self) -> Dict[str, dict]:
        """This process's window sums per layer as device tensors, nothing read from the device (for hosts that
        sum them over micro-batches and processes themselves and read them when they log, as fairseq's logging
        outputs): "load" and "kept" of E values, the others of one. metrics_from_sums reads them as numbers.
        Layers without a training forward are left out. Starts a new window."""
        taken = {name: _named_sums(self.layers[name], window) for name, window in self.windows_L.items()
                 if window is not None}
        self.windows_L = {name: None for name in self.layers}
        return taken

    def _take(self, reduce: bool, group=None) -> Dict[str, dict]:
        if not self.layers:
            return {}
        sizes = {name: 2 * layer.config.num_experts + len(SUMS) for name, layer in self.layers.items()}
        device = next(iter(self.layers.values())).router.weight_ED.device
        parts = [torch.zeros(sizes[name], dtype=torch.float64, device=device) if w is None else w.to(device)
                 for name, w in self.windows_L.items()]
        sums = torch.cat(parts)
        if reduce and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, group=group)
        self.windows_L = {name: None for name in self.layers}
        values, start, taken = sums.tolist(), 0, {}
        for name, layer in self.layers.items():
            window, start = values[start:start + sizes[name]], start + sizes[name]
            if window[-1] > 0:
                taken[name] = _named_sums(layer, window)
        return taken


def _named_sums(layer: MoELayer, window) -> dict:
    """One layer's window (load_E, kept_E, then SUMS; numbers, or a device tensor left there) by name, the sums its
    configuration leaves out dropped, and the bias's spread now (times the forwards, as a sum) with expert bias
    balancing."""
    cfg, E = layer.config, layer.config.num_experts
    sums = {"load": window[:E], "kept": window[E:2 * E], **dict(zip(SUMS, window[2 * E:]))}
    if cfg.aux_loss == "none":
        del sums["balance_loss"]
    if cfg.z_loss_coef <= 0:
        del sums["z_loss"]
    if layer.router.bias_routes:
        bias_E = layer.router.expert_bias_E
        spread = bias_E.max() - bias_E.min()
        sums["expert_bias_spread"] = spread.to(window) * sums["forwards"] if torch.is_tensor(window) else \
            float(spread.item()) * sums["forwards"]
    return sums


def metrics_from_sums(sums: dict) -> dict:
    """The metrics of one layer's window sums (take_sums' dicts, or their sums over processes)."""
    load, kept = sums["load"], sums["kept"]
    mean = sum(load) / len(load)
    metrics = {
        "max_load": max(load) / mean if mean else 0.0,
        "experts_without_tokens": float(sum(n == 0 for n in load)),
        "dropped_fraction": 1.0 - sum(kept) / sums["choices"] if sums["choices"] else 0.0,
        "capacity_used": sum(kept) / sums["slots"] if sums["slots"] else 0.0,
        "router_entropy": sums["entropy"] / sums["tokens"] if sums["tokens"] else 0.0,
    }
    for key in ("balance_loss", "z_loss", "expert_bias_spread"):      # averaged over the forwards
        if key in sums:
            metrics[key] = sums[key] / sums["forwards"]
    metrics["tokens_per_expert"] = [int(n) for n in load]
    return metrics


def scalars(metrics: Dict[str, dict]) -> Dict[str, float]:
    """read()'s metrics as flat tags: moe/<layer>/<metric> and the summary moe/all/<metric>."""
    flat = {f"moe/{name}/{key}": value for name, layer in metrics.items() for key, value in layer.items()
            if key in METRICS}
    for key in METRICS:
        values = [layer[key] for layer in metrics.values() if key in layer]
        if values:
            flat[f"moe/all/{key}"] = WORST.get(key, _mean)(values)
    return flat


def _mean(values: List[float]) -> float:
    return sum(values) / len(values)


def _forward_sums(layer: MoELayer, args: tuple, kwargs: dict) -> torch.Tensor:
    """This forward's window sums (float64, on the layer's device): load_E, kept_E, then SUMS."""
    cfg, router = layer.config, layer.router
    load_E, kept_E, capacity_factor, fixed, num_tokens, top_k = layer._routing
    x = args[0] if args else kwargs["x"]
    routed = kwargs.get("router_input", args[4] if len(args) > 4 else None)
    routed_TD = (x if routed is None else routed).reshape(-1, cfg.model_dim)
    sequence_T = kwargs.get("sequence_T", args[3] if len(args) > 3 else None)
    logits_TE = router.logits(routed_TD)
    logits_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    # softmax pieces by hand: torch.softmax over a few experts costs ~10x these on CPU
    shifted_TE = logits_TE - logits_TE.amax(-1, keepdim=True)
    exp_TE = shifted_TE.exp()
    sum_T1 = exp_TE.sum(-1, keepdim=True)
    if cfg.router in NOT_SUMMING_TO_ONE:      # normalized, as the router does for its balance loss
        scores_TE = router.scores(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp(min=torch.finfo(scores_TE.dtype).tiny)
        entropy = -(probs_TE * probs_TE.clamp(min=torch.finfo(probs_TE.dtype).tiny).log()).sum()
    else:
        probs_TE = exp_TE / sum_T1
        entropy = -(probs_TE * (shifted_TE - sum_T1.log())).sum()
    balance = z = logits_TE.new_zeros(())
    if cfg.z_loss_coef > 0 and logits_TE.shape[0]:
        z = (logits_TE.amax(-1) + sum_T1.squeeze(-1).log()).square().mean()       # the router's z-loss
    if cfg.aux_loss != "none" and cfg.aux_loss_coef > 0:     # the layer's own: aux_loss_coef * balance + z-loss term
        balance = (layer.aux_loss.detach().to(logits_TE.dtype) - cfg.z_loss_coef * z) / cfg.aux_loss_coef
    elif cfg.aux_loss != "none":
        balance = _noise_free_balance_loss(layer, logits_TE, probs_TE, x, sequence_T)
    largest = load_E.max()
    capacity = torch.full_like(largest, fixed) if capacity_factor > 0 else largest if capacity_factor == 0 else \
        torch.clamp(largest, max=fixed)
    device = load_E.device

    def number(value: float) -> torch.Tensor:      # a fill on the device: no host-to-device copy to wait for
        return torch.full((), float(value), dtype=torch.float64, device=device)

    sums = torch.stack([number(num_tokens * top_k), capacity.double() * cfg.num_experts, entropy.double(),
                        number(num_tokens), balance.double(), z.double(), number(1)])
    return torch.cat([load_E.double(), kept_E.double(), sums])


def _noise_free_balance_loss(layer: MoELayer, logits_TE: torch.Tensor, probs_TE: torch.Tensor, x: torch.Tensor,
                             sequence_T: Optional[torch.Tensor]) -> torch.Tensor:
    """The balance loss of the router's noise-free choice (aux_loss_coef 0: the layer's aux loss does not hold it)."""
    cfg, router = layer.config, layer.router
    scores_TE = router.scores(logits_TE)
    choice_TE = scores_TE + router.expert_bias_E if router.bias_routes else scores_TE
    if cfg.topk_groups < cfg.num_groups:
        choice_TE = best_groups_only(choice_TE, cfg.num_groups, cfg.topk_groups, cfg.group_score)
    expert_TK = torch.topk(choice_TE, cfg.top_k, dim=-1).indices
    if cfg.aux_loss == "load_importance":
        return load_importance_loss(scores_TE, logits_TE.gather(1, expert_TK[:, -1:]), cfg.gate_noise / cfg.num_experts)
    seq_len = x.shape[-2] if x.dim() >= 3 else None
    return balance_loss(cfg.aux_loss, probs_TE, expert_TK, cfg.num_experts, seq_len, sequence_T)
