"""Every Hugging Face MoE family of the table (families.py and families_special.py) against HF's own model
under the same tiny config: logits, loss, router logits, aux loss and every gradient; the state-dict, HF-name
and export_hf round trips; a capacity override's drops; ep_size 2 on 2 gloo processes (one spawn for all).

A family's tiny config: helpers.hf.SPECIFIC / MORE (D 40, 2-3 layers, 6 experts, or 8 in 4 groups, top-3,
SiLU), or COMPOSITE below for the families HF builds only inside a composite model.
What this module tests (moved here from the README):

- Tested: one parametrized harness (tests/integrations/transformers/test_hf_families.py) runs every entry of the
  table on a tiny random config built from the family's own HF config class (D 40, 2-3 layers, 6
  experts, or 8 in 4 groups with 2 chosen, top-3, batches of 2 x 13 tokens), fp32, against the
  unswapped HF model: logits, loss, router logits, aux loss and every gradient agree to 1e-5 relative
  (with non-zero choice biases; a gradient is held to 1e-5 of itself or of 1e-3 of the model's largest,
  1e-2 for the small hyper-connection gradients of HY-V4, GLM-5-Next and DeepSeek-V4, which HF's own model
  moves by more than that in fp32 rounding alone when its experts move by 1e-7).
  State-dict round trips, in our names and in HF names, give equal outputs; `export_hf` then plain
  `from_pretrained` gives equal outputs, and swapping again gives the exact weights. A capacity override
  (0.5) drops exactly the choices past capacity (HF's own block, with the dropped choices' weights
  zeroed on their way into its experts, gives the swapped block's output). ep_size 2 on 2 gloo processes
  (ranks with 13 and 7 tokens a row) equals one process for every family, in one spawn, and exports
  every expert. Config variants that change a mapping (LFM2-MoE without its bias, ERNIE-4.5 and
  Cohere2-MoE without a shared expert, DBRX unnormalized) run too. Each new layer feature is also
  tested against the HF block it serves and against the einsum reference (tests/core/test_expert_features.py,
  tests/integrations/transformers/test_hf_features.py). For the five first families (tests/integrations/
  test_transformers*.py): under bf16 autocast
  (fp32 parameters, as GPU training runs) the swapped model's logits and gradients are as close to the
  fp32 result as HF's own model under the same autocast, and DeepSpeed's `"bf16": {"enabled": true}`
  trains swapped Mixtral and DeepSeek-V3 models with their experts over 2 processes (first loss equal
  to HF's own model cast to bf16). Gradient checkpointing (`gradient_checkpointing_enable()`, reentrant
  or not) gives HF's loss and gradients (the recomputed forward counts its choices twice, which leaves
  the sign update of the expert bias unchanged), and greedy `generate()` through the KV cache gives
  HF's tokens.
"""
import functools
import inspect
import math
import re
from pathlib import Path

import pytest
import torch

from helpers.compare import assert_close_rel
from helpers.hf import (COMMON, GROUPED, MORE, SPECIFIC, VOCAB, family_config, gradient_floor, hf_moe, hf_named_grads,
                        model_class, needs_transformers, swapped_copy, tokens, transformers)
from helpers.launch import run_workers
from helpers.paths import REPO

pytestmark = [needs_transformers, pytest.mark.timeout(600)]
TOL = 1e-5
ALL = sorted(hf_moe.FAMILIES) if hf_moe is not None else []
README = REPO / "README.md"
MARKERS = ("<!-- families:start -->\n", "<!-- families:end -->")

# Families HF builds inside composite models: (the text config's class, its fields, the model's config class,
# the fields around it, the model class). The talker is a base model (no LM head): fed embeddings.
TEXT = dict(COMMON, num_key_value_heads=2, head_dim=10, intermediate_size=36, moe_intermediate_size=28,
            num_experts=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 2]})
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=40, patch_size=4,
              num_position_embeddings=16)
