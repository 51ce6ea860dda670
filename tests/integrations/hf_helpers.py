"""Tiny random Hugging Face MoE models (built from config classes, no download) and comparisons."""
import copy

import pytest
import torch

transformers_available = True
try:
    import moe_plugin.integrations.transformers as hf_moe  # hides an unloadable torchaudio first
    import transformers
except ImportError as error:  # pragma: no cover - depends on the environment
    transformers_available, hf_moe, transformers = False, None, None
    IMPORT_ERROR = str(error)
else:
    IMPORT_ERROR = ""

needs_transformers = pytest.mark.skipif(not transformers_available,
                                        reason=f"transformers is not installed: {IMPORT_ERROR}")

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, num_experts_per_tok=3, hidden_act="silu")


SPECIFIC = {
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, intermediate_size=28, num_local_experts=6)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, intermediate_size=36, moe_intermediate_size=28,
                                         num_experts=6, shared_expert_intermediate_size=20, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, intermediate_size=36, moe_intermediate_size=28,
                                         num_experts=6, norm_topk_prob=True, head_dim=10)),
    "olmoe": ("OlmoeConfig", dict(num_key_value_heads=2, intermediate_size=28, num_experts=6, norm_topk_prob=False)),
    # DeepSeek-V3: kv heads == attention heads; layer 0 dense, layers 1-2 MoE; 8 experts in 4 groups, 2 chosen
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=36,
                                             moe_intermediate_size=28, n_routed_experts=8, n_shared_experts=2,
                                             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                             first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=10)),
}


def family_config(family: str, **extra):
    """A tiny config of the family with odd sizes: D 40, 6 experts (8 for DeepSeek-V3) of width 28, top-3."""
    class_name, specific = SPECIFIC[family]
    return getattr(transformers, class_name)(**{**COMMON, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                                **specific, **extra})


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


def build_model(family: str, seed: int, dtype=torch.float32, experts_implementation=None, **extra):
    """The family's causal LM with fresh random weights (and, for DeepSeek-V3, a non-zero
    e_score_correction_bias, so that the bias changes the choice)."""
    config = family_config(family, **extra)
    torch.manual_seed(seed)
    options = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **options)
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
    """Every gradient of model under its HF name and layout: a swapped block's grads mapped back."""
    family = hf_moe.require_family(model)
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, hf_moe.HFMoEBlock)}
    grads = {n: p.grad for n, p in model.named_parameters()
             if not any(n.startswith(f"{b}.") for b in blocks)}
    for name, block in blocks.items():
        layer_grads = {n: p.grad for n, p in block.moe.named_parameters()}
        grads.update({f"{name}.{k}": v for k, v in hf_moe.layer_to_hf(family, _pad(family, layer_grads)).items()})
    return grads


def _pad(family, grads):
    """layer_to_hf wants every mapped tensor; buffers (the expert bias) have no gradient."""
    return {m.layer: grads.get(m.layer, torch.zeros(0)) for m in family.weights}


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    scale = expected.detach().abs().max().clamp(min=1e-30)
    return float((actual.detach().double() - expected.detach().double()).abs().max() / scale)


def assert_close_rel(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = max_rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def forward_backward(model, ids):
    out = model(ids, labels=ids, output_router_logits=True)
    model.zero_grad(set_to_none=True)
    out.loss.backward()
    return out


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
