"""PEFT on upcycled models, and target_parameters by the layer's own names on swapped models.

Upcycled blocks are the blocks swap_moe_blocks builds, with HF's names for PEFT: a gated upcycling (llama) shows
Mixtral's (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight), which export_hf writes. References:
plain PEFT on the Mixtral folder export_hf writes of the same upcycled model (HF's own blocks computing the same
function), for attention-only and for expert and router targets: loss and every adapter gradient (fp32, 1e-5);
adapters saved from the upcycled model load with PeftModel.from_pretrained onto another upcycled copy and onto the
exported Mixtral (same logits). A non-gated upcycling (ViT's fc1 / fc2) shows mlp.experts.up_proj / down_proj: at step 0 (identical
experts, normalized gates, dropless) LoRA with the same factors in every expert computes what plain PEFT's LoRA on
the dense MLP computes, each dense adapter gradient the sum of its experts'.
target_parameters naming the layer's own tensors (moe.experts.w1_EDH) is refused by get_peft_model, naming HF's."""
import copy

import pytest
import torch

from helpers.compare import relative_error
from helpers.hf import loss_and_grads, needs_transformers, trainable, transformers

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[lora])")
import moe_plugin.integrations.transformers as hf_moe  # noqa: E402

pytestmark = [needs_transformers, pytest.mark.timeout(300)]
TOL = 1e-5
DECODER = dict(vocab_size=61, hidden_size=24, intermediate_size=36, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def upcycled_llama(seed, tmp_path):
    """An upcycled tiny llama (experts made different by noise) and HF's Mixtral loaded from its export_hf folder."""
    torch.manual_seed(seed)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))
    model = hf_moe.upcycle(dense, num_experts=4, top_k=2, noise=0.3)
    hf_moe.export_hf(model, tmp_path / "mixtral")
    mixtral = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral", experts_implementation="eager")
    assert mixtral.config.model_type == "mixtral"
    return model, mixtral