COMPOSITE = {
    "qwen3_vl_moe_text": ("Qwen3VLMoeTextConfig", TEXT, "Qwen3VLMoeConfig",
                          dict(vision_config=dict(VISION, deepstack_visual_indexes=[0])),
                          "Qwen3VLMoeForConditionalGeneration"),
    "glm4v_moe_text": ("Glm4vMoeTextConfig",
                       dict(TEXT, **GROUPED, head_dim=12, first_k_dense_replace=1, num_hidden_layers=3,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [1, 1, 1], "partial_rotary_factor": 0.5}),
                       "Glm4vMoeConfig", dict(vision_config=VISION), "Glm4vMoeForConditionalGeneration"),
    "qwen3_omni_moe_text": ("Qwen3OmniMoeTextConfig", TEXT, "Qwen3OmniMoeThinkerConfig",
                            dict(vision_config=dict(VISION, deepstack_visual_indexes=[0]),
                                 audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16,
                                                   d_model=16, output_dim=40, num_mel_bins=16,
                                                   downsample_hidden_size=8)),
                            "Qwen3OmniMoeThinkerForConditionalGeneration"),
    "qwen3_omni_moe_talker_text": ("Qwen3OmniMoeTalkerTextConfig", dict(TEXT, shared_expert_intermediate_size=20),
                                   None, None, "Qwen3OmniMoeTalkerModel"),
    # (helper "features") GLM-5-Next's text model: linear (KDA) and indexed (DSA, MLA without rope dims) attention;
    # its image/video token ids lie past the vocabulary so that text inputs never hold one
    "glm5_next_text": ("Glm5NextTextConfig",
                       dict(COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_key_value_heads=4, head_dim=10,
                            **GROUPED, swiglu_limit=0.05,
                            num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                            layer_types=["linear_attention", "indexed_attention", "linear_attention"],
                            linear_head_dim=8, linear_num_heads=4, index_head_dim=16, index_n_heads=2, index_topk=8,
                            index_kpool=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16,
                            v_head_dim=10),
                       "Glm5NextConfig",
                       dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                                               out_hidden_size=40, patch_size=4, projection_intermediate_size=24),
                            image_token_id=1000, video_token_id=1001, image_start_token_id=1002,
                            image_end_token_id=1003, video_start_token_id=1004, video_end_token_id=1005),
                       "Glm5NextForConditionalGeneration"),
}


def _module_of(family):
    import importlib
    return importlib.import_module(hf_moe.FAMILIES[family].module)


def text_config(family, **extra):
    """The config the family's blocks are built from (tiny)."""
    if family in COMPOSITE:
        name, fields = COMPOSITE[family][:2]
        config_module = importlib_config(family)
        return getattr(config_module, name)(**{**fields, **extra})
    return family_config(family, **extra)


def importlib_config(family):
    import importlib
    return importlib.import_module(hf_moe.FAMILIES[family].module.replace(".modeling_", ".configuration_"))


def build(family, seed, **extra):
    """The family's tiny model with fresh random weights (biases of the choice non-zero, so they matter)."""
    torch.manual_seed(seed)
    if family in COMPOSITE:
        _, _, outer, outer_fields, model_name = COMPOSITE[family]
        config = text_config(family, **extra)
        if outer is not None:
            config = getattr(transformers, outer)(text_config=config.to_dict(), **outer_fields)
        model = getattr(_module_of(family), model_name)(config)
    else:
        config = family_config(family, **extra)
        model = model_class(family)._from_config(config)
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if family == "qwen3_omni_moe_talker_text" and re.search(r"experts\.(gate_up_proj|down_proj)$", name):
                tensor.normal_(0.0, 0.02)   # HF's talker model leaves its experts uninitialized (torch.empty)
            if re.search(r"(e_score_correction_bias|expert_bias)$", name):
                tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
            if re.search(r"router\.(scale|per_expert_scale)$", name):   # Gemma 4's (ones at init)
                tensor.uniform_(0.5, 1.5)
            if name.endswith("tid2eid"):   # DeepSeek-V4's hash layers (HF's code): distinct experts per token id
                generator = torch.Generator().manual_seed(seed)
                tensor.copy_(torch.stack([torch.randperm(model.config.n_routed_experts, generator=generator)
                                          [:tensor.shape[1]] for _ in range(tensor.shape[0])]))
    return model


def inputs(family, seed, batch=2, length=13):
    """Token ids (odd length), or embeddings and positions for the talker (a base model)."""
    if COMPOSITE.get(family, (None,) * 5)[2] is None and family in COMPOSITE:
        generator = torch.Generator().manual_seed(seed)
        return dict(inputs_embeds=torch.randn(batch, length, 40, generator=generator),
                    position_ids=torch.arange(length).expand(3, batch, length))
    return dict(input_ids=tokens(seed, batch=batch, length=length))


