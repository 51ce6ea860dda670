"""The plain GShard-style MoE: dense one-hot dispatch and combine with einsum.

The oracle the fast layer is tested against, and the einsum baseline of `moe-plugin bench`. It reads
an MoELayer's parameters and config but shares none of its routing code. Its cost grows with
tokens x experts x capacity.

Covers the DeepSeek-V3 features too: the balancing bias (router.expert_bias_E, added to the scores
only to choose), group-limited choice, route_scale, the (gated) shared expert and the sequence-wise
aux loss; and the router bias, sqrt(softplus) scores, groups scored by their best expert, gating on the
expert input and the activations with their clamp limits, each written out from its formula.

Legend: T tokens, D model dim, H hidden, E experts, K top-k, C capacity per expert, G expert groups,
M experts per group, S tokens per sequence.
"""
from __future__ import annotations

import contextlib
import math
from typing import Tuple

import torch
import torch.nn.functional as F


def reference_moe(layer, x: torch.Tensor, router_input=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (y shaped like x, weighted aux loss), computed with one-hot masks and einsum; router_input (x's
    shape, optional) is what the router sees instead of x."""
    cfg, router, experts = layer.config, layer.router, layer.experts
    if layer.training and cfg.gate_noise > 0:
        raise ValueError("reference_moe has no gate noise: use gate_noise=0 or eval mode")
    E, K = cfg.num_experts, cfg.top_k
    x_TD = x.reshape(-1, cfg.model_dim)
    T = x_TD.shape[0]

    w_ED = router.weight_ED
    r_TD = x_TD if router_input is None else router_input.reshape(-1, cfg.model_dim)
    if cfg.router_norm:    # RMS norm in fp32 without weight, then the learned scale and D ** -0.5
        r32_TD = r_TD.to(torch.float32) if r_TD.dtype != torch.float64 else r_TD
        rms_T1 = torch.sqrt((r32_TD * r32_TD).sum(1, keepdim=True) / cfg.model_dim + cfg.router_norm_eps)
        r_TD = (r32_TD / rms_T1).to(r_TD.dtype) * router.input_scale_D / math.sqrt(cfg.model_dim)
    router_dtype = torch.promote_types(x.dtype, torch.float32) if cfg.fp32_router else x.dtype
    xr_TD, wr_ED = r_TD.to(router_dtype), w_ED.to(router_dtype)
    fp32_logits = cfg.fp32_router and torch.amp.is_autocast_available(x.device.type)
    with torch.autocast(x.device.type, enabled=False) if fp32_logits else contextlib.nullcontext():
        if cfg.router == "cosine":
            if cfg.router_proj_dim:
                xr_TD = xr_TD @ router.projector.weight.to(router_dtype).t() + router.projector.bias.to(router_dtype)
            scale = torch.exp(torch.clamp(router.log_scale, max=math.log(100.0))).to(xr_TD.dtype)
            unit_x = xr_TD / xr_TD.norm(dim=1, keepdim=True).clamp(min=1e-12)
            unit_w = wr_ED / wr_ED.norm(dim=1, keepdim=True).clamp(min=1e-12)
            logits_TE = torch.einsum("td,ed->te", unit_x, unit_w) * scale
        else:
            logits_TE = torch.einsum("td,ed->te", xr_TD, wr_ED)
        if cfg.router_bias:
            logits_TE = logits_TE + router.bias_E.to(logits_TE.dtype)
    if cfg.router in ("sigmoid", "sqrt_softplus"):
        scores_TE = torch.sigmoid(logits_TE) if cfg.router == "sigmoid" \
            else torch.sqrt(torch.log1p(torch.exp(logits_TE)))
        probs_TE = scores_TE / scores_TE.sum(1, keepdim=True)
    else:
        scores_TE = probs_TE = torch.softmax(logits_TE, dim=1)

    choice_TE = scores_TE.detach() + router.expert_bias_E
    if cfg.num_groups > 1:
        choice_TE = _inside_best_groups(choice_TE, cfg.num_groups, cfg.topk_groups, cfg.group_score)
    expert_TK = torch.topk(choice_TE, K, dim=1).indices
    masks = [F.one_hot(expert_TK[:, k], E).to(scores_TE.dtype) for k in range(K)]    # K x [T, E]
    gates = [(scores_TE * m).sum(1) for m in masks]                                  # K x [T]
    if cfg.normalize_gate == "before_drop":
        total = sum(gates)
        gates = [g / total for g in gates]
    if cfg.expert_gate_scale:
        gates = [g * (router.gate_scale_E * m).sum(1) for g, m in zip(gates, masks)]

    # slot = number of earlier choices for the same expert: choice-major, then token (or priority) order
    if cfg.batch_prioritized_routing:
        order_T = torch.sort(scores_TE.detach().max(1).values, descending=True, stable=True).indices
    else:
        order_T = torch.arange(T, device=x.device)
    inverse_T = torch.argsort(order_T)
    locations, before_E = [], torch.zeros(E, dtype=scores_TE.dtype, device=x.device)
    for m in masks:
        m_sorted = m[order_T]
        locations.append(((torch.cumsum(m_sorted, 0) - 1 + before_E) * m_sorted)[inverse_T])
        before_E = before_E + m.sum(0)
    load_E = before_E
    capacity = _capacity(layer, load_E, T)

    keeps = [m * (loc < capacity).to(m.dtype) for m, loc in zip(masks, locations)]   # K x [T, E]
    kept_gates = [g * k.sum(1) for g, k in zip(gates, keeps)]
    if cfg.normalize_gate == "after_drop":
        total = torch.clamp(sum(kept_gates), min=torch.finfo(scores_TE.dtype).eps)
        kept_gates = [g / total for g in kept_gates]
    kept_gates = [g * cfg.route_scale for g in kept_gates]

    dispatch_TEC = torch.zeros(T, E, capacity, dtype=x.dtype, device=x.device)
    combine_TEC = torch.zeros(T, E, capacity, dtype=scores_TE.dtype, device=x.device)
    for keep, loc, g in zip(keeps, locations, kept_gates):
        slot_TC = F.one_hot((loc * keep).sum(1).long(), max(capacity, 1))[:, :capacity].to(scores_TE.dtype)
        place_TEC = keep[:, :, None] * slot_TC[:, None, :]
        if cfg.gate_on_input:     # the gate scales what the expert receives; its output is added unweighted
            dispatch_TEC = dispatch_TEC + (g[:, None, None] * place_TEC).to(x.dtype)
            combine_TEC = combine_TEC + place_TEC
        else:
            dispatch_TEC = dispatch_TEC + place_TEC.to(x.dtype)
            combine_TEC = combine_TEC + g[:, None, None] * place_TEC

    x_ECD = torch.einsum("tec,td->ecd", dispatch_TEC, x_TD)
    y_ECD = _modules(experts, x_ECD) if hasattr(experts, "local") else _mlp(experts, cfg, x_ECD)
    y_TD = torch.einsum("tec,ecd->td", combine_TEC.to(x.dtype), y_ECD)
    if layer.shared_expert is not None:
        shared_limit = cfg.activation_limit if cfg.clamp_shared else None
        y_TD = y_TD + _shared(layer.shared_expert, cfg, shared_limit, x_TD)

    seq_len = x.shape[-2] if x.dim() >= 3 else T
    aux = _balance(cfg.aux_loss, probs_TE, masks, E, seq_len) if T else probs_TE.new_zeros(())
    z = torch.logsumexp(logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)), 1).pow(2).mean() if (T and cfg.z_loss_coef > 0) else 0.0
    return y_TD.reshape(x.shape), cfg.aux_loss_coef * aux + cfg.z_loss_coef * z


def _modules(experts, x_ECD):
    """Any expert module (module_experts.py): expert e's own module on its C slots."""
    return torch.stack([expert(x_CD) for expert, x_CD in zip(experts.local, x_ECD)])


def _act(h, cfg, limit):
    """The activation from its formula; a gated one splits the last dim into [gate | up]."""
    name = cfg.activation
    if name not in ("swiglu", "geglu", "geglu_tanh", "swiglu_oai"):
        plain = {"relu": torch.relu, "silu": lambda v: v * torch.sigmoid(v), "identity": lambda v: v,
                 "gelu": lambda v: 0.5 * v * (1 + torch.erf(v / math.sqrt(2))),
                 "relu2": lambda v: torch.relu(v) ** 2}
        return plain[name](h)
    half = h.shape[-1] // 2
    gate, up = h[..., :half], h[..., half:]
    if name == "geglu":
        return 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2))) * up
    if name == "geglu_tanh":
        return 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
    if limit is not None:
        gate = torch.minimum(gate, torch.full_like(gate, limit))
        up = torch.maximum(torch.minimum(up, torch.full_like(up, limit)), torch.full_like(up, -limit))
    if name == "swiglu":
        return gate * torch.sigmoid(gate) * up
    return (up + 1) * gate * torch.sigmoid(cfg.activation_alpha * gate)


