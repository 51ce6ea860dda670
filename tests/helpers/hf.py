"""Tiny random Hugging Face MoE models (built from config classes, no download), their inputs and gradients."""
import copy
import re

import pytest
import torch

transformers_available = True
try:
    import moe_plugin.integrations.transformers as hf_moe  # hides an unloadable torchaudio first
    import transformers
    from moe_plugin.integrations.transformers.block import hf_key
except ImportError as error:  # pragma: no cover - depends on the environment
    transformers_available, hf_moe, transformers, hf_key = False, None, None, None
    IMPORT_ERROR = str(error)
else:
    IMPORT_ERROR = ""

needs_transformers = pytest.mark.skipif(not transformers_available,
                                        reason=f"transformers is not installed: {IMPORT_ERROR}")

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, num_experts_per_tok=3, hidden_act="silu")


# multi-head latent attention and DeepSeek-V3's grouped routing at tiny sizes (kv heads == attention heads)
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=10)
GROUPED = dict(intermediate_size=36, moe_intermediate_size=28, n_routed_experts=8, n_shared_experts=2, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
SPECIFIC = {
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, intermediate_size=28, num_local_experts=6)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, intermediate_size=36, moe_intermediate_size=28,
                                         num_experts=6, shared_expert_intermediate_size=20, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, intermediate_size=36, moe_intermediate_size=28,
                                         num_experts=6, norm_topk_prob=True, head_dim=10)),
    "olmoe": ("OlmoeConfig", dict(num_key_value_heads=2, intermediate_size=28, num_experts=6, norm_topk_prob=False)),
    # DeepSeek-V3: kv heads == attention heads; layer 0 dense, layers 1-2 MoE; 8 experts in 4 groups, 2 chosen
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1,
                                             **MLA, **GROUPED)),
}
# every other family of the table (the harness, test_hf_families.py): routed width 28, shared width 20 where the
# config sets it apart, 6 experts (8 in 4 groups, 2 chosen, for DeepSeek-V3-style routers), top-3. Qwen3-Next and
# Qwen3.5 use full attention only: their gated delta rule amplifies fp32 rounding into its own tiny gradients
# (dt_bias, A_log: ~1e-7) up to 3e-4 relative (HF's own fp32 is 6e-5 off fp64; in fp64 the swapped model equals HF's)
QWEN = dict(num_key_value_heads=2, intermediate_size=36, moe_intermediate_size=28, num_experts=6, head_dim=10)
MORE = {
    "minimax": ("MiniMaxConfig", dict(num_key_value_heads=2, intermediate_size=28, num_local_experts=6, head_dim=10,
                                      layer_types=["linear_attention", "full_attention"])),
    "mellum": ("MellumConfig", dict(QWEN, norm_topk_prob=False)),
    "flex_olmo": ("FlexOlmoConfig", dict(num_key_value_heads=2, intermediate_size=28, num_experts=6,
                                         norm_topk_prob=True)),
    "qwen3_next": ("Qwen3NextConfig", dict(QWEN, shared_expert_intermediate_size=20, norm_topk_prob=False,
                                           linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                           linear_num_value_heads=4, layer_types=["full_attention",
                                                                                  "full_attention"])),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(QWEN, shared_expert_intermediate_size=20,
                                                      linear_key_head_dim=8, linear_value_head_dim=8,
                                                      linear_num_key_heads=2, linear_num_value_heads=4,
                                                      layer_types=["full_attention", "full_attention"])),
    "aria_text": ("AriaTextConfig", dict(num_key_value_heads=2, intermediate_size=28, moe_num_experts=6, moe_topk=3,
                                         moe_num_shared_experts=2)),
    "glm4_moe": ("Glm4MoeConfig", dict(num_key_value_heads=2, head_dim=10, **GROUPED, first_k_dense_replace=1,
                                       num_hidden_layers=3)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(num_key_value_heads=4, **MLA, **GROUPED,
                                                mlp_layer_types=["dense", "sparse", "sparse"], num_hidden_layers=3)),
    "deepseek_v32": ("DeepseekV32Config", dict(num_key_value_heads=4, **MLA, **GROUPED, first_k_dense_replace=1,
                                               num_hidden_layers=3, index_head_dim=16, index_n_heads=2,
                                               index_topk=8, head_dim=16)),
    "dots1": ("Dots1Config", dict(num_key_value_heads=2, head_dim=10, **GROUPED, first_k_dense_replace=1,
                                  num_hidden_layers=3)),
    "kimi_linear": ("KimiLinearConfig", dict(num_key_value_heads=4, **MLA, **GROUPED, linear_head_dim=8,
                                             linear_num_heads=4, num_hidden_layers=3,
                                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                                             mlp_layer_types=["dense", "sparse", "sparse"])),
    "mimo_v2_flash": ("MiMoV2FlashConfig", dict(num_key_value_heads=2, head_dim=10, v_head_dim=10, **GROUPED,
                                                mlp_layer_types=["dense", "sparse", "sparse"], num_hidden_layers=3)),
    "mistral4": ("Mistral4Config", dict(num_key_value_heads=4, **MLA, **GROUPED, first_k_dense_replace=1,
                                        num_hidden_layers=3)),
    "minimax_m2": ("MiniMaxM2Config", dict(num_key_value_heads=2, intermediate_size=28, num_local_experts=6,
                                           head_dim=10)),
    "afmoe": ("AfmoeConfig", dict(num_key_value_heads=2, head_dim=10, moe_intermediate_size=28, num_experts=6,
                                  num_shared_experts=2, num_dense_layers=1, num_hidden_layers=3, route_scale=1.7)),
    "lfm2_moe": ("Lfm2MoeConfig", dict(num_key_value_heads=2, moe_intermediate_size=28, num_experts=6,
                                       num_dense_layers=1, num_hidden_layers=3, routed_scaling_factor=1.3,
                                       layer_types=["full_attention", "conv", "full_attention"])),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(num_key_value_heads=2, intermediate_size=28, num_experts=6,
                                                  moe_topk=3, head_dim=10)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(num_key_value_heads=2, moe_intermediate_size=28, moe_num_experts=6,
                                                moe_k=3, moe_num_shared_experts=1, moe_layer_start_index=0)),
    "granitemoe": ("GraniteMoeConfig", dict(num_key_value_heads=2, intermediate_size=28, num_local_experts=6)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(num_key_value_heads=2, intermediate_size=28,
                                                        num_local_experts=6, shared_intermediate_size=20)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(num_key_value_heads=2, intermediate_size=28,
                                                        num_local_experts=6, shared_intermediate_size=20,
                                                        layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                        mamba_d_head=20, mamba_d_state=8, mamba_chunk_size=8)),
    "jamba": ("JambaConfig", dict(num_key_value_heads=2, intermediate_size=28, num_experts=6, use_mamba_kernels=False,
                                  expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                                  attn_layer_offset=0, mamba_d_state=8, mamba_dt_rank=4)),
    "dbrx": ("DbrxConfig", dict(d_model=40, n_heads=4, n_layers=2, max_seq_len=64,
                                attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                ffn_config=dict(ffn_hidden_size=28, moe_num_experts=6, moe_top_k=3,
                                                moe_normalize_expert_weights=1.0))),
    "cohere2_moe": ("Cohere2MoeConfig", dict(num_key_value_heads=2, intermediate_size=28, num_experts=6,
                                             num_shared_experts=1, shared_expert_combination_strategy="sum",
                                             head_dim=10, layer_types=["sliding_attention", "full_attention"])),
    # families_special.py (helper "features"): small swiglu limits so that the clamp engages at init std 0.02
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=2, head_dim=10, intermediate_size=28, num_local_experts=6,
                                     swiglu_limit=0.05, layer_types=["sliding_attention", "full_attention"])),
    "llama4_text": ("Llama4TextConfig", dict(num_key_value_heads=2, head_dim=10, intermediate_size=28,
                                             intermediate_size_mlp=36, num_local_experts=6, num_experts_per_tok=1,
                                             interleave_moe_layer_step=2, num_hidden_layers=4)),   # layers 1, 3 MoE
    "deepseek_v2": ("DeepseekV2Config", dict(num_key_value_heads=4, **MLA, moe_intermediate_size=28,
                                             n_routed_experts=8, n_shared_experts=2,
                                             topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=1.5, first_k_dense_replace=1, num_hidden_layers=3)),
    "hy_v4": ("HYV4Config", dict(num_key_value_heads=2, head_dim=10, **GROUPED, swiglu_limit=0.05,
                                 num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"])),
    "nemotron_h": ("NemotronHConfig", dict(num_key_value_heads=2, head_dim=10, intermediate_size=36,
                                           moe_intermediate_size=28, moe_shared_expert_intermediate_size=20,
                                           n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           norm_topk_prob=True, num_hidden_layers=3,
                                           layers_block_type=["mamba", "moe", "attention"], mamba_num_heads=4,
                                           mamba_head_dim=10, ssm_state_size=8, n_groups=2, chunk_size=8)),
    # layer 0 hash-routed (stays HF's), layers 1 and 2 swapped; every attention type of V4 once
    "deepseek_v4": ("DeepseekV4Config", dict(num_key_value_heads=1, head_dim=16, q_lora_rank=24, o_lora_rank=16,
                                             o_groups=2, moe_intermediate_size=28, n_routed_experts=8,
                                             routed_scaling_factor=1.5, swiglu_limit=0.05, num_hidden_layers=3,
                                             mlp_layer_types=["hash_moe", "moe", "moe"],
                                             layer_types=["sliding_attention", "compressed_sparse_attention",
                                                          "heavily_compressed_attention"],
                                             compress_rates={"compressed_sparse_attention": 2,
                                                             "heavily_compressed_attention": 4},
                                             sliding_window=8, index_n_heads=2, index_head_dim=8, index_topk=4,
                                             hc_mult=2, partial_rotary_factor=0.5)),
    # every decoder layer holds the dense MLP and the MoE (router, experts) side by side
    "gemma4_text": ("Gemma4TextConfig", dict(num_key_value_heads=2, head_dim=10, intermediate_size=36,
                                             hidden_activation="gelu_pytorch_tanh", enable_moe_block=True,
                                             num_experts=6, top_k_experts=3, moe_intermediate_size=28,
                                             hidden_size_per_layer_input=0, vocab_size_per_layer_input=61,
                                             layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                             global_head_dim=10)),
}


def family_config(family: str, **extra):
    """A tiny config of the family with odd sizes: D 40, 6 experts (8 for DeepSeek-V3) of width 28, top-3."""
    class_name, specific = {**SPECIFIC, **MORE}[family]
    return getattr(transformers, class_name)(**{**COMMON, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                                **specific, **extra})


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


CAUSAL_LM = {"mistral4": "Mistral4ForCausalLM"}   # model types AutoModelForCausalLM does not map


def model_class(family: str) -> type:
    """The family's causal LM class."""
    if family in CAUSAL_LM:
        return getattr(transformers, CAUSAL_LM[family])
    return transformers.AutoModelForCausalLM._model_mapping[type(family_config(family))]


def build_model(family: str, seed: int, dtype=torch.float32, experts_implementation=None, **extra):
    """The family's causal LM with fresh random weights (and, for DeepSeek-V3, a non-zero
    e_score_correction_bias, so that the bias changes the choice)."""
    config = family_config(family, **extra)
    torch.manual_seed(seed)
    options = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = model_class(family)._from_config(config, dtype=dtype, **options)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return model


def unbiased_deepseek():
    """DeepSeek-V3 with a zero e_score_correction_bias: the choices follow the scores, which differ by token."""
    model = build_model("deepseek_v3", seed=4)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.zero_()
    return model


def bias_sign_step(load_E: torch.Tensor) -> torch.Tensor:
    """The aux-loss-free update's direction per expert, sign(mean load - load), written out independently."""
    return torch.sign(load_E.sum() - load_E.numel() * load_E).float()


def tokens(seed: int, batch: int = 2, length: int = 13):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_named_grads(model) -> dict:
    """Every gradient of model under its HF name and layout: a swapped block's grads mapped back (by the block's
    own family: a composite model holds several)."""
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, hf_moe.HFMoEBlock)}
    grads = {n: p.grad for n, p in model.named_parameters()
             if not any(n.startswith(f"{b}.") for b in blocks)}
    for name, block in blocks.items():
        layer_grads = {n: p.grad for n, p in block.moe.named_parameters() if p.grad is not None}
        mapped = hf_moe.layer_to_hf(hf_moe.FAMILIES[block.family], layer_grads, partial=True)
        grads.update({hf_key(name, block, k): v for k, v in mapped.items()})
    return grads


