"""Tutel's MoE layer written out plainly from its documented semantics (loops over tokens, one expert at a time), on
a state dict in Tutel's layout. The drop-in (moe_plugin.tutel) is held to it; it shares no code with it.

Legend: T tokens, D model dim, H expert hidden dim, E experts, K top-k.

    logits: top gate x @ wg^T; cosine_top normalize(x @ P^T + p) @ normalize(sim, over the projection) * exp(min(t,
            log 100))
    noise (training, gate_noise > 0): logits + gate_noise * n / E, n standard normal (given)
    scores: softmax of the noisy logits; each token's K best experts, best first; gate = the score of each
    gates normalized to sum 1 when K > 1 and normalize_gate
    slots: choice by choice (every first choice before any second one), tokens in order, or by descending best score
           with batch-prioritized routing: a choice's slot is how many choices took its expert before it
    capacity: cf > 0: K * int(cf * ceil(T / E)); cf == 0: the largest count of choices of one expert; cf < 0: the
              smaller of those two (with |cf|); then rounded up to a multiple of the alignment. A choice whose slot
              is >= capacity is dropped.
    output: sum over kept choices of gate * expert(x) (is_postscore) or expert(gate * x)
    l_aux: gshard: E / T^2 * sum_e (sum of scores of e) * (tokens whose first choice is e); load_importance: the mean
           of the squared coefficients of variation (var / mean^2) of each expert's summed clean softmax scores and of
           each expert's summed Normal(0, gate_noise / E) CDF of (clean score - the token's K-th noisy logit)
"""
import math

import torch
import torch.nn.functional as F


def tutel_reference(state, x_TD, *, top_k, capacity_factor, gate=0, normalize_gate=True, is_postscore=True,
                    batch_prioritized_routing=False, is_gshard_loss=True, gate_noise=0.0, noise_TE=None,
                    activation=torch.relu, llama=False, alignment=1, expert_fn=None):
    """(y_TD, l_aux, kept): the layer on x_TD with the parameters in state (Tutel's keys); kept[t][k] whether token
    t's k-th choice was kept. llama: SiLU-gated experts (W_fc1..3), `activation` in SiLU's place; expert_fn(state, e,
    x_D): a custom expert (Tutel's "custom" type) in place of either."""
    T, D = x_TD.shape
    logits_TE = _logits(state, gate, x_TD)
    E = logits_TE.shape[1]
    noisy_TE = logits_TE if noise_TE is None else logits_TE + gate_noise * noise_TE / E
    scores_TE = torch.softmax(noisy_TE, dim=1)
    K = min(top_k, E)
    chosen_TK = torch.topk(scores_TE.detach(), K, dim=1).indices.tolist()
    gates = [[scores_TE[t, chosen_TK[t][k]] for k in range(K)] for t in range(T)]
    if K > 1 and normalize_gate:
        gates = [[g / torch.clamp(sum(row), min=torch.finfo(scores_TE.dtype).eps) for g in row] for row in gates]

    best_T = scores_TE.detach().max(dim=1).values.tolist()
    order = sorted(range(T), key=lambda t: -best_T[t]) if batch_prioritized_routing else list(range(T))
    count_E, slot = [0] * E, [[0] * K for _ in range(T)]
    for k in range(K):
        for t in order:
            slot[t][k] = count_E[chosen_TK[t][k]]
            count_E[chosen_TK[t][k]] += 1
    per_expert = math.ceil(T / E)
    if capacity_factor > 0:
        capacity = K * int(capacity_factor * per_expert)
    else:
        capacity = max(count_E)
        if capacity_factor < 0:
            capacity = min(capacity, K * int(-capacity_factor * per_expert))
    capacity = math.ceil(capacity / alignment) * alignment

    kept = [[slot[t][k] < capacity for k in range(K)] for t in range(T)]
    rows = []
    for t in range(T):
        y_D = x_TD.new_zeros(D)
        for k in range(K):
            if kept[t][k]:
                e, g = chosen_TK[t][k], gates[t][k]
                expert = expert_fn or (lambda state, e, x_D: _expert(state, e, x_D, activation, llama))
                y_D = y_D + (g * expert(state, e, x_TD[t]) if is_postscore else expert(state, e, g * x_TD[t]))
        rows.append(y_D)
    y_TD = torch.stack(rows)

    if is_gshard_loss:
        first_E = torch.zeros(E, dtype=scores_TE.dtype)
        for t in range(T):
            first_E[chosen_TK[t][0]] += 1
        l_aux = E / T / T * (scores_TE.sum(0) * first_E).sum()
    else:
        clean_TE = torch.softmax(logits_TE, dim=1).float()
        threshold_T = torch.stack([noisy_TE[t, chosen_TK[t][K - 1]] for t in range(T)]).float()
        std = gate_noise / E
        cdf_TE = 0.5 * (1 + torch.erf((clean_TE - threshold_T[:, None]) / (std * math.sqrt(2))))
        l_aux = (_cv2(clean_TE.sum(0)) + _cv2(cdf_TE.sum(0))) / 2
    return y_TD, l_aux, kept


def _cv2(v_E):
    return v_E.var() / (v_E.mean() ** 2 + 1e-10)


def _logits(state, gate, x_TD):
    prefix = f"gates.{gate}."
    if prefix + "wg.weight" in state:
        return x_TD @ state[prefix + "wg.weight"].t()
    projected = x_TD @ state[prefix + "cosine_projector.weight"].t() + state[prefix + "cosine_projector.bias"]
    unit_x = F.normalize(projected, dim=1)
    unit_sim = F.normalize(state[prefix + "sim_matrix"], dim=0)
    return unit_x @ unit_sim * torch.exp(torch.clamp(state[prefix + "temperature"], max=math.log(100.0)))


def _expert(state, e, x_D, activation, llama):
    if llama:
        E = int(state["_num_global_experts"])      # one process: every expert is here
        D = x_D.shape[0]
        H = state["experts.W_fc1"].numel() // (E * D)
        fc1, fc2 = (state[key].reshape(E, D, H)[e] for key in ("experts.W_fc1", "experts.W_fc2"))
        fc3 = state["experts.W_fc3"].reshape(E, H, D)[e]
        return (activation(x_D @ fc1) * (x_D @ fc2)) @ fc3
    h_H = state["experts.batched_fc1_w"][e] @ x_D
    if "experts.batched_fc1_bias" in state:
        h_H = h_H + state["experts.batched_fc1_bias"][e]
    y_D = activation(h_H) @ state["experts.batched_fc2_w"][e]
    if "experts.batched_fc2_bias" in state:
        y_D = y_D + state["experts.batched_fc2_bias"][e]
    return y_D
