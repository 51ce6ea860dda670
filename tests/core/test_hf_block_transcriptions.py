"""The layer against the MoE blocks of the Hugging Face models it must reproduce, transcribed by hand
from transformers 5.23.0 (modeling_deepseek_v3.py: DeepseekV3TopkRouter, DeepseekV3MoE;
modeling_qwen2_moe.py / modeling_qwen3_moe.py / modeling_olmoe.py / modeling_mixtral.py: the TopKRouter
and SparseMoeBlock), so this runs without transformers. The weights are in HF's layout: experts'
gate_up_proj [E, 2H, D] = [gate | up], down_proj [E, D, H]; MLPs as [out, in] matrices."""
import pytest
import torch
import torch.nn.functional as F

from moe_plugin import MoEConfig, MoELayer


def hf_experts(x_TD, index_TK, weight_TK, gate_up_EHD, down_EDH):
    """DeepseekV3Experts / MixtralExperts eager: per expert, silu(gate) * up, down, times the weight."""
    out_TD = torch.zeros_like(x_TD)
    for e in range(gate_up_EHD.shape[0]):
        token, slot = torch.where(index_TK == e)
        gate, up = F.linear(x_TD[token], gate_up_EHD[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_EDH[e]) * weight_TK[token, slot, None]
        out_TD.index_add_(0, token, y)
    return out_TD


def hf_mlp(x_TD, gate_proj, up_proj, down_proj):
    return F.linear(F.silu(F.linear(x_TD, gate_proj)) * F.linear(x_TD, up_proj), down_proj)


def deepseek_v3_moe(x, w, hf):
    x_TD = x.view(-1, x.shape[-1])
    E, G = hf["weight"].shape[0], hf["n_group"]
    scores = F.linear(x_TD.float() if x.dtype != torch.float64 else x_TD, hf["weight"]).sigmoid()
    scores_for_choice = scores + hf["e_score_correction_bias"]
    group_scores = scores_for_choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=hf["topk_group"], dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=hf["top_k"], dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * hf["routed_scaling_factor"]
    y = hf_experts(x_TD, topk_indices, topk_weights, hf["gate_up_proj"], hf["down_proj"]).view(x.shape)
    return y + hf_mlp(x, hf["shared_gate_proj"], hf["shared_up_proj"], hf["shared_down_proj"])


def softmax_moe(x, hf, norm_topk_prob, shared_gate):
    """Qwen3-MoE / OLMoE (norm_topk_prob either way), Mixtral (normalized), Qwen2-MoE (+ gated shared expert)."""
    x_TD = x.view(-1, x.shape[-1])
    probs = torch.softmax(F.linear(x_TD, hf["weight"]), dim=-1)
    top_value, top_index = torch.topk(probs, hf["top_k"], dim=-1)
    if norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    y_TD = hf_experts(x_TD, top_index, top_value, hf["gate_up_proj"], hf["down_proj"])
    if shared_gate:
        shared = hf_mlp(x_TD, hf["shared_gate_proj"], hf["shared_up_proj"], hf["shared_down_proj"])
        y_TD = y_TD + torch.sigmoid(F.linear(x_TD, hf["shared_expert_gate"])) * shared
    return y_TD.view(x.shape)


def hf_weights(layer):
    """The layer's weights in HF's layout (written out from the shapes above)."""
    w1, w2 = layer.experts.w1_EDH.detach(), layer.experts.w2_EHD.detach()
    hf = {"weight": layer.router.weight_ED.detach(), "e_score_correction_bias": layer.router.expert_bias_E.clone(),
          "gate_up_proj": w1.transpose(1, 2).clone(), "down_proj": w2.transpose(1, 2).clone()}
    if layer.shared_expert is not None:
        H = layer.config.shared_hidden_size
        s1 = layer.shared_expert.w1_DH.detach()
        hf.update(shared_gate_proj=s1[:, :H].t(), shared_up_proj=s1[:, H:].t(),
                  shared_down_proj=layer.shared_expert.w2_HD.detach().t())
        if layer.shared_expert.gate_D is not None:
            hf["shared_expert_gate"] = layer.shared_expert.gate_D.detach()[None, :]
    return hf


@pytest.mark.parametrize("E, K, G, topk_groups", [(16, 4, 4, 2), (32, 8, 8, 4), (12, 3, 3, 1)])
def test_deepseek_v3_moe_block(E, K, G, topk_groups):
    layer = MoELayer(MoEConfig(model_dim=10, hidden_size=6, num_experts=E, top_k=K, router="sigmoid",
                               normalize_gate=True, num_groups=G, topk_groups=topk_groups, route_scale=2.5,
                               expert_bias_update_rate=0.001, shared_hidden_size=12, activation="swiglu",
                               bias=False, capacity_factor=0.0)).double()
    layer.router.expert_bias_E.copy_(0.1 * torch.randn(E))
    hf = dict(hf_weights(layer), n_group=G, topk_group=topk_groups, top_k=K, routed_scaling_factor=2.5)
    x = torch.randn(2, 37, 10, dtype=torch.float64)
    assert torch.allclose(layer(x), deepseek_v3_moe(x, layer, hf), rtol=0, atol=1e-12)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("shared_gate", [False, True])
def test_softmax_moe_blocks(norm_topk_prob, shared_gate):
    layer = MoELayer(MoEConfig(model_dim=10, hidden_size=6, num_experts=8, top_k=3, router="softmax",
                               normalize_gate=norm_topk_prob, activation="swiglu", bias=False, capacity_factor=0.0,
                               shared_hidden_size=9 if shared_gate else 0, shared_gate=shared_gate)).double()
    x = torch.randn(3, 19, 10, dtype=torch.float64)
    expected = softmax_moe(x, dict(hf_weights(layer), top_k=3), norm_topk_prob, shared_gate)
    assert torch.allclose(layer(x), expected, rtol=0, atol=1e-12)
