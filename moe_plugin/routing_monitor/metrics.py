"""Routing metrics per MoE layer and logging window (issue 44): RoutingMonitor(model) hooks every MoELayer;
each training forward adds its routing in place into a device tensor (no host synchronization) and what the host
knows (token counts) into numbers; read() sums the window over the processes (one all_reduce, one device read)
and returns per-layer metrics; scalars() names them moe/<layer>/<metric> with a whole-model summary under
moe/all/<metric>.

Per layer and window (sums over every training forward of the window, every micro-batch, every process):
    max_load                 the busiest expert's tokens over the mean (1.0 balanced; E when one expert takes all)
    max_rank_load            the busiest expert-parallel rank's routed rows over the mean rank's (1.0 balanced and
                             at ep_size 1; ep_size when one rank takes all): each expert's routed choices (before
                             capacity drops) go to the ranks that compute it by rank_shares (an expert sliced over
                             ranks gives each its share); with replicas (redundant_experts) the kept rows of a
                             replicated expert count where they were computed, its copies' ranks included, and a
                             forward that gathers every expert (parallel degree 0) counts its kept rows on the rank
                             that routed them; per rank position of the ep group, summed over the ep groups
    experts_without_tokens   how many experts got no token
    dropped_fraction         routed choices dropped by capacity, over all choices
    capacity_used            kept choices over the capacity's slots
    router_entropy           mean entropy of the router's distribution per token (nats; log(E) at most)
    balance_loss, z_loss     unweighted, as configured (aux_loss not "none"; z_loss_coef > 0), averaged over forwards
    expert_bias_spread       with expert bias balancing: max - min of the bias when read (take_sums: when taken,
                             so a host summing those gets the mean over its takes)

Entropy and z-loss are recomputed from the router's input in the hook (one [T, E] router product, no noise drawn);
the balance loss is the layer's own (its aux loss less the z-loss term, over aux_loss_coef), recomputed from the
router's noise-free choice only where aux_loss_coef is 0. Shape legend: moe_plugin/__init__.py.
"""
from __future__ import annotations

import functools
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..layer import MoELayer
from ..parallel.groups import ExpertLayout
from ..router import balance_loss, best_groups_only, load_importance_loss

METRICS = ("max_load", "max_rank_load", "experts_without_tokens", "dropped_fraction", "capacity_used", "router_entropy",
           "balance_loss", "z_loss", "expert_bias_spread")
# the whole-model summary: the worst layer for these, the sum for experts_without_tokens, the mean for the rest
WORST = {"max_load": max, "max_rank_load": max, "expert_bias_spread": max, "experts_without_tokens": sum}
# a layer's window: on the device its load_E and kept_E (2E values) then DEVICE_SUMS; on the host HOST_SUMS
DEVICE_SUMS = ("slots", "entropy", "balance_loss", "z_loss")
HOST_SUMS = ("choices", "slots", "tokens", "forwards")      # slots: those of a fixed capacity
VECTOR_SUMS = ("load", "kept", "rank_rows")    # the sums of several values (E, E, ep_size): summed item by item
NOT_SUMMING_TO_ONE = ("sigmoid", "sqrt_softplus")      # routers whose scores are not a softmax (router.py)


class RoutingMonitor:
    """Watches every MoELayer of model (names: the modules' qualified names). Only training forwards count;
    a forward re-run by activation checkpointing inside backward is not counted twice. Built after torch.compile
    was called (or imported), its hook runs eagerly under it (a graph break after each MoE layer)."""

    def __init__(self, model: nn.Module):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
        self.windows = {name: None for name in self.layers}      # name: _Window, None before a forward
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
                window = self.windows[name]
                if window is None or window.device_sums.device != layer._routing[0].device:
                    window = self.windows[name] = _Window(layer.config.num_experts, layer._routing[0].device,
                                                          window, layer.config.ep_size)
                with torch.no_grad():
                    _add_forward(window, layer, args, kwargs)
        # eager under torch.compile (a graph break per layer): the window outlives the step, which a CUDA graph's
        # outputs do not (the next replay overwrites them). Only where the compiler is loaded already: its import
        # costs a second of every process's start (build the monitor after torch.compile)
        return torch.compiler.disable(hook) if "torch._dynamo" in sys.modules else hook

    def read(self, group=None) -> Dict[str, dict]:
        """{layer name: {metric: value, "tokens_per_expert": [...]}} of the window since the last read, summed
        over the processes of group (default: all, when torch.distributed is initialized: every process must
        call it then, with the same layers); {} when no training forward ran in it anywhere. Starts a new window."""
        if not self.layers:
            return {}
        device = next(iter(self.layers.values())).router.weight_ED.device
        parts, sizes = [], []
        for name, layer in self.layers.items():
            window = self.windows[name] or _Window(layer.config.num_experts, device, ep_size=layer.config.ep_size)
            host = torch.tensor([window.host[key] for key in HOST_SUMS], dtype=torch.float64)
            parts += [window.device_sums.to(device), host.to(device)]
            sizes.append(parts[-2].numel() + len(HOST_SUMS))
        sums = torch.cat(parts)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, group=group)
        self.windows = {name: None for name in self.layers}
        values, start, read = sums.tolist(), 0, {}
        for (name, layer), size in zip(self.layers.items(), sizes):
            window, start = values[start:start + size], start + size
            host = dict(zip(HOST_SUMS, window[-len(HOST_SUMS):]))
            if host["forwards"] > 0:
                read[name] = metrics_from_sums(_named_sums(layer, window[:-len(HOST_SUMS)], host))
        return read

    def take_sums(self) -> Dict[str, dict]:
        """This process's window sums per layer, nothing read from the device (for hosts that sum them over
        micro-batches and processes themselves and read them when they log, as fairseq's logging outputs): device
        tensors ("load" and "kept" of E values, the others of one) and numbers. metrics_from_sums reads them as
        numbers. Layers without a training forward are left out. Starts a new window."""
        taken = {name: _named_sums(self.layers[name], window.device_sums, window.host)
                 for name, window in self.windows.items() if window is not None}
        self.windows = {name: None for name in self.layers}
        return taken


