"""PEFT's LoRA with HF's parameter names on swapped models: get_peft_model after swap_moe_blocks, and swap_moe_blocks
after get_peft_model, both target the layer's experts (through the block's HF-named handle) and give PEFT's own
loss and adapter gradients on the unswapped model (fp32, 1e-5; gpt-oss's gradients in fp64, see gradient_model);
adapters saved either side load on the other."""
import copy

import pytest
import torch

from helpers.compare import relative_error
from helpers.hf import build_model, loss_and_grads, needs_transformers, tokens, trainable, transformers

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[lora])")
import moe_plugin.integrations.transformers as hf_moe  # noqa: E402

pytestmark = [needs_transformers, pytest.mark.timeout(300)]
FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
TOL = 1e-5


def gradient_model(family, seed):
    """The family's model for the gradient comparisons. gpt-oss's is fp64: its clamp at swiglu_limit (0.05 in
    helpers.hf, so that it acts) puts about two thirds of the expert pre-activations past the limit, where the
    gradient jumps to zero, and the two paths' fp32 roundings (~1e-7 apart) can put one value on either side of it
    (MOE_TEST_SEED=2019486295: one 2e-7 from the limit, a 0.17 error in an adapter's gradient). fp64 roundings are
    ~1e-16 apart. HF's grouped_mm has no fp64 kernel, so HF's experts run eager there."""
    if family == "gpt_oss":
        return build_model(family, seed=seed % 1000, dtype=torch.float64, experts_implementation="eager")
    return build_model(family, seed=seed % 1000, experts_implementation="grouped_mm")


def lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def assert_same_training(ours, theirs, ids):
    assert set(trainable(ours)) == set(trainable(theirs))
    assert any(".mlp.experts." in n for n in trainable(ours)), "PEFT targeted no expert"
    assert all("lora_" in n for n in trainable(ours)), "a base weight trains"
    loss, grads = loss_and_grads(theirs, ids)
    our_loss, our_grads = loss_and_grads(ours, ids)
    assert relative_error(our_loss, loss) <= TOL
    errors = {n: relative_error(our_grads[n], grads[n]) for n in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst} off by {errors[worst]:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_get_peft_model_after_swap_targets_the_layer_experts(family, fresh_seed):
    model = gradient_model(family, fresh_seed)
    theirs = peft.get_peft_model(copy.deepcopy(model), lora_config())
    ours = peft.get_peft_model(hf_moe.swap_moe_blocks(copy.deepcopy(model)), lora_config())
    assert isinstance(ours.base_model.model.model.layers[-1].mlp, hf_moe.HFMoEBlock)
    mine = trainable(ours)
    with torch.no_grad():       # the same adapter values (same names and shapes on both sides)
        for name, param in trainable(theirs).items():
            mine[name].copy_(param)
    assert_same_training(ours, theirs, tokens(fresh_seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_swap_after_get_peft_model_keeps_the_adapters(family, fresh_seed):
    model = gradient_model(family, fresh_seed)
    theirs = peft.get_peft_model(copy.deepcopy(model), lora_config())
    ours = hf_moe.swap_moe_blocks(copy.deepcopy(theirs))
    assert isinstance(ours.base_model.model.model.layers[-1].mlp, hf_moe.HFMoEBlock)
    assert_same_training(ours, theirs, tokens(fresh_seed))


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_adapters_load_across_swapped_and_unswapped_models(family, fresh_seed, tmp_path):
    model = build_model(family, seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    ids = tokens(fresh_seed)
    swapped = peft.get_peft_model(hf_moe.swap_moe_blocks(copy.deepcopy(model)), lora_config())
    swapped.save_pretrained(tmp_path / "from_swapped")
    plain = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "from_swapped")
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, swapped(ids).logits, rtol=1e-5, atol=1e-5)

    unswapped = peft.get_peft_model(copy.deepcopy(model), lora_config())
    unswapped.save_pretrained(tmp_path / "from_hf")
    loaded = peft.PeftModel.from_pretrained(hf_moe.swap_moe_blocks(copy.deepcopy(model)), tmp_path / "from_hf")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, unswapped(ids).logits, rtol=1e-5, atol=1e-5)


def test_merge_and_unload_on_a_swapped_model_gives_plain_hf_folders(fresh_seed, tmp_path):
    model = build_model("mixtral", seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    ids = tokens(fresh_seed)
    theirs = peft.get_peft_model(copy.deepcopy(model), lora_config())
    ours = peft.get_peft_model(hf_moe.swap_moe_blocks(copy.deepcopy(model)), lora_config())
    with torch.no_grad():
        mine = trainable(ours)
        for name, param in trainable(theirs).items():
            mine[name].copy_(param)
        merged = ours.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        merged.save_pretrained(tmp_path / "merged")           # HF's names (swap_moe_blocks' save_pretrained)
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert not any(isinstance(m, hf_moe.HFMoEBlock) for m in plain.modules())
        expected = theirs.merge_and_unload()(ids).logits
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_of_an_interleaved_adapter_on_a_swapped_layer_is_exact(safe_merge, fresh_seed, tmp_path):
    """gpt-oss interleaves gate and up; the layer keeps [gate | up]: PEFT's merge (and unmerge) of B's HF-ordered
    columns lands on the layer's columns, so merged, unmerged and merge_and_unload() compute PEFT's own merged model."""
    model = build_model("gpt_oss", seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    ids = tokens(fresh_seed)
    ours = peft.get_peft_model(hf_moe.swap_moe_blocks(copy.deepcopy(model)), lora_config())
    theirs = peft.get_peft_model(copy.deepcopy(model), lora_config())
    with torch.no_grad():
        mine = trainable(ours)
        for name, param in trainable(theirs).items():
            mine[name].copy_(param)
        expected = ours(ids).logits
        weights = [p.clone() for p in ours.base_model.model.model.layers[0].mlp.moe.experts.parameters()]
        ours.base_model.merge_adapter(safe_merge=safe_merge)
        torch.testing.assert_close(ours(ids).logits, expected, rtol=1e-5, atol=1e-5)
        ours.base_model.unmerge_adapter()
        for before, after in zip(weights, ours.base_model.model.model.layers[0].mlp.moe.experts.parameters()):
            torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours(ids).logits, expected, rtol=1e-5, atol=1e-5)
        merged = ours.merge_and_unload(safe_merge=safe_merge)
        torch.testing.assert_close(merged(ids).logits, theirs.merge_and_unload()(ids).logits, rtol=1e-5, atol=1e-5)
        merged.save_pretrained(tmp_path / "merged")
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_swapped_state_dict_and_parameters_are_unchanged_by_the_handle():
    model = build_model("mixtral", seed=1)
    swapped = hf_moe.swap_moe_blocks(copy.deepcopy(model))
    names = [n for n, _ in swapped.named_parameters()]
    assert not any(".mlp.experts." in n for n in names) and len(names) == len(set(names))
    assert not any(".mlp.experts." in k for k in swapped.state_dict())
    block = swapped.model.layers[0].mlp
    assert list(block.experts.named_parameters(recurse=False)) == []     # FSDP2 and DeepSpeed walk modules so
    assert block.experts.gate_up_proj is block.moe.experts.w1_EDH         # (PEFT alone sees HF's names)
    assert block.experts.down_proj is block.moe.experts.w2_EHD


def test_peft_and_add_lora_on_the_same_experts_is_an_error(fresh_seed):
    from moe_plugin.lora import add_lora
    model = build_model("mixtral", seed=fresh_seed % 1000)
    ours = peft.get_peft_model(hf_moe.swap_moe_blocks(model), lora_config())
    add_lora(ours, rank=2)
    with pytest.raises(ValueError, match="use one of them"):
        ours(tokens(fresh_seed))


def test_peft_wrappers_on_experts_the_swapped_layer_lacks_are_an_error():
    from moe_plugin.integrations.transformers.peft import attach_wrappers, detach_wrappers
    model = build_model("mixtral", seed=1)
    theirs = peft.get_peft_model(copy.deepcopy(model), lora_config())
    hf_block = theirs.base_model.model.model.layers[0].mlp
    wrappers = detach_wrappers(hf_block)
    assert type(hf_block.experts).__name__ == "MixtralExperts"
    swapped = hf_moe.swap_moe_blocks(copy.deepcopy(model)).model.layers[0].mlp
    assert list(wrappers) == ["experts"]
    wrappers["experts"][0].parameter_name = "w3"        # a parameter HF's Mixtral experts do not have
    with pytest.raises(ValueError, match="experts.w3, which the swapped layer does not hold"):
        attach_wrappers(swapped, wrappers)
    del swapped.experts
    with pytest.raises(TypeError, match="no HF-named experts"):
        attach_wrappers(swapped, wrappers)
    with pytest.raises(TypeError, match="targets the HF block's norm, which the swapped"):
        attach_wrappers(swapped, {"norm": wrappers["experts"]})


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_adapters_under_deepspeed_blocks_save_with_peft_and_file_per_expert(family, fresh_seed, tmp_path):
    """Under DeepSpeed's MoE blocks (which rename state keys holding "expert" for its checkpoint files), PEFT's save
    holds the experts' adapters and loads on a swapped model and, with plain PEFT, on HF's own; the block's own
    state dict (DeepSpeed's per-expert files) holds one slice of them per expert and loads back."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e .[deepspeed])")
    from moe_plugin.integrations.deepspeed.hf import use_deepspeed_blocks
    model = build_model(family, seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    ids = tokens(fresh_seed)
    swapped = peft.get_peft_model(use_deepspeed_blocks(hf_moe.swap_moe_blocks(copy.deepcopy(model))), lora_config())
    swapped.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    expert_keys = [k for k in saved if ".mlp.experts." in k]
    assert len(expert_keys) == 4 * len(swapped.base_model.model.model.layers), sorted(saved)
    with torch.no_grad():
        expected = swapped(ids).logits
        plain = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter")
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-5, atol=1e-5)
        fresh = use_deepspeed_blocks(hf_moe.swap_moe_blocks(copy.deepcopy(model)))
        loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)

        block = swapped.base_model.model.model.layers[0].mlp
        state = block.state_dict()
        assert not [k for k in state if k.startswith("experts.")], list(state)
        slices = [k for k in state if k.startswith("deepspeed_moe.experts.deepspeed_experts.0.peft.")]
        assert len(slices) == 4, list(state)
        other = loaded.base_model.model.model.layers[0].mlp
        for param in other.experts.parameters():
            param.zero_()
        other.load_state_dict(state)
        mine = dict(block.experts.named_parameters())
        assert all(torch.equal(p, mine[n]) for n, p in other.experts.named_parameters()) and mine


ROUTERS = {"mixtral": "mlp.gate.weight", "qwen3_moe": "mlp.gate.weight", "gpt_oss": "mlp.router.weight",
           "deepseek_v3": "mlp.gate.weight"}


def router_lora_config(family, by_module=False):
    """LoRA on the experts, the attention output and the router: by HF's parameter name, or (by_module) by the
    router module's name, which PEFT turns into that parameter name for the families it converts (mixtral)."""
    if by_module:
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "gate"], init_lora_weights=False,
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", ROUTERS[family]])


def router_adapters(model):
    names = [n for n in trainable(model) if (".mlp.gate." in n or ".mlp.router." in n) and "lora_" in n]
    assert names, "PEFT targeted no router"
    return names


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_on_the_router_of_a_swapped_model_equals_peft(family, fresh_seed):
    model = gradient_model(family, fresh_seed)
    theirs = peft.get_peft_model(copy.deepcopy(model), router_lora_config(family))
    ours = peft.get_peft_model(hf_moe.swap_moe_blocks(copy.deepcopy(model)), router_lora_config(family))
    with torch.no_grad():
        mine = trainable(ours)
        for name, param in trainable(theirs).items():
            mine[name].copy_(param)
    names = router_adapters(ours)
    assert_same_training(ours, theirs, tokens(fresh_seed))
    assert all(ours.get_parameter(n).grad.abs().max() > 0 for n in names)
    for block in (m for m in ours.modules() if isinstance(m, hf_moe.HFMoEBlock)):   # the weight is back
        assert isinstance(block.moe.router.weight_ED, torch.nn.Parameter)
        assert not block.moe.router.weight_ED.requires_grad


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_swap_after_peft_lora_on_the_router_keeps_it(family, fresh_seed):
    model = gradient_model(family, fresh_seed)
    theirs = peft.get_peft_model(copy.deepcopy(model), router_lora_config(family))
    ours = hf_moe.swap_moe_blocks(copy.deepcopy(theirs))
    router_adapters(ours)
    assert_same_training(ours, theirs, tokens(fresh_seed))


def test_router_adapter_by_module_name_and_across_save_load(fresh_seed, tmp_path):
    """target_modules=["gate"] (PEFT's own conversion to the router's weight) on a swapped mixtral; the adapters saved
    there load with plain PEFT onto the unswapped model and give the same logits, and with the router adapter
    disabled both give the unadapted model's."""
    model = build_model("mixtral", seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    ids = tokens(fresh_seed)
    swapped = peft.get_peft_model(hf_moe.swap_moe_blocks(copy.deepcopy(model)), router_lora_config("mixtral", True))
    router_adapters(swapped)
    swapped.save_pretrained(tmp_path / "adapters")
    plain = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapters")
    with torch.no_grad():
        torch.testing.assert_close(swapped(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
        with swapped.disable_adapter():
            torch.testing.assert_close(swapped(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_peft_lora_dropout_on_the_experts_is_refused_on_swapped_models():
    """PEFT refuses lora_dropout on expert parameters (its ParamWrapper cannot drop the input of the low-rank term
    alone); on a swapped model its error stands, before any forward."""
    model = hf_moe.swap_moe_blocks(build_model("mixtral", seed=0, experts_implementation="grouped_mm"))
    config = peft.LoraConfig(r=4, lora_dropout=0.1, target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(ValueError, match="lora_dropout"):
        peft.get_peft_model(model, config)