def run(model, batch, backward=True):
    """(output, loss, router logits, aux loss); the loss is backpropagated. A base model's loss is a fixed random
    projection of its last hidden state."""
    if "input_ids" in batch:
        out = model(**batch, labels=batch["input_ids"], output_router_logits=True)
        output, loss = out.logits, out.loss
    else:
        out = model(**batch, output_router_logits=True)
        output = out.last_hidden_state   # normalized: its mean square hardly moves, so a fixed random projection
        loss = (output * torch.randn(output.shape, generator=torch.Generator().manual_seed(0))).mean()
    if backward:
        model.zero_grad(set_to_none=True)
        loss.backward()
    return output, loss, out.router_logits, getattr(out, "aux_loss", None)


def largest_grad(model) -> float:
    return max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)


def assert_grad_close(actual, expected, scale, what):
    """TOL relative to the gradient itself, or to helpers.hf.gradient_floor where that is larger."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    floor = gradient_floor(what.rpartition(" ")[2], scale)
    err = float((actual.double() - expected.double()).abs().max()) / max(float(expected.abs().max()), floor)
    assert err <= TOL, f"{what}: relative error {err:.3g} > {TOL}"


def blocks_of(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, hf_moe.HFMoEBlock)}


def test_every_family_has_a_tiny_config_and_its_block_class():
    assert len(ALL) >= 34
    for family in ALL:
        assert family in {**SPECIFIC, **MORE, **COMPOSITE}, f"{family}: no tiny config for the harness"
        entry = hf_moe.FAMILIES[family]
        assert entry.block_class().__name__ == entry.block


# config choices that change what an entry maps (an optional bias or shared expert absent, another router)
VARIANTS = [("lfm2_moe", dict(use_expert_bias=False, norm_topk_prob=False)),
            ("ernie4_5_moe", dict(moe_num_shared_experts=0)),
            ("cohere2_moe", dict(num_shared_experts=0, expert_selection_fn="sigmoid", norm_topk_prob=False)),
            ("dbrx", dict(ffn_config=dict(ffn_hidden_size=28, moe_num_experts=6, moe_top_k=3,
                                          moe_normalize_expert_weights=None)))]
CASES = [pytest.param(f, {}, id=f) for f in ALL] + [
    pytest.param(f, extra, id=f"{f}-{'-'.join(extra)}") for f, extra in VARIANTS if f in ALL]


@pytest.mark.parametrize("family,extra", CASES)
def test_swapped_family_matches_hf_logits_loss_router_logits_aux_loss_and_every_gradient(family, extra, fresh_seed):
    assert_swapped_matches_hf(family, build(family, fresh_seed, **extra), fresh_seed)


@pytest.mark.parametrize("family", [f for f in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss") if f in ALL])
def test_swapped_with_recompute_experts_matches_hf(family, fresh_seed):
    """swap_moe_blocks(model, recompute="experts"): the swap option reaches every block, which still computes HF's
    block (backward runs the experts' first projection again)."""
    assert_swapped_matches_hf(family, build(family, fresh_seed), fresh_seed, recompute="experts")


def assert_swapped_matches_hf(family, model, seed, **overrides):
    swapped = swapped_copy(model, **overrides)
    blocks = blocks_of(swapped)
    assert blocks and all(b.family == family for b in blocks.values())
    entry = hf_moe.FAMILIES[family]   # the blocks left are those kept on HF's code (DeepSeek-V4's hash layers)
    assert not any(isinstance(m, entry.block_class()) and entry.swaps(m) for m in swapped.modules())
    assert all(getattr(b.moe.config, key) == value for b in blocks.values() for key, value in overrides.items())
    batch = inputs(family, seed + 1)
    expected, actual = run(model, batch), run(swapped, batch)
    assert_close_rel(actual[0], expected[0], TOL, "logits")
    assert_close_rel(actual[1], expected[1], TOL, "loss")
    assert len(actual[2]) == len(expected[2]) == len(blocks)
    for ours, theirs in zip(actual[2], expected[2]):
        assert_close_rel(ours, theirs, TOL, "router logits")
    assert (actual[3] is None) == (expected[3] is None)
    if expected[3] is not None:
        assert_close_rel(actual[3], expected[3], TOL, "aux_loss")
    grads = hf_named_grads(swapped)
    scale = largest_grad(model)
    for name, param in model.named_parameters():
        if param.grad is None:   # a bias kept as a frozen parameter (AFMoE, ERNIE): none on our side either
            assert grads.get(name) is None, name
        else:
            assert_grad_close(grads[name], param.grad, scale, f"grad of {name}")


@pytest.mark.parametrize("family,extra", CASES)
def test_state_dict_hf_names_and_export_hf_round_trips(family, extra, fresh_seed, tmp_path):
    """A trained swapped model: its state dict (own names, and HF names from hf_state_dict) loads strictly into
    a fresh swapped model with the same outputs; export_hf writes a folder plain from_pretrained loads with
    the same outputs, and swapping that gives back the exact weights."""
    swapped = swapped_copy(build(family, fresh_seed, **extra))
    batch = inputs(family, fresh_seed + 1)
    optimizer = torch.optim.AdamW(swapped.parameters(), lr=1e-2)
    run(swapped, batch)
    optimizer.step()
    with torch.no_grad():
        for name, tensor in swapped.named_buffers():   # the choice bias moves too (it is no parameter)
            if name.endswith("expert_bias_E") and tensor.any():
                tensor.add_(0.01)
    swapped.eval()
    with torch.no_grad():
        expected = run(swapped, batch, backward=False)[0]
    for state in (swapped.state_dict(), hf_moe.hf_state_dict(swapped)):
        fresh = swapped_copy(build(family, fresh_seed + 7, **extra)).eval()
        fresh.load_state_dict(state, strict=True)
        with torch.no_grad():
            assert torch.equal(run(fresh, batch, backward=False)[0], expected)

    out = hf_moe.export_hf(swapped, tmp_path / "export")
    loaded = type(swapped).from_pretrained(out).eval()
    assert not blocks_of(loaded)
    with torch.no_grad():
        assert_close_rel(run(loaded, batch, backward=False)[0], expected, TOL, "outputs after export")
    again = hf_moe.swap_moe_blocks(loaded)
    theirs = swapped.state_dict()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("family", ALL)
def test_capacity_override_drops_the_choices_past_capacity(family, fresh_seed):
    """capacity_factor 0.5: slots are taken choice-major (every token's best choice first) in token order; a
    choice past its expert's capacity adds nothing and the kept gates keep their HF values. Expected: HF's own
    block with the dropped choices' weights zeroed on their way into HF's experts (Llama 4: out of its router)."""
    model = build(family, fresh_seed).eval()
    entry = hf_moe.FAMILIES[family]
    name, hf_block = next((n, m) for n, m in model.named_modules()
                          if isinstance(m, entry.block_class()) and entry.swaps(m))
    swapped = swapped_copy(model, capacity_factor=0.5, min_capacity=1).eval()
    block = swapped.get_submodule(name)
    if entry.in_decoder:   # Gemma 4: the decoder layer's MoE branch, the router on x, the experts on its normed copy
        hf_block, block = (functools.partial(moe_branch, hf_block), functools.partial(moe_branch, block))
        hf_block.experts, block.moe = hf_block.args[0].experts, block.args[0].experts.moe
    cfg = block.moe.config
    x = torch.randn(3, 17, cfg.model_dim)
    x_TD = x.reshape(-1, cfg.model_dim)
    T, K, E = x_TD.shape[0], cfg.top_k, cfg.num_experts
    capacity = max(math.ceil(K * 0.5 * T / E), 1)
    with torch.no_grad():
        expert_TK = block.moe.router(x_TD).expert_TK          # best first
    kept, used = set(), [0] * E
    for k in range(K):
        for t in range(T):
            e = int(expert_TK[t, k])
            if used[e] < capacity:
                kept.add((t, e))
            used[e] += 1

    def drop(module, args):
        hidden, index_TK, weight_TK = args[:3]
        keep_TK = torch.tensor([[float((t, int(e)) in kept) for e in row] for t, row in enumerate(index_TK)])
        return (hidden, index_TK, weight_TK * keep_TK.to(weight_TK.dtype), *args[3:])

    def drop_scores(module, args, output):   # Llama 4: its router's scores [T, E] scale the experts' input
        scores_TE, *rest = output
        keep_TE = torch.zeros_like(scores_TE)
        for t, e in kept:
            keep_TE[t, e] = 1
        return (scores_TE * keep_TE, *rest)

    if len(inspect.signature(hf_block.experts.forward).parameters) >= 3:
        handle = hf_block.experts.register_forward_pre_hook(drop)
    else:
        handle = hf_block.router.register_forward_hook(drop_scores)
    try:
        with torch.no_grad():
            expected, actual = hf_block(x.clone()), block(x.clone())
    finally:
        handle.remove()
    if isinstance(expected, tuple):   # (output, router scores) from gpt-oss's and Llama 4's blocks; ours (output, None)
        expected, actual = expected[0].reshape(x.shape), actual[0]
    assert len(kept) < T * K, "the test should drop some choices"
    assert block.moe.stats["capacity"] == capacity
    assert block.moe.stats["dropped_fraction"] == pytest.approx(1 - len(kept) / (T * K))
    assert_close_rel(actual, expected, TOL, "output with drops")


def moe_branch(decoder, x):
    """Gemma 4's decoder layer's MoE branch as its forward computes it."""
    x_TD = x.reshape(-1, x.shape[-1])
    _, weights, index = decoder.router(x_TD)
    return decoder.experts(decoder.pre_feedforward_layernorm_2(x_TD), index, weights).reshape(x.shape)


def _ep2_worker(rank, world_size, families, seed, export_root):
    """Every family at ep_size 2: this rank's outputs, loss, non-block gradients and layer gradients."""
    torch.set_num_threads(1)
    results = {}
    for family in families:
        model = hf_moe.swap_moe_blocks(build(family, seed), ep_size=2)
        blocks = blocks_of(model)
        assert all(b.moe.is_parallel and b.moe.experts.w1_EDH.shape[0] == b.moe.config.num_experts // 2
                   for b in blocks.values())
        output, loss, _, _ = run(model, inputs(family, seed + 1 + rank, length=(13, 7)[rank]))
        hf_moe.export_hf(model, Path(export_root) / family)
        shared = {n: p.grad for n, p in model.named_parameters()
                  if p.grad is not None and not any(n.startswith(f"{b}.") for b in blocks)}
        layers = {b: {n: p.grad for n, p in block.moe.named_parameters() if p.grad is not None}
                  for b, block in blocks.items()}
        # numpy arrays travel by value (tensors would go through shared memory that dies with the process)
        results[family] = _tree(dict(output=output, loss=loss, shared=shared, layers=layers),
                                lambda t: t.detach().numpy())
    return results


def _tree(tree, fn):
    return {k: _tree(v, fn) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


@pytest.mark.slow
def test_ep2_on_two_processes_equals_one_process_for_every_family(fresh_seed, tmp_path):
    """One spawn for every family: each rank runs its own batch (13 and 7 tokens a row) through the swapped
    model at ep_size 2; outputs and losses equal the unswapped model's on that batch, the gradients (experts
    gathered, the rest summed) equal the gradient of the sum of both losses, and export_hf writes every
    expert (the loaded model equals the HF model)."""
    ranks = run_workers(_ep2_worker, 2, ALL, fresh_seed, str(tmp_path), timeout=900)
    for family in ALL:
        result = [_tree(r[family], torch.from_numpy) for r in ranks]
        model = build(family, fresh_seed)
        model.zero_grad()
        total = 0
        for rank in range(2):
            output, loss, _, _ = run(model, inputs(family, fresh_seed + 1 + rank, length=(13, 7)[rank]),
                                     backward=False)
            assert_close_rel(result[rank]["output"], output, TOL, f"{family} rank {rank} outputs")
            assert_close_rel(result[rank]["loss"], loss, TOL, f"{family} rank {rank} loss")
            total = total + loss
        total.backward()
        entry = hf_moe.FAMILIES[family]
        grads = {n: sum(r["shared"][n] for r in result) for n in result[0]["shared"]}
        for block, names in result[0]["layers"].items():
            full = {n: (torch.cat([r["layers"][block][n] for r in result]) if n.startswith("experts.")
                        else sum(r["layers"][block][n] for r in result)) for n in names}
            prefix = block.rpartition(".")[0] if entry.in_decoder else block   # Gemma 4: named from the decoder
            grads.update({f"{prefix}.{k}": v for k, v in hf_moe.layer_to_hf(entry, full, partial=True).items()})
        scale = largest_grad(model)
        for name, param in model.named_parameters():
            if param.grad is not None:
                assert_grad_close(grads[name], param.grad, scale, f"{family} grad of {name}")
        loaded = type(model).from_pretrained(tmp_path / family)
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), f"{family} exported {name}"


def test_unsupported_model_type_lists_every_supported_type():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    supported = hf_moe.families.supported_model_types()
    assert set(ALL) <= set(supported) and set(hf_moe.families.COMPOSITES) <= set(supported)
    for call in (lambda: hf_moe.swap_moe_blocks(model), lambda: hf_moe.export_hf(model, "unused"),
                 lambda: hf_moe.moe_config(config)):
        with pytest.raises(ValueError, match="model_type='llama'") as error:
            call()
        assert str(error.value).endswith("supported model_type values: " + ", ".join(supported))
    with pytest.raises(ValueError, match="Linear with no .config"):
        hf_moe.swap_moe_blocks(torch.nn.Linear(2, 2))


# config values a family's layer cannot compute: (family, config fields, the key and value the error names)
UNCOMPUTABLE = [
    ("dbrx", dict(ffn_config=dict(ffn_hidden_size=28, moe_num_experts=6, moe_top_k=3,
                                  ffn_act_fn={"name": "gelu_new"})), "ffn_config.ffn_act_fn='gelu_new'"),
    ("dbrx", dict(ffn_config=dict(ffn_hidden_size=28, moe_num_experts=6, moe_top_k=3,
                                  moe_normalize_expert_weights=2.0)), "ffn_config.moe_normalize_expert_weights=2.0"),
    ("cohere2_moe", dict(shared_expert_combination_strategy="average"), "shared_expert_combination_strategy='average'"),
    ("hunyuan_v1_moe", dict(num_experts_per_tok=[3, 2]), r"moe_topk=\[3, 2\]"),
    ("ernie4_5_moe", dict(moe_norm_min=0.9), "moe_norm_min=0.9"),
    # families_special.py (helper "features")
    ("llama4_text", dict(num_experts_per_tok=2), "num_experts_per_tok=2"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("nemotron_h", dict(mlp_hidden_act="gelu_new"), "mlp_hidden_act='gelu_new'"),
    ("nemotron_h", dict(moe_latent_size=16), "moe_latent_size=16"),
    ("nemotron_h", dict(mlp_bias=True), "mlp_bias=True"),
    ("deepseek_v4", dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    ("deepseek_v4", dict(n_shared_experts=2), "n_shared_experts=2"),
    ("deepseek_v4", dict(mlp_bias=True), "mlp_bias=True"),
    ("gemma4_text", dict(hidden_activation="gelu_new"), "hidden_activation='gelu_new'"),
]


@pytest.mark.parametrize("family,fields,named", [case for case in UNCOMPUTABLE if case[0] in ALL])
def test_config_values_the_layer_cannot_compute_are_refused_naming_key_and_value(family, fields, named):
    config = text_config(family, **fields)
    with pytest.raises(ValueError, match=f"{family}: {named} is not supported by the MoE layer; supported: "):
        hf_moe.moe_config(config)


@pytest.mark.parametrize("family", [f for f in ALL if f not in ("lfm2_moe", "dbrx", "gpt_oss", "nemotron_h",
                                                                 "gemma4_text")])
def test_an_unknown_hidden_act_is_refused_naming_it(family):
    """(LFM2-MoE's and gpt-oss's experts ignore hidden_act; DBRX's activation is ffn_config.ffn_act_fn,
    Nemotron-H's mlp_hidden_act: both in UNCOMPUTABLE.)"""
    config = text_config(family, hidden_act="gelu_new")
    with pytest.raises(ValueError, match=f"{family}: hidden_act='gelu_new' is not supported by the MoE layer"):
        hf_moe.swap_moe_blocks(model_for_errors(config))


def model_for_errors(config):
    """A stand-in holding only the config: the error comes before any block is looked at."""
    holder = torch.nn.Module()
    holder.config = config
    return holder


def test_composite_models_are_found_through_their_text_configs():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    for composite, members in hf_moe.families.COMPOSITES.items():
        found = hf_moe.families.families_in(CONFIG_MAPPING[composite]())
        assert [family.model_type for family, _ in found] == list(members), composite
        assert all(config.model_type == family.model_type for family, config in found)


def test_readme_lists_exactly_the_supported_model_types():
    text = README.read_text()
    between = text.split(MARKERS[0], 1)[1].split(MARKERS[1], 1)[0]
    assert between == hf_moe.families.supported_model_types_markdown()