def _mlp(experts, cfg, x_ECD):
    lora = getattr(experts, "lora", None)          # LoRA factors (moe_plugin/lora.py; Q its rank), unless merged
    lora = None if lora is None or lora.merged else lora
    h_ECH = torch.einsum("ecd,edh->ech", x_ECD, experts.w1_EDH)
    if lora is not None and lora.up_a_EDQ is not None:
        h_ECH = h_ECH + lora.scale * torch.einsum("ecd,edq,eqh->ech", x_ECD, lora.up_a_EDQ, lora.up_b_EQF)
    if experts.b1_EH is not None:
        h_ECH = h_ECH + experts.b1_EH[:, None, :]
    h_ECH = _act(h_ECH, cfg, cfg.activation_limit)
    y_ECD = torch.einsum("ech,ehd->ecd", h_ECH, experts.w2_EHD)
    if lora is not None and lora.down_a_EHQ is not None:
        y_ECD = y_ECD + lora.scale * torch.einsum("ech,ehq,eqd->ecd", h_ECH, lora.down_a_EHQ, lora.down_b_EQD)
    if experts.b2_ED is not None:
        y_ECD = y_ECD + experts.b2_ED[:, None, :]
    return y_ECD


def _capacity(layer, load_E: torch.Tensor, T: int) -> int:
    cfg = layer.config
    cf = cfg.eval_capacity_factor if (not layer.training and cfg.eval_capacity_factor is not None) \
        else cfg.capacity_factor
    largest = int(load_E.max().item()) if T else 0
    fixed = max(math.ceil(cfg.top_k * abs(cf) * T / cfg.num_experts), cfg.min_capacity)
    if cfg.capacity_formula == "tutel":    # k slots per int(cf * ceil(T / E)), then up to a multiple of the alignment
        fixed = max(cfg.top_k * int(abs(cf) * math.ceil(T / cfg.num_experts)), cfg.min_capacity)
        fixed = math.ceil(fixed / cfg.capacity_alignment) * cfg.capacity_alignment
    if cf > 0:
        return fixed
    if cf == 0:
        return largest
    return min(largest, fixed)