def forward_backward(model, ids):
    out = model(ids, labels=ids, output_router_logits=True)
    model.zero_grad(set_to_none=True)
    out.loss.backward()
    return out


def trainable(model) -> dict:
    """{name: parameter} of model's parameters that train (PEFT's adapters, once get_peft_model froze the rest)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def loss_and_grads(model, ids):
    """The causal LM loss on ids (as labels too) and the gradient of each trainable parameter, from fresh grads."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in trainable(model).items()}


def swapped_copy(model, **overrides):
    return hf_moe.swap_moe_blocks(copy.deepcopy(model), **overrides)


def save_and_resume(engine_from, step, logits, directory, rank, probe):
    """3 training steps, engine.save_checkpoint, then a fresh engine (another seed) loads it. Returns the report
    (how far the restored and the fresh engine's logits on probe are from the saved ones; both engines' next two
    losses), the saved logits and both engines. step(engine, ids) -> loss; logits(engine, ids) -> logits."""
    engine = engine_from(seed=1)
    for i in range(3):
        step(engine, tokens(seed=10 * i + rank))
    engine.save_checkpoint(directory, tag="t")
    saved = logits(engine, probe)
    resumed = engine_from(seed=2)
    fresh = logits(resumed, probe)
    resumed.load_checkpoint(directory, tag="t")
    report = {"restored": (logits(resumed, probe) - saved).abs().max().item(),
              "fresh differs": (fresh - saved).abs().max().item()}
    more = [tokens(seed=70 + 10 * i + rank) for i in range(2)]
    report["losses"] = [[step(e, ids) for ids in more] for e in (engine, resumed)]
    return report, saved, engine, resumed


# hyper-connection parameters (HY-V4, GLM-5-Next, DeepSeek-V4: hc_head.*, layers.*.attn_hc.*, ffn_hc.*)
HYPER_CONNECTION = re.compile(r"(^|\.)(hc_head|attn_hc|ffn_hc)\.")


def gradient_floor(name: str, largest: float) -> float:
    """The smallest scale a gradient's relative error is taken against: 1e-3 of the model's largest gradient (1e-2
    for hyper-connection parameters). Their gradients are tiny sums that cancel (~1e-6 .. 1e-4), and fp32 rounding
    of the MoE output alone (HF's model against HF's with the experts moved by 1e-7) moves them by 2e-5 of the
    1e-3 floor (DeepSeek-V4's hc_head.hc_fn; HC computes in fp32 whatever the model's dtype)."""
    return (1e-2 if HYPER_CONNECTION.search(name) else 1e-3) * largest
