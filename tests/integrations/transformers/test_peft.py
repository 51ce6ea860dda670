"""PEFT's LoRA on HF's experts through the "moe_plugin" experts backend, against PEFT's own path on HF's grouped_mm
experts: the same loss and the same adapter gradients (fp32, 1e-5), with the backend reading PEFT's A and B (PEFT's
merged weight W + s B A is never formed)."""
import copy

import pytest
import torch

from helpers.compare import relative_error
from helpers.hf import build_model, needs_transformers, tokens

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[lora])")
from peft.tuners.lora import layer as peft_layer  # noqa: E402

pytestmark = [needs_transformers, pytest.mark.timeout(300)]
FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
TOL = 1e-5
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_config(**extra):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=EXPERTS,
                           init_lora_weights=False, **extra)    # B random too: every factor gets a gradient


class MergedWeights:
    """Counts PEFT's merged weights formed (its factors proxy's forward giving W + s lhs rhs, a new tensor)."""

    def __init__(self, monkeypatch):
        self.count = 0
        forward = peft_layer._LoraFactorsProxy.forward

        def counted(proxy, W):
            merged = forward(proxy, W)
            self.count += merged is not W
            return merged
        monkeypatch.setattr(peft_layer._LoraFactorsProxy, "forward", counted)


def peft_model(model, implementation, seed):
    model = copy.deepcopy(model)
    model.set_experts_implementation(implementation)
    torch.manual_seed(seed)       # the same adapter draws on both sides
    return peft.get_peft_model(model, lora_config())


