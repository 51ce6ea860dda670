"""Routing metrics recomputed independently of moe_plugin/routing_monitor/metrics.py: from a layer's own router (its choices,
probabilities and losses) with capacity and drops counted by a plain loop over the choices (choice-major slots)."""
import math

import pytest
import torch


def reference(layer, x_TD: torch.Tensor, seq_len=None) -> dict:
    """One forward's sums (the router's weights as they are now)."""
    cfg = layer.config
    with torch.no_grad():
        training = layer.router.training
        routes = layer.router.eval()(x_TD.detach(), seq_len)   # eval: the choices are not counted into the bias's load
        layer.router.train(training)
    T, E, K = x_TD.shape[0], cfg.num_experts, cfg.top_k
    load = [0] * E
    for e in routes.expert_TK.reshape(-1).tolist():
        load[e] += 1
    capacity = max(math.ceil(K * cfg.capacity_factor * T / E), cfg.min_capacity) if cfg.capacity_factor else max(load)
    used, kept = [0] * E, [0] * E
    for k in range(K):
        for t in range(T):
            e = int(routes.expert_TK[t, k])
            if used[e] < capacity:
                kept[e] += 1
            used[e] += 1
    probs = routes.scores_TE.double() / routes.scores_TE.double().sum(-1, keepdim=True)
    entropy = float(-(probs * probs.log()).sum())
    return {"load": load, "kept": kept, "choices": T * K, "slots": capacity * E, "entropy": entropy, "tokens": T,
            "balance": float(routes.aux_loss), "z": float(routes.z_loss), "forwards": 1}


def add(total: dict, one: dict) -> dict:
    if not total:
        return dict(one)
    return {k: [a + b for a, b in zip(v, one[k])] if isinstance(v, list) else v + one[k] for k, v in total.items()}


def expected(layer, sums: dict) -> dict:
    """The metrics of a window's sums, as the issue defines them."""
    E = layer.config.num_experts
    mean = sum(sums["load"]) / E
    out = {"max_load": max(sums["load"]) / mean, "max_rank_load": rank_load(sums["load"], layer.config.ep_size),
           "experts_without_tokens": sum(n == 0 for n in sums["load"]),
           "dropped_fraction": 1 - sum(sums["kept"]) / sums["choices"],
           "capacity_used": sum(sums["kept"]) / sums["slots"], "router_entropy": sums["entropy"] / sums["tokens"],
           "tokens_per_expert": sums["load"]}
    if layer.config.aux_loss != "none":
        out["balance_loss"] = sums["balance"] / sums["forwards"]
    if layer.config.z_loss_coef > 0:
        out["z_loss"] = sums["z"] / sums["forwards"]
    if layer.config.expert_bias_update_rate > 0:
        bias = layer.router.expert_bias_E
        out["expert_bias_spread"] = float(bias.max() - bias.min())
    return out


def rank_load(load: list, ep_size: int) -> float:
    """The busiest ep rank's routed rows over the mean rank's, counted by hand: rank w holds experts
    w * E / W ... (w + 1) * E / W - 1, or (E < W) a 1 / (W / E) slice of expert w // (W / E), all its rows."""
    E, W = len(load), ep_size
    rows = [sum(load[w * E // W:(w + 1) * E // W]) for w in range(W)] if E >= W else \
        [load[w // (W // E)] / (W // E) for w in range(W)]
    mean = sum(rows) / W
    return max(rows) / mean if mean else 1.0


def check(metrics: dict, want: dict, rel: float = 1e-5) -> None:
    """metrics (RoutingMonitor.read()) equal want, layer by layer and metric by metric."""
    assert metrics.keys() == want.keys()
    for name in want:
        assert metrics[name].keys() == want[name].keys(), name
        for key, value in want[name].items():
            assert metrics[name][key] == pytest.approx(value, rel=rel, abs=1e-9), (name, key)


def record_forwards(model, forwards: dict, training_only: bool = True) -> dict:
    """Pre-hooks on every MoELayer of model appending each forward's reference sums (the router's weights as the
    forward runs) to forwards[layer name]; returns {name: layer}."""
    from moe_plugin import MoELayer

    def hook(name):
        def record(layer, args, kwargs):
            if layer.training or not training_only:
                x = args[0] if args else kwargs["x"]
                seq_len = x.shape[-2] if x.dim() >= 3 else None
                forwards.setdefault(name, []).append(reference(layer, x.reshape(-1, layer.config.model_dim), seq_len))
        return record
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    for name, layer in layers.items():
        layer.register_forward_pre_hook(hook(name), with_kwargs=True)
    return layers


def window_expected(layers: dict, forwards: dict, window: int, per_window: int) -> dict:
    """expected() of each layer over the forwards of one logging window (tokens_per_expert left out)."""
    want = {}
    for name, layer in layers.items():
        sums = {}
        for one in forwards[name][window * per_window:(window + 1) * per_window]:
            sums = add(sums, one)
        want[name] = expected(layer, sums)
        want[name].pop("tokens_per_expert")
    return want


def coselection(expert_TK: torch.Tensor, num_experts: int) -> tuple:
    """(load, both) of top-k choices expert_TK, counted by a plain loop over each token's choices: load[e] the
    tokens choosing e, both[e][f] the tokens choosing both e and f (both[e][e] = load[e])."""
    load, both = [0] * num_experts, [[0] * num_experts for _ in range(num_experts)]
    for chosen in expert_TK.tolist():
        for e in set(chosen):
            load[e] += 1
            for f in set(chosen):
                both[e][f] += 1
    return load, both


def layer_choices(model, inputs) -> dict:
    """{layer name: [expert_TK of each input]}: each MoELayer's top-k choices (its router in eval mode, no noise, on
    the input the layer routes on) while model(input) runs (no grad) for each of inputs."""
    from moe_plugin import MoELayer
    choices, handles = {}, []

    def hook(name):
        def record(layer, args, kwargs):
            x = args[0] if args else kwargs["x"]
            routed = x if kwargs.get("router_input") is None else kwargs["router_input"]    # what the router reads
            training = layer.router.training
            choices.setdefault(name, []).append(
                layer.router.eval()(routed.reshape(-1, layer.config.model_dim)).expert_TK)
            layer.router.train(training)
        return record
    for name, layer in model.named_modules():
        if isinstance(layer, MoELayer):
            handles.append(layer.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        with torch.no_grad():
            for x in inputs:
                model(x)
    finally:
        for handle in handles:
            handle.remove()
    return choices
