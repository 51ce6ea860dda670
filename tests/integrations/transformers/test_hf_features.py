"""Each new MoEConfig feature against the Hugging Face block it serves (transformers 5.23, tiny random
configs): the block's output, its input gradient and every weight gradient agree in fp32 (1e-5 relative)
with an MoELayer configured by hand and loaded by hand (not through the family table, which
tests/integrations/transformers/test_hf_families.py checks on whole models).

  geglu / geglu_tanh   Mixtral with hidden_act gelu / gelu_pytorch_tanh (HF's model testers use gelu)
  swiglu_oai, router_bias, expert biases               gpt_oss (gate/up interleaved in [E, D, 2H])
  gate_on_input (sigmoid, top-1)                       llama4
  group_score "max" / greedy                           deepseek_v2 (group_limited_greedy / greedy)
  activation_limit (swiglu), clamped shared expert     glm5_next; hy_v4 (shared expert not clamped)
  sqrt_softplus                                        deepseek_v4 (a non-hash layer)
  relu2, non-gated shared MLP                          nemotron_h
"""
import pytest
import torch

import moe_plugin.integrations.transformers  # noqa: F401  (hides an unloadable torchaudio first)
from moe_plugin import MoEConfig, MoELayer

from helpers.compare import relative_error
from helpers.hf import needs_transformers

pytestmark = needs_transformers

DIM, HIDDEN = 24, 20


def t(w):
    return w.transpose(-1, -2)


def cat_gate_up(gate, up):
    return torch.cat([gate, up], dim=-1)


def hf_mlp_to_shared(prefix, gated=True):
    """HF MLP Linears (gate_proj, up_proj, down_proj) -> shared_expert.w1_DH [D, (2)S], w2_HD."""
    def convert(hf):
        w1 = cat_gate_up(t(hf[f"{prefix}.gate_proj.weight"]), t(hf[f"{prefix}.up_proj.weight"])) if gated \
            else t(hf[f"{prefix}.up_proj.weight"])
        return {"shared_expert.w1_DH": w1, "shared_expert.w2_HD": t(hf[f"{prefix}.down_proj.weight"])}
    return convert


def stacked(router="gate.weight", experts="experts"):
    """gate_up_proj [E, 2H, D] (rows [gate | up]), down_proj [E, D, H] -> w1_EDH, w2_EHD; the router weight."""
    def convert(hf):
        return {"router.weight_ED": hf[router], "experts.w1_EDH": t(hf[f"{experts}.gate_up_proj"]),
                "experts.w2_EHD": t(hf[f"{experts}.down_proj"])}
    return convert


def both(*converters):
    return lambda hf: {k: v for c in converters for k, v in c(hf).items()}


def correction_bias(hf):
    return {"router.expert_bias_E": hf["gate.e_score_correction_bias"]}


def gpt_oss_weights(hf):
    def deinterleave(w):
        return cat_gate_up(w[..., ::2], w[..., 1::2])
    return {"router.weight_ED": hf["router.weight"], "router.bias_E": hf["router.bias"],
            "experts.w1_EDH": deinterleave(hf["experts.gate_up_proj"]),
            "experts.b1_EH": deinterleave(hf["experts.gate_up_proj_bias"]),
            "experts.w2_EHD": hf["experts.down_proj"], "experts.b2_ED": hf["experts.down_proj_bias"]}


def llama4_weights(hf):
    return {"router.weight_ED": hf["router.weight"], "experts.w1_EDH": hf["experts.gate_up_proj"],
            "experts.w2_EHD": hf["experts.down_proj"], **hf_mlp_to_shared("shared_expert")(hf)}


def nemotron_weights(hf):
    return {"router.weight_ED": hf["gate.weight"], "experts.w1_EDH": t(hf["experts.up_proj"]),
            "experts.w2_EHD": t(hf["experts.down_proj"]), **correction_bias(hf),
            **hf_mlp_to_shared("shared_experts", gated=False)(hf)}


COMMON = dict(model_dim=DIM, capacity_factor=0.0, aux_loss="none", aux_loss_coef=0.0, bias=False, min_capacity=0)
DEEPSEEK_V3_ROUTING = dict(num_hidden_layers=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=2)


def case_mixtral(act):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = MixtralConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=6, num_experts_per_tok=2,
                           hidden_act=act)
    ours = dict(hidden_size=HIDDEN, num_experts=6, top_k=2, activation={"gelu": "geglu",
                "gelu_pytorch_tanh": "geglu_tanh"}[act])
    return MixtralSparseMoeBlock(config), ours, stacked()