def ids(seed):
    return torch.randint(0, DECODER["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(seed))


def same_adapters(ours, theirs):
    """Copies theirs' adapter values into ours (same names, same shapes)."""
    mine = trainable(ours)
    assert set(mine) == set(trainable(theirs)) and all("lora_" in n for n in mine)
    with torch.no_grad():
        for name, param in trainable(theirs).items():
            mine[name].copy_(param)


def assert_same_training(ours, theirs, x):
    loss, grads = loss_and_grads(theirs, x)
    our_loss, our_grads = loss_and_grads(ours, x)
    assert relative_error(our_loss, loss) <= TOL
    errors = {n: relative_error(our_grads[n], grads[n]) for n in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst} off by {errors[worst]:.3g}"


@pytest.mark.parametrize("targets", [
    dict(target_modules=["q_proj"]),
    dict(target_modules=["q_proj"], target_parameters=EXPERTS),
    dict(target_modules=["o_proj"], target_parameters=EXPERTS + ["mlp.gate.weight"]),
], ids=["attention", "experts", "experts+router"])
def test_peft_on_an_upcycled_model_equals_peft_on_its_mixtral(targets, fresh_seed, tmp_path):
    model, mixtral = upcycled_llama(fresh_seed % 1000, tmp_path)
    config = dict(r=4, lora_alpha=8, init_lora_weights=False, **targets)
    theirs = peft.get_peft_model(mixtral, peft.LoraConfig(**config))
    ours = peft.get_peft_model(model, peft.LoraConfig(**config))
    same_adapters(ours, theirs)
    if "target_parameters" in targets:
        assert any(".mlp.experts." in n for n in trainable(ours))
    assert_same_training(ours, theirs, ids(fresh_seed))


def test_adapters_of_an_upcycled_model_load_with_from_pretrained(fresh_seed, tmp_path):
    model, mixtral = upcycled_llama(fresh_seed % 1000, tmp_path)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj"],
                             target_parameters=EXPERTS + ["mlp.gate.weight"])
    ours = peft.get_peft_model(copy.deepcopy(model), config)
    ours.save_pretrained(tmp_path / "adapter")
    x = ids(fresh_seed)
    with torch.no_grad():
        want = ours(x).logits
        assert relative_error(want, model(x).logits) > 1e-3      # the adapter changes the output
        for base in (model, mixtral):
            loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
            torch.testing.assert_close(loaded(x).logits, want, rtol=1e-5, atol=1e-5)


def test_peft_on_a_non_gated_upcycling_equals_peft_on_the_dense_mlp(fresh_seed):
    torch.manual_seed(fresh_seed % 1000)
    config = transformers.ViTConfig(image_size=12, patch_size=4, hidden_size=20, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=28, num_labels=3)
    dense = transformers.ViTForImageClassification(config)
    E = 4
    upcycled = hf_moe.upcycle(copy.deepcopy(dense), num_experts=E, top_k=2)
    theirs = peft.get_peft_model(dense, peft.LoraConfig(r=3, lora_alpha=6, init_lora_weights=False,
                                                        target_modules=["mlp.fc1", "mlp.fc2"]))
    ours = peft.get_peft_model(upcycled, peft.LoraConfig(
        r=3, lora_alpha=6, init_lora_weights=False,
        target_parameters=["mlp.experts.up_proj", "mlp.experts.down_proj"]))
    pairs = {}   # our adapter tensor -> (the dense adapter tensor it copies, "A" or "B")
    for name, module in ours.named_modules():
        if type(module).__name__ == "ParamWrapper":
            layer = name.split(".layers.")[1].split(".")[0]
            projection = {"up_proj": "fc1", "down_proj": "fc2"}[module.parameter_name]
            for factor in "AB":
                pairs[f"{name}.lora_{factor}.default.weight"] = (
                    f"base_model.model.vit.layers.{layer}.mlp.{projection}.lora_{factor}.default.weight",
                    factor)
    assert sorted(pairs) == sorted(trainable(ours)) and len(pairs) == 8
    dense_params = trainable(theirs)
    with torch.no_grad():   # every expert holds the dense adapter (from_peft's layout: A by rows, B by columns)
        for name, (dense_name, factor) in pairs.items():
            value = dense_params[dense_name]
            trainable(ours)[name].copy_(value.repeat(E, 1) if factor == "A" else value.repeat_interleave(E, dim=1))
    x = torch.randn(3, 3, 12, 12)
    want, got = theirs(pixel_values=x).logits, ours(pixel_values=x).logits
    assert relative_error(got, want) <= TOL
    want.square().sum().backward()
    got.square().sum().backward()
    for name, (dense_name, factor) in pairs.items():
        grad = trainable(ours)[name].grad
        summed = grad.reshape(E, -1, grad.shape[-1]).sum(0) if factor == "A" else \
            grad.reshape(grad.shape[0], -1, E).sum(-1)
        assert relative_error(summed, dense_params[dense_name].grad) <= TOL, name


@pytest.mark.parametrize("target", ["moe.experts.w1_EDH", "mlp.moe.experts.w2_EHD", "moe.router.weight_ED"])
def test_target_parameters_by_the_layer_names_are_refused_naming_hf_names(target, fresh_seed):
    """Plain PEFT on HF's Mixtral finds no such parameter; on the swapped model PEFT found it and failed at the
    first forward ('ParamWrapper' object has no attribute 'parameter_dtype'): refused by get_peft_model."""
    model = hf_moe.swap_moe_blocks(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2)))
    with pytest.raises(ValueError) as caught:
        peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=[target]))
    message = str(caught.value)
    assert "\n" not in message and target in message
    for hf_name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):
        assert hf_name in message
    upcycled = hf_moe.upcycle(transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER)), 4, 2)
    with pytest.raises(ValueError, match="mlp.experts.gate_up_proj"):
        peft.get_peft_model(upcycled, peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=[target]))