class _Window:
    """One layer's sums since the last read: device_sums (load_E, kept_E, DEVICE_SUMS, moved_W; float64) with a
    view on each part made once, and host, HOST_SUMS as numbers. moved_W: the kept rows each ep rank computes
    beyond what its own experts' would be (with replicas, negative on the owners of replicated experts; at parallel
    degree 0, each rank's own rows less its experts'). A window moved to
    another device is carried over."""

    def __init__(self, num_experts: int, device: torch.device, old: Optional["_Window"] = None, ep_size: int = 1):
        E = num_experts
        self.device_sums = torch.zeros(2 * E + len(DEVICE_SUMS) + ep_size, dtype=torch.float64, device=device)
        self.host = dict.fromkeys(HOST_SUMS, 0.0)
        if old is not None:
            self.device_sums += old.device_sums.to(device)
            self.host = dict(old.host)
        self.load_E, self.kept_E = self.device_sums[:E], self.device_sums[E:2 * E]
        # slices of one value, not unbind()'s: torch.compile (a monitor compiled with the model) loses in-place adds
        # to those after the first call
        self.slots, self.entropy, self.balance_loss, self.z_loss = (self.device_sums[i:i + 1]
                                                                    for i in range(2 * E, 2 * E + len(DEVICE_SUMS)))
        self.moved_W = self.device_sums[2 * E + len(DEVICE_SUMS):]


def _named_sums(layer: MoELayer, device_sums, host: dict) -> dict:
    """One layer's window (device_sums: numbers, or a device tensor left there) by name, the sums its
    configuration leaves out dropped, and the bias's spread now (times the forwards, as a sum) with expert bias
    balancing."""
    cfg, E = layer.config, layer.config.num_experts
    device = dict(zip(DEVICE_SUMS, device_sums[2 * E:]))
    load = device_sums[:E]
    layout = layer.groups.layout
    shares_EW = _shares(E, layout.ep_size, load.device if torch.is_tensor(load) else torch.device("cpu"))
    rows = rank_rows(load, shares_EW)
    moved = device_sums[2 * E + len(DEVICE_SUMS):]      # rows computed elsewhere than by their expert's owner
    rows = rows + moved if torch.is_tensor(rows) else [a + b for a, b in zip(rows, moved)]
    sums = {"load": load, "kept": device_sums[E:2 * E], "rank_rows": rows,
            "choices": host["choices"],
            "slots": device["slots"] + host["slots"], "entropy": device["entropy"], "tokens": host["tokens"],
            "balance_loss": device["balance_loss"], "z_loss": device["z_loss"], "forwards": host["forwards"]}
    if cfg.aux_loss == "none":
        del sums["balance_loss"]
    if cfg.z_loss_coef <= 0:
        del sums["z_loss"]
    if layer.router.bias_routes:
        bias_E = layer.router.expert_bias_E
        spread = bias_E.max() - bias_E.min()
        sums["expert_bias_spread"] = spread.to(device_sums) * host["forwards"] if torch.is_tensor(device_sums) \
            else float(spread.item()) * host["forwards"]
    return sums