def case_gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    config = GptOssConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=8, num_experts_per_tok=4,
                          swiglu_limit=0.6)
    ours = dict(hidden_size=HIDDEN, num_experts=8, top_k=4, activation="swiglu_oai", bias=True, router_bias=True,
                activation_limit=config.swiglu_limit, activation_alpha=config.swiglu_alpha, fp32_router=False)
    assert config.swiglu_alpha == 1.702
    return GptOssMLP(config), ours, gpt_oss_weights


def case_llama4():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    config = Llama4TextConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=5)
    assert config.num_experts_per_tok == 1
    ours = dict(hidden_size=HIDDEN, num_experts=5, top_k=1, router="sigmoid", normalize_gate="none",
                gate_on_input=True, activation="swiglu", shared_hidden_size=HIDDEN, fp32_router=False)
    return Llama4TextMoe(config), ours, llama4_weights


def case_deepseek_v2(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    config = DeepseekV2Config(hidden_size=DIM, moe_intermediate_size=HIDDEN, n_routed_experts=12,
                              num_experts_per_tok=3, n_group=4, topk_group=2, topk_method=method,
                              routed_scaling_factor=1.7, n_shared_experts=2, num_attention_heads=4,
                              num_key_value_heads=4)
    groups = dict(num_groups=4, topk_groups=2, group_score="max") if method == "group_limited_greedy" else {}
    ours = dict(hidden_size=HIDDEN, num_experts=12, top_k=3, normalize_gate="none", route_scale=1.7,
                activation="swiglu", shared_hidden_size=2 * HIDDEN, **groups)
    return DeepseekV2Moe(config), ours, both(stacked(), hf_mlp_to_shared("shared_experts"))


def case_clamped(model_type):
    if model_type == "glm5_next":
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig as Config
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE as Block
    else:
        from transformers import HYV4Config as Config
        from transformers.models.hy_v4.modeling_hy_v4 import HYV4MoE as Block
    config = Config(hidden_size=DIM, moe_intermediate_size=HIDDEN, swiglu_limit=0.5, **DEEPSEEK_V3_ROUTING)
    ours = dict(hidden_size=HIDDEN, num_experts=8, top_k=3, router="sigmoid", num_groups=4, topk_groups=2,
                route_scale=2.5, activation="swiglu", activation_limit=0.5, shared_hidden_size=2 * HIDDEN,
                clamp_shared=model_type == "glm5_next")
    return Block(config), ours, both(stacked(), hf_mlp_to_shared("shared_experts"), correction_bias)


def case_deepseek_v4():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock
    config = DeepseekV4Config(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=8, num_experts_per_tok=3,
                              routed_scaling_factor=1.5, swiglu_limit=0.5, num_hidden_layers=1,
                              mlp_layer_types=["moe"])
    assert config.scoring_func == "sqrtsoftplus"
    ours = dict(hidden_size=HIDDEN, num_experts=8, top_k=3, router="sqrt_softplus", route_scale=1.5,
                activation="swiglu", activation_limit=0.5, shared_hidden_size=HIDDEN)
    return DeepseekV4SparseMoeBlock(config, 0), ours, both(stacked(), hf_mlp_to_shared("shared_experts"),
                                                           correction_bias)


def case_nemotron_h():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE
    config = NemotronHConfig(hidden_size=DIM, moe_intermediate_size=HIDDEN, moe_shared_expert_intermediate_size=12,
                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                             routed_scaling_factor=2.0, norm_topk_prob=True)
    assert config.mlp_hidden_act == "relu2" and config.moe_latent_size is None
    ours = dict(hidden_size=HIDDEN, num_experts=8, top_k=2, router="sigmoid", num_groups=2, topk_groups=1,
                route_scale=2.0, activation="relu2", shared_hidden_size=12)
    return NemotronHMoE(config), ours, nemotron_weights


CASES = {
    "mixtral geglu": lambda: case_mixtral("gelu"),
    "mixtral geglu_tanh": lambda: case_mixtral("gelu_pytorch_tanh"),
    "gpt_oss": case_gpt_oss,
    "llama4": case_llama4,
    "deepseek_v2 greedy": lambda: case_deepseek_v2("greedy"),
    "deepseek_v2 group_limited_greedy": lambda: case_deepseek_v2("group_limited_greedy"),
    "glm5_next": lambda: case_clamped("glm5_next"),
    "hy_v4": lambda: case_clamped("hy_v4"),
    "deepseek_v4": case_deepseek_v4,
    "nemotron_h": case_nemotron_h,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_equals_the_hf_block(name):
    block, ours, to_layer = CASES[name]()
    with torch.no_grad():
        for key, p in block.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
        for key, b in block.named_buffers():
            if "correction_bias" in key:
                b.copy_(0.1 * torch.randn_like(b))
    layer = MoELayer(MoEConfig(**{**COMMON, **ours}))
    if "router.expert_bias_E" in to_layer(dict(block.named_parameters()) | dict(block.named_buffers())):
        layer.router.fixed_bias = True
    hf_state = {k: v.detach() for k, v in list(block.named_parameters()) + list(block.named_buffers())}
    missing, unexpected = layer.load_state_dict(to_layer(hf_state), strict=False)
    assert not unexpected and not [k for k in missing if k != "router.expert_bias_E"], missing

    x = torch.randn(2, 19, DIM)
    upstream = torch.randn(2, 19, DIM)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf = block(x_hf)
    y_hf = (y_hf[0] if isinstance(y_hf, tuple) else y_hf).view(x.shape)   # Llama 4 gives [T, D]
    (y_hf * upstream).sum().backward()
    y = layer(x_ours)
    (y * upstream).sum().backward()

    assert relative_error(y, y_hf.detach()) <= 1e-5
    assert relative_error(x_ours.grad, x_hf.grad) <= 1e-5
    hf_grads = to_layer({k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in block.named_parameters()}
                        | {k: b for k, b in block.named_buffers()})
    own = dict(layer.named_parameters())
    for key, grad in hf_grads.items():
        if key in own:
            assert relative_error(own[key].grad, grad) <= 1e-5, key
    assert set(own) <= set(hf_grads), set(own) - set(hf_grads)


def test_router_norm_expert_gate_scale_and_router_input_equal_gemma4s_moe_branch():
    """Gemma 4's decoder layer routes the residual stream (its router: RMS norm without weight, a learned scale,
    hidden_size ** -0.5, softmax top-k normalized, times per_expert_scale) and feeds the experts
    pre_feedforward_layernorm_2 of it: the layer with router_norm, expert_gate_scale and router_input."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextExperts, Gemma4TextRouter
    config = Gemma4TextConfig(hidden_size=DIM, num_experts=8, top_k_experts=3, moe_intermediate_size=HIDDEN,
                              enable_moe_block=True, rms_norm_eps=1e-6)
    assert config.hidden_activation == "gelu_pytorch_tanh"
    router, experts, norm = Gemma4TextRouter(config), Gemma4TextExperts(config), Gemma4RMSNorm(DIM, eps=1e-6)
    with torch.no_grad():
        for module in (router, experts, norm):
            for p in module.parameters():
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    layer = MoELayer(MoEConfig(**{**COMMON, "hidden_size": HIDDEN, "num_experts": 8, "top_k": 3,
                                  "activation": "geglu_tanh", "router_norm": True, "router_norm_eps": 1e-6,
                                  "expert_gate_scale": True}))
    layer.load_state_dict({"router.weight_ED": router.proj.weight.detach(),
                           "router.input_scale_D": router.scale.detach(),
                           "router.gate_scale_E": router.per_expert_scale.detach(),
                           **stacked("unused", "experts")({"unused": router.proj.weight, **{
                               f"experts.{k}": v.detach() for k, v in experts.named_parameters()}})}, strict=False)

    residual = torch.randn(2, 19, DIM)
    upstream = torch.randn(2, 19, DIM)
    r_hf, r_ours = residual.clone().requires_grad_(), residual.clone().requires_grad_()
    flat = r_hf.reshape(-1, DIM)
    _, weights, index = router(flat)
    y_hf = experts(norm(flat), index, weights).view(residual.shape)
    (y_hf * upstream).sum().backward()
    y = layer(norm(r_ours), router_input=r_ours)
    (y * upstream).sum().backward()

    assert relative_error(y, y_hf.detach()) <= 1e-5 and relative_error(r_ours.grad, r_hf.grad) <= 1e-5
    own = dict(layer.named_parameters())
    pairs = {"router.weight_ED": router.proj.weight.grad, "router.input_scale_D": router.scale.grad,
             "router.gate_scale_E": router.per_expert_scale.grad,
             "experts.w1_EDH": t(experts.gate_up_proj.grad), "experts.w2_EHD": t(experts.down_proj.grad)}
    for key, grad in pairs.items():
        assert relative_error(own[key].grad, grad) <= 1e-5, key