def loss_and_adapter_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_backend_reads_peft_factors_with_peft_loss_and_gradients(family, monkeypatch, fresh_seed):
    model = build_model(family, seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    theirs = peft_model(model, "grouped_mm", fresh_seed)
    ours = peft_model(model, "moe_plugin", fresh_seed)
    expert_adapters = [n for n, _ in ours.named_parameters() if "experts" in n and "lora_" in n]
    assert len(expert_adapters) >= 4, "PEFT targeted no expert"
    ids = tokens(fresh_seed)

    # torch's register_parametrization evaluates the proxy once as a dtype/shape check when PEFT registers it (each
    # forward); PEFT's own path forms the merged weight there and once more for the GEMMs; ours answers the check
    # with W itself (peft.answer_shape_checks_cheaply) and never forms it
    merged = MergedWeights(monkeypatch)
    loss, grads = loss_and_adapter_grads(theirs, ids)
    wrapped = sum(1 for m in ours.modules() if type(m).__name__ == "ParamWrapper")
    assert merged.count == 2 * wrapped, "PEFT's own path changed: this test no longer shows what ours saves"
    merged.count = 0
    our_loss, our_grads = loss_and_adapter_grads(ours, ids)
    assert merged.count == 0, "the backend formed PEFT's merged weight"

    assert relative_error(our_loss, loss) <= TOL
    assert set(our_grads) == set(grads)
    assert all("lora_" in n for n in grads), "a base weight trains"
    errors = {n: relative_error(our_grads[n], grads[n]) for n in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst} off by {errors[worst]:.3g}"
    assert all(grads[n].abs().max() > 0 for n in expert_adapters)


def test_backend_merge_and_unload_gives_a_plain_model(fresh_seed):
    model = build_model("mixtral", seed=fresh_seed % 1000, experts_implementation="moe_plugin")
    ours = peft_model(model, "moe_plugin", fresh_seed)
    ids = tokens(fresh_seed)
    with torch.no_grad():
        logits = ours(ids).logits
        plain = ours.merge_and_unload()
        assert not any("lora_" in n for n, _ in plain.named_parameters())
        assert type(plain) is type(model)
        torch.testing.assert_close(plain(ids).logits, logits, rtol=1e-5, atol=1e-5)


def peft_wrappers(peft_model, block_name):
    """{parameter name: PEFT's ParamWrapper} of the experts of block_name (PEFT nests one wrapper per parameter)."""
    module, found = peft_model.get_submodule(f"base_model.model.{block_name}.experts"), {}
    while type(module).__name__ == "ParamWrapper":
        found[module.parameter_name] = module
        module = module.base_layer
    return found


PAIRS = {"gate_up_proj": ("up_a_EDQ", "up_b_EQF"), "down_proj": ("down_a_EHQ", "down_b_EQD")}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_swapped_layer_lora_with_peft_factors_equals_peft(family, fresh_seed):
    """The in-layer adapter (moe_plugin.lora) given PEFT's factors (from_peft) computes PEFT's function: same loss,
    same adapter gradients (mapped back with to_peft) as PEFT's own path on the unswapped model."""
    import moe_plugin.integrations.transformers as hf_moe
    from moe_plugin.integrations.transformers.peft import from_peft, to_peft
    from moe_plugin.lora import add_lora

    model = build_model(family, seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    torch.manual_seed(fresh_seed)
    theirs = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=8, target_parameters=EXPERTS, init_lora_weights=False))
    ours = hf_moe.swap_moe_blocks(copy.deepcopy(model))
    for param in ours.parameters():
        param.requires_grad_(False)
    adapters = add_lora(ours, rank=4, alpha=8)
    blocks = {n: m for n, m in ours.named_modules() if isinstance(m, hf_moe.HFMoEBlock)}
    assert len(adapters) == len(blocks) > 0
    with torch.no_grad():
        for name, block in blocks.items():
            E = block.moe.experts.w1_EDH.shape[0]
            for param, wrapper in peft_wrappers(theirs, name).items():
                a, b = from_peft(wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight, E)
                assert torch.equal(to_peft(a, b)[0], wrapper.lora_A["default"].weight)
                assert torch.equal(to_peft(a, b)[1], wrapper.lora_B["default"].weight)
                getattr(block.moe.experts.lora, PAIRS[param][0]).copy_(a)
                getattr(block.moe.experts.lora, PAIRS[param][1]).copy_(b)
    ids = tokens(fresh_seed)
    loss, grads = loss_and_adapter_grads(theirs, ids)
    our_loss, _ = loss_and_adapter_grads(ours, ids)
    assert relative_error(our_loss, loss) <= TOL
    for name, block in blocks.items():
        lora = block.moe.experts.lora
        for param, wrapper in peft_wrappers(theirs, name).items():
            a, b = (getattr(lora, n).grad for n in PAIRS[param])
            grad_A, grad_B = to_peft(a, b)
            assert relative_error(grad_A, wrapper.lora_A["default"].weight.grad) <= TOL, (name, param, "A")
            assert relative_error(grad_B, wrapper.lora_B["default"].weight.grad) <= TOL, (name, param, "B")
    assert set(grads) == {n for n, _ in theirs.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("family,router", [("mixtral", "mlp.gate.weight"), ("gpt_oss", "mlp.router.weight")])
def test_backend_with_peft_lora_on_the_router_too_equals_peft(family, router, fresh_seed):
    """The backend leaves HF's router to HF and PEFT (its ParamWrapper on the [E, D] weight); the experts' factors
    still go the grouped path: same loss and adapter gradients as PEFT on grouped_mm, the router's included."""
    model = build_model(family, seed=fresh_seed % 1000, experts_implementation="grouped_mm")
    sides = []
    for implementation in ("grouped_mm", "moe_plugin"):
        copied = copy.deepcopy(model)
        copied.set_experts_implementation(implementation)
        torch.manual_seed(fresh_seed)
        sides.append(peft.get_peft_model(copied, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=EXPERTS + [router],
            init_lora_weights=False)))
    ids = tokens(fresh_seed)
    (loss, grads), (our_loss, our_grads) = (loss_and_adapter_grads(side, ids) for side in sides)
    routers = [n for n in grads if router.rpartition(".")[0] + ".lora_" in n]
    assert routers and all(grads[n].abs().max() > 0 for n in routers)
    assert relative_error(our_loss, loss) <= TOL
    assert set(our_grads) == set(grads)
    assert max(relative_error(our_grads[n], grads[n]) for n in grads) <= TOL


def test_reading_the_experts_weight_on_the_backend_still_gives_peft_merged_weight(fresh_seed):
    """Only torch's registration check gets W itself: code reading the parametrized weight inside PEFT's forward
    (here, a forward pre-hook on the experts) gets W + s B A, as PEFT defines it."""
    model = build_model("mixtral", seed=fresh_seed % 1000, experts_implementation="moe_plugin")
    ours = peft_model(model, "moe_plugin", fresh_seed)
    experts = ours.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    wrapper = peft_wrappers(ours, "model.layers.0.mlp")["gate_up_proj"]
    seen = []
    experts.register_forward_pre_hook(lambda module, args: seen.append(module.gate_up_proj.detach().clone()))
    with torch.no_grad():
        ours(tokens(fresh_seed))
        stored = experts.parametrizations["gate_up_proj"].original if hasattr(experts, "parametrizations") else \
            experts.gate_up_proj
        expected = stored + wrapper.get_delta_weight("default")
    assert seen and not torch.equal(seen[0], stored)
    torch.testing.assert_close(seen[0], expected, rtol=1e-6, atol=1e-6)