def metrics_from_sums(sums: dict) -> dict:
    """The metrics of one layer's window sums (take_sums' dicts, or their sums over processes)."""
    load, kept = sums["load"], sums["kept"]
    mean = sum(load) / len(load)
    metrics = {
        "max_load": max(load) / mean if mean else 0.0,
        "max_rank_load": max_rank_load(sums["rank_rows"]),
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


def rank_shares(layout: ExpertLayout) -> torch.Tensor:
    """[E, W] float64: the share of expert e's routed rows that ep rank w computes (each row sums to 1). A whole
    expert is its one holder's; an expert sliced over `slices` ranks (E < W) gives each holder 1 / slices (each
    computes its hidden slice of all the expert's rows). A plan that splits an expert's rows among copies on other
    ranks is one more such matrix."""
    return _shares(layout.num_experts, layout.ep_size, torch.device("cpu"))


@functools.lru_cache(maxsize=64)
def _shares(E: int, W: int, device: torch.device) -> torch.Tensor:
    """rank_shares' matrix, made once per device (a device's copy is no host-to-device copy per forward)."""
    if device.type != "cpu":
        return _shares(E, W, torch.device("cpu")).to(device)
    shares_EW = torch.zeros(E, W, dtype=torch.float64)
    if E >= W:
        shares_EW[torch.arange(E), torch.arange(E) // (E // W)] = 1.0
    else:
        slices = W // E
        for e in range(E):
            shares_EW[e, e * slices:(e + 1) * slices] = 1.0 / slices
    return shares_EW


def rank_rows(load, shares_EW: torch.Tensor):
    """The routed rows each ep rank computes ([W]) of a load per expert ([E]): a device tensor (stays there, no
    host read) or numbers (a list back)."""
    if torch.is_tensor(load):
        return load.to(torch.float64) @ shares_EW.to(load.device)     # no copy where shares_EW is there
    return (torch.tensor(load, dtype=torch.float64) @ shares_EW).tolist()


def max_rank_load(rows) -> float:
    """The busiest rank's rows over the mean rank's: 1.0 when every rank has as many (no row at all included)."""
    mean = sum(rows) / len(rows)
    return max(rows) / mean if mean else 1.0


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


def _rows_computed(layer: MoELayer, kept_E: torch.Tensor) -> Optional[torch.Tensor]:
    """[W] float64: the kept rows each ep rank computed in the last forward where that is not by owner: with
    replicas, as split; with every expert gathered (parallel degree 0), all on the rank that routed them. None
    otherwise."""
    split_rows = layer._parallel_stats.get("rank_rows")
    if split_rows is not None:
        return torch.tensor(split_rows, dtype=torch.float64).to(kept_E.device)
    if layer._parallel_stats.get("parallel") == 0:
        here = layer.groups.layout.ep_rank
        computed_W = torch.zeros(layer.config.ep_size, dtype=torch.float64, device=kept_E.device)
        computed_W[here:here + 1] = kept_E.sum()
        return computed_W
    return None


def _add_forward(window: _Window, layer: MoELayer, args: tuple, kwargs: dict) -> None:
    """Adds this forward's routing to the window: on the device in place (no host synchronization, few ops),
    what the host knows to its numbers."""
    cfg, router = layer.config, layer.router
    load_E, kept_E, capacity_factor, fixed, num_tokens, top_k = layer._routing
    window.load_E += load_E
    window.kept_E += kept_E
    computed_W = _rows_computed(layer, kept_E)
    if computed_W is not None:      # this forward's kept rows per rank where computed, less as owned
        window.moved_W.add_(computed_W - kept_E.to(torch.float64) @ _shares(cfg.num_experts, cfg.ep_size,
                                                                            kept_E.device))
    if capacity_factor > 0:
        window.host["slots"] += fixed * cfg.num_experts
    elif capacity_factor == 0:
        window.slots.add_(load_E.max(), alpha=cfg.num_experts)
    else:
        window.slots.add_(load_E.max().clamp(max=fixed), alpha=cfg.num_experts)
    window.host["choices"] += num_tokens * top_k
    window.host["tokens"] += num_tokens
    window.host["forwards"] += 1

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
        window.entropy.sub_((probs_TE * probs_TE.clamp(min=torch.finfo(probs_TE.dtype).tiny).log()).sum())
    else:
        probs_TE = exp_TE / sum_T1
        window.entropy.sub_((probs_TE * (shifted_TE - sum_T1.log())).sum())
    z = logits_TE.new_zeros(())
    if cfg.z_loss_coef > 0 and num_tokens:
        z = (logits_TE.amax(-1) + sum_T1.squeeze(-1).log()).square().mean()       # the router's z-loss
        window.z_loss.add_(z)
    if cfg.aux_loss != "none" and cfg.aux_loss_coef > 0:     # the layer's own: aux_loss_coef * balance + z-loss term
        window.balance_loss.add_((layer.aux_loss.detach().to(logits_TE.dtype) - cfg.z_loss_coef * z) /
                                 cfg.aux_loss_coef)
    elif cfg.aux_loss != "none":
        window.balance_loss.add_(_noise_free_balance_loss(layer, logits_TE, probs_TE, x, sequence_T))


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