def _inside_best_groups(choice_TE, G, topk_groups, group_score):
    """Keep the experts of the topk_groups groups whose two best choice scores sum highest (group_score
    "max": whose best score is highest); -inf elsewhere."""
    M = choice_TE.shape[1] // G
    group_scores = []
    for g in range(G):
        ranked = torch.sort(choice_TE[:, g * M:(g + 1) * M], dim=1, descending=True).values
        group_scores.append(ranked[:, 0] if group_score == "max" else ranked[:, :min(2, M)].sum(1))
    best_groups = torch.argsort(torch.stack(group_scores, 1), dim=1, descending=True, stable=True)[:, :topk_groups]
    allowed_TE = torch.zeros_like(choice_TE, dtype=torch.bool)
    for g in range(G):
        chosen_T = (best_groups == g).any(1)
        allowed_TE[:, g * M:(g + 1) * M] = chosen_T[:, None]
    return torch.where(allowed_TE, choice_TE, torch.full_like(choice_TE, -math.inf))


def _shared(shared, cfg, limit, x_TD):
    h = torch.einsum("td,dh->th", x_TD, shared.w1_DH)
    if shared.b1_H is not None:
        h = h + shared.b1_H
    h = _act(h, cfg, limit)
    y = torch.einsum("th,hd->td", h, shared.w2_HD)
    if shared.b2_D is not None:
        y = y + shared.b2_D
    if shared.gate_D is not None:
        y = y * torch.sigmoid(torch.einsum("td,d->t", x_TD, shared.gate_D))[:, None]
    return y


def _balance(kind, probs_TE, masks, E, seq_len):
    if kind == "none":
        return probs_TE.new_zeros(())
    if kind == "seq":   # switch within each sequence, averaged over the sequences
        sequences = range(0, probs_TE.shape[0], seq_len)
        losses = [_balance("switch", probs_TE[s:s + seq_len], [m[s:s + seq_len] for m in masks], E, seq_len)
                  for s in sequences]
        return sum(losses) / len(losses)
    counted = masks[:1] if kind == "gshard" else masks
    fraction_E = sum(m.mean(0) for m in counted) / len(counted)
    return E * (probs_TE.mean(0) * fraction_E).sum()
