"""upcycle (integrations/transformers/upcycle.py) and the export of upcycled models (upcycle_export.py).

References: the dense HF model itself (step 0 of an exact upcycling computes what it computes, outputs and
gradients), a one-process run (expert parallelism), plain from_pretrained of the exported folder.
What this module tests (moved here from the README):

Tested (tests/integrations/transformers/test_upcycle.py): step 0 equals the dense model in outputs and gradients for
llama (with and without biases, and with gated exact and tanh GELU as Gemma's MLP), qwen2, mistral, vit and
swinv2 (fp64, some layers upcycled, top-3 of 5);
the Swin numbering and the pair replacement; noise statistics, the reinitialised units, fraction 1.0, the
router's init; every bad input above; drops, aux loss, expert-bias balancing and a state_dict round trip;
adaptive capacity (capacity_factor < 0) against a by-hand capacity, drop count and reference_moe;
the DeepSpeed block class; export per family (mixtral from llama and mistral, qwen2_moe from qwen2 with
dense layers in between, and the generic folder for a partly upcycled llama, a llama with biases, a
tanh-GeGLU llama, a cosine-router llama, a sliding-window qwen2, vit and swinv2: loaded outputs equal the
model's); slow: ep_size 2 on 2 gloo processes equals one process (outputs, expert gradients), a DeepSpeed
engine (ZeRO-1, "moe" section, ep_size 2) trains the result, a "moe" section contradicting the upcycled blocks
(num_experts, top_k, min_capacity, a misspelled key) raises naming the key, and save_checkpoint /
load_checkpoint into an engine of other weights gives the same logits and next-step loss.
"""
import copy
import math
import os
import warnings

import pytest
import torch

import moe_plugin
from moe_plugin.integrations.transformers import HFMoEBlock, export_hf, mlp_sites, upcycle
from moe_plugin.integrations.transformers.upcycle import upcycled_blocks
from moe_plugin.integrations.transformers.upcycle_export import EXPERTS_FILE, load_upcycled, moe_family_target
from helpers.hf import needs_transformers, transformers
from helpers.launch import run_workers

pytestmark = needs_transformers

DECODER = dict(vocab_size=61, hidden_size=24, intermediate_size=36, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = ["llama", "llama_bias", "qwen2", "mistral", "vit", "swinv2"]
GATED_GELU = {"llama_geglu": "gelu", "llama_geglu_tanh": "gelu_pytorch_tanh"}   # Gemma's MLP: gelu_pytorch_tanh


def dense_model(family: str, **extra):
    """A tiny random dense HF model and its inputs (as keyword arguments)."""
    if family in GATED_GELU:
        return dense_model("llama", hidden_act=GATED_GELU[family], **extra)
    if family == "qwen2_sliding":   # a window of 4 tokens in layers 2 and 3 (qwen2: layers >= max_window_layers)
        return dense_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2, **extra)
    if family in ("llama", "llama_bias", "qwen2", "mistral"):
        model_type = "llama" if family == "llama_bias" else family
        more = dict(mlp_bias=True, attention_bias=True) if family == "llama_bias" else {}
        config = transformers.AutoConfig.for_model(model_type, **{**DECODER, **more, **extra})
        model = transformers.AutoModelForCausalLM.from_config(config)
        return model, lambda: {"input_ids": torch.randint(0, 61, (2, 11))}
    if family == "vit":
        config = transformers.ViTConfig(image_size=12, patch_size=4, hidden_size=20, num_hidden_layers=3,
                                        num_attention_heads=2, intermediate_size=28, num_labels=3, **extra)
        model = transformers.ViTForImageClassification(config)
        return model, lambda: {"pixel_values": torch.randn(3, 3, 12, 12)}
    config = transformers.Swinv2Config(image_size=16, patch_size=2, embed_dim=8, depths=[2, 2, 4], num_heads=[1, 2, 2],
                                       window_size=2, num_labels=3, **extra)
    model = transformers.Swinv2ForImageClassification(config)
    return model, lambda: {"pixel_values": torch.randn(2, 3, 16, 16)}


def out(model, inputs):
    return model(**inputs).logits


def dense_grads(site, kind):
    """The dense MLP's weight gradients in the layer's layout (w1 [D, H or 2H], b1, w2 [H, D], b2)."""
    if kind == "gated":
        first, up, last = site.gate_proj, site.up_proj, site.down_proj
    elif kind == "plain":
        first, up, last = site.fc1, None, site.fc2
    else:
        first, up, last = site.intermediate.dense, None, site.output.dense
    firsts = [first] if up is None else [first, up]
    grads = {"w1_EDH": torch.cat([lin.weight.grad.t() for lin in firsts], dim=1), "w2_EHD": last.weight.grad.t()}
    if first.bias is not None:
        grads.update(b1_EH=torch.cat([lin.bias.grad for lin in firsts]), b2_ED=last.bias.grad)
    return grads


@pytest.mark.parametrize("family", FAMILIES + list(GATED_GELU))
def test_step0_computes_the_dense_model(family):
    """Exact copies, normalized gates, dropless: the upcycled model's outputs and gradients are the dense
    model's; each dense MLP weight's gradient is the sum of its experts' gradients; the router's is 0."""
    dense, inputs = dense_model(family)
    dense = dense.double().eval()   # dropout and stochastic depth off
    x = inputs()
    x = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
    sites = mlp_sites(dense)
    moe = upcycle(copy.deepcopy(dense), num_experts=5, top_k=3, every=2, capacity_factor=0.0)
    assert [n for n, _ in getattr(moe, "moe_plugin_upcycled")["sites"]] == [n for n, _ in sites[1::2]]
    probe = None
    for model in (dense, moe):
        y = out(model, x)
        probe = torch.randn_like(y) if probe is None else probe
        (y * probe).sum().backward()
    torch.testing.assert_close(out(moe, x), out(dense, x), rtol=1e-12, atol=1e-12)
    blocks = {name: block for name, _, block in upcycled_blocks(moe)}
    moe_params = dict(moe.named_parameters())
    for name, param in dense.named_parameters():
        if name in moe_params:
            torch.testing.assert_close(moe_params[name].grad, param.grad, rtol=1e-10, atol=1e-12, msg=name)
    for name, kind in sites[1::2]:
        layer = blocks[name].moe
        for key, grad in dense_grads(dense.get_submodule(name), kind).items():
            summed = getattr(layer.experts, key).grad.sum(0)
            torch.testing.assert_close(summed, grad, rtol=1e-10, atol=1e-12, msg=f"{name} {key}")
        assert layer.router.weight_ED.grad.abs().max() < 1e-12
    for name, _ in sites[0::2]:   # the others stay dense
        assert not isinstance(moe.get_submodule(name), HFMoEBlock)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_default_is_dropless_and_computes_the_dense_model(family):
    """upcycle's defaults (no capacity given) drop no token, so step 0 computes the dense model (a capacity
    factor used to be MoEConfig's 1.0 here: logits 3e-2 away from the dense model's)."""
    dense, inputs = dense_model(family)
    dense = dense.double().eval()
    x = inputs()
    moe = upcycle(copy.deepcopy(dense), num_experts=4, top_k=2)
    for _, _, block in upcycled_blocks(moe):
        assert block.moe.config.capacity_factor == 0
    moe.train()   # the training capacity is the one a first step sees (dropout is 0 in these configs)
    torch.testing.assert_close(out(moe, x), out(dense, x), rtol=1e-10, atol=1e-10)
    assert all(block.moe.stats["dropped_fraction"] == 0 for _, _, block in upcycled_blocks(moe))
    kept = upcycle(copy.deepcopy(dense), num_experts=4, top_k=2, capacity_factor=0.5)   # an override still drops
    kept(**x)
    assert max(float(block.moe.stats["dropped_fraction"]) for _, _, block in upcycled_blocks(kept)) > 0


def test_bf16_model():
    """A bf16 model gets bf16 experts and router, and computes the dense model's output up to bf16 rounding."""
    dense, inputs = dense_model("llama")
    dense = dense.to(torch.bfloat16).eval()
    moe = upcycle(copy.deepcopy(dense), num_experts=4, top_k=2, capacity_factor=0.0)
    layer = moe.model.layers[0].mlp.moe
    assert layer.experts.w1_EDH.dtype == layer.router.weight_ED.dtype == torch.bfloat16
    x = inputs()
    expected = out(dense, x).float()
    assert (out(moe, x).float() - expected).abs().max() < 0.05 * expected.abs().max()


def test_swin_layer_numbering_and_pair_replacement():
    """Swinv2 blocks are numbered over all stages; the pair (intermediate, output) is replaced as documented."""
    model, _ = dense_model("swinv2")
    names = [n for n, _ in mlp_sites(model)]
    assert names == [f"swinv2.encoder.layers.{s}.blocks.{b}" for s, depth in enumerate([2, 2, 4]) for b in range(depth)]
    upcycle(model, num_experts=4, top_k=1, every=2, layers=range(2, 8), router="cosine", capacity_factor=1.25,
            batch_prioritized_routing=True)
    assert getattr(model, "moe_plugin_upcycled")["layers"] == [3, 5, 7]
    for index, name in enumerate(names):
        block = model.get_submodule(name)
        if index in (3, 5, 7):
            assert isinstance(block.intermediate, HFMoEBlock) and isinstance(block.output.dense, torch.nn.Identity)
            assert block.intermediate.moe.config.router == "cosine"
        else:
            assert isinstance(block.intermediate.dense, torch.nn.Linear)


def test_noise_and_reinit_fraction():
    dense, _ = dense_model("llama", initializer_range=0.05)
    site = dense.model.layers[0].mlp
    w1 = torch.cat([site.gate_proj.weight, site.up_proj.weight]).t().detach()
    w2 = site.down_proj.weight.t().detach()
    H = w2.shape[0]

    noisy = upcycle(copy.deepcopy(dense), num_experts=6, top_k=2, noise=0.1)
    experts = noisy.model.layers[0].mlp.moe.experts
    deviation = (experts.w1_EDH.detach() - w1) / w1.std()
    assert 0.08 < deviation.std() < 0.12
    assert not torch.equal(experts.w1_EDH[0], experts.w1_EDH[1])

    partial = upcycle(copy.deepcopy(dense), num_experts=6, top_k=2, reinit_fraction=0.25)
    experts = partial.model.layers[0].mlp.moe.experts
    changed = []
    for e in range(6):
        w2_changed = (experts.w2_EHD[e].detach() != w2).any(1)
        gate_changed, up_changed = (experts.w1_EDH[e].detach() != w1).any(0).chunk(2)
        assert int(w2_changed.sum()) == round(0.25 * H)
        assert torch.equal(gate_changed, w2_changed) and torch.equal(up_changed, w2_changed)
        changed.append(w2_changed)
    assert any(not torch.equal(changed[0], c) for c in changed[1:])

    fresh = upcycle(copy.deepcopy(dense), num_experts=6, top_k=2, reinit_fraction=1.0)
    experts = fresh.model.layers[0].mlp.moe.experts
    assert (experts.w2_EHD.detach() != w2).all()
    assert abs(float(experts.w1_EDH.detach().std()) - 0.05) < 0.005
    assert not torch.equal(experts.w1_EDH[0], experts.w1_EDH[1])


def test_reinit_with_biases_and_router_init():
    dense, _ = dense_model("vit", initializer_range=0.03)
    model = upcycle(dense, num_experts=3, top_k=1, reinit_fraction=1.0)
    layer = model.vit.layers[0].mlp.moe
    assert torch.equal(layer.experts.b1_EH, torch.zeros_like(layer.experts.b1_EH))
    assert torch.equal(layer.experts.b2_ED, torch.zeros_like(layer.experts.b2_ED))
    router = torch.stack([b.moe.router.weight_ED.detach() for _, _, b in upcycled_blocks(model)])
    assert abs(float(router.std()) - 0.03) < 0.01   # normal(0, initializer_range)


def test_bad_input():
    dense, _ = dense_model("llama")
    with pytest.raises(ValueError, match="top_k=5 is invalid: must be at most num_experts=4"):
        upcycle(copy.deepcopy(dense), num_experts=4, top_k=5)
    with pytest.raises(ValueError, match=r"layers=\[2, 4\] has \[4\] out of range.*numbered 0..3"):
        upcycle(copy.deepcopy(dense), num_experts=4, top_k=2, layers=[2, 4])
    with pytest.raises(ValueError, match="every=0 is invalid"):
        upcycle(copy.deepcopy(dense), num_experts=4, top_k=2, every=0)
    with pytest.raises(ValueError, match="hidden_size=8 cannot be overridden: it is set by the dense MLP"):
        upcycle(copy.deepcopy(dense), num_experts=4, top_k=2, hidden_size=8)
    with pytest.raises(ValueError, match="reinit_fraction=1.5 is invalid"):
        upcycle(copy.deepcopy(dense), num_experts=4, top_k=2, reinit_fraction=1.5)
    with pytest.raises(ValueError, match="no dense MLP upcycle recognises"):
        upcycle(torch.nn.Sequential(torch.nn.Linear(4, 4)), num_experts=4, top_k=2)
    tanh, _ = dense_model("llama", hidden_act="tanh")
    with pytest.raises(ValueError, match="computes none of relu, gelu, gelu_tanh, silu"):
        upcycle(tanh, num_experts=4, top_k=2)
    gated_relu, _ = dense_model("llama", hidden_act="relu")
    with pytest.raises(ValueError, match="gated MLP with a relu activation; the MoE layer's gated experts take "
                                         "silu, gelu, gelu_tanh"):
        upcycle(gated_relu, num_experts=4, top_k=2)
    plain_gelu_tanh, _ = dense_model("vit", hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="MLP with a gelu_tanh activation; the MoE layer's plain experts take "
                                         "relu, gelu, silu"):
        upcycle(plain_gelu_tanh, num_experts=4, top_k=2)
    upcycle(dense, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="upcycled already"):
        upcycle(dense, num_experts=4, top_k=2)


def test_capacity_balancing_and_state_dict_round_trip():
    """The MoE settings reach the layers (drops, aux loss, expert-bias balancing); state_dict loads back
    into a model upcycled alike (with other random draws) and gives the same outputs."""
    dense, inputs = dense_model("qwen2")
    settings = dict(num_experts=4, top_k=2, every=1, noise=0.2, capacity_factor=0.5, aux_loss="switch",
                    aux_loss_coef=0.1, expert_bias_update_rate=0.01)
    model = upcycle(copy.deepcopy(dense), **settings)
    x = inputs()
    loss = out(model, x).logsumexp(-1).mean() + moe_plugin.aux_loss(model)
    loss.backward()
    stats = model.model.layers[0].mlp.moe.stats
    assert stats["dropped_fraction"] > 0
    assert float(moe_plugin.aux_loss(model)) > 0
    assert model.model.layers[0].mlp.moe.router.weight_ED.grad.abs().max() > 0
    biases = lambda: torch.stack([layer.mlp.moe.router.expert_bias_E for layer in model.model.layers])  # noqa: E731
    before = biases().clone()
    moe_plugin.update_expert_bias(model)
    assert not torch.equal(biases(), before)   # (all 4 layers with equal loads: about never)

    other = upcycle(copy.deepcopy(dense), **settings)
    other.load_state_dict(model.state_dict())
    model.eval(), other.eval()
    torch.testing.assert_close(out(other, x), out(model, x), rtol=0, atol=0)


def test_adaptive_capacity():
    """capacity_factor < 0 on an upcycled model: each swapped block's capacity is the largest expert load
    capped at |cf| x the fixed capacity (MoEConfig's rule), computed here from the routing by hand; the
    block's output is reference_moe's (which drops by its own count) and its dropped fraction the overflow."""
    from moe_plugin.reference import reference_moe
    dense, _ = dense_model("llama")
    model = upcycle(dense.double(), num_experts=4, top_k=2, layers=[1, 3], noise=0.3, capacity_factor=-1.5,
                    min_capacity=1, router_bias=True).eval()
    layers = [block.moe for _, _, block in upcycled_blocks(model)]
    with torch.no_grad():
        layers[0].router.bias_E.copy_(torch.tensor([6.0, 0.0, 0.0, 0.0]))   # nearly every token picks expert 0
    inputs = {}
    hooks = [layer.register_forward_hook(lambda m, args, y: inputs.__setitem__(m, args[0].detach()))
             for layer in layers]
    ids = torch.randint(0, 61, (4, 16))
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    T, E, K = 64, 4, 2
    fixed = math.ceil(K * 1.5 * T / E)   # 48 (> min_capacity)
    for i, layer in enumerate(layers):
        assert layer.config.capacity_factor == -1.5
        x = inputs[layer]
        x_TD = x.reshape(-1, 24)
        logits_TE = x_TD @ layer.router.weight_ED.t() + layer.router.bias_E
        expert_TK = logits_TE.softmax(-1).topk(K, dim=-1).indices
        load_E = torch.bincount(expert_TK.reshape(-1), minlength=E)
        with torch.no_grad():
            y = layer(x)
            expected, _ = reference_moe(layer, x)
        stats = layer.stats
        assert stats["tokens_per_expert"] == load_E.tolist()
        assert stats["capacity"] == min(int(load_E.max()), fixed)
        assert stats["dropped_fraction"] == pytest.approx(float((load_E - fixed).clamp(min=0).sum()) / (T * K))
        torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
        if i == 0:   # the cap applies: expert 0's overflow is dropped
            assert int(load_E[0]) > fixed and stats["capacity"] == fixed and stats["dropped_fraction"] > 0

def test_plain_blocks_and_deepspeed_blocks():
    """The blocks are plain HFMoEBlocks, DeepSpeed installed or not; DeepSpeed's paths (use_deepspeed_blocks, which
    its initialize calls) make them DeepSpeed's MoE instances (the engine's MoE handling), or block_class does."""
    pytest.importorskip("deepspeed")
    from deepspeed.moe.layer import MoE

    from moe_plugin.integrations.deepspeed.hf import DeepSpeedHFMoEBlock, use_deepspeed_blocks
    dense, _ = dense_model("mistral")
    model = upcycle(copy.deepcopy(dense), num_experts=4, top_k=2)
    assert all(type(b) is HFMoEBlock for _, _, b in upcycled_blocks(model))
    use_deepspeed_blocks(model)
    assert all(isinstance(b, MoE) for _, _, b in upcycled_blocks(model))
    chosen = upcycle(copy.deepcopy(dense), num_experts=4, top_k=2, block_class=DeepSpeedHFMoEBlock)
    assert all(type(b) is DeepSpeedHFMoEBlock for _, _, b in upcycled_blocks(chosen))


@pytest.mark.parametrize("family,target,layers,extra", [
    ("llama", "mixtral", None, {}), ("mistral", "mixtral", None, {}), ("qwen2", "qwen2_moe", [0, 2, 3], {}),
    ("llama", None, [1, 3], {}), ("llama_bias", None, None, {}), ("vit", None, None, {}),
    ("swinv2", None, [3, 5, 7], {}), ("llama_geglu_tanh", None, None, {}),
    ("llama", None, None, {"router": "cosine"}),   # Mixtral's router is softmax
    ("qwen2_sliding", None, [0, 2, 3], {}),         # export maps only qwen2 without a sliding window to qwen2_moe
])
def test_export(tmp_path, family, target, layers, extra):
    """An HF MoE family's folder where the architecture matches (plain from_pretrained, same outputs), else
    the dense folder with moe_plugin's expert files (load_upcycled gives the same outputs; plain
    from_pretrained loads the dense model with the experts' mean)."""
    dense, inputs = dense_model(family)
    model = upcycle(dense, num_experts=4, top_k=2, layers=layers, noise=0.3, capacity_factor=0.0, **extra).eval()
    assert moe_family_target(model) == target
    x = inputs()
    expected = out(model, x)
    export_hf(model, tmp_path / "folder")
    if target is not None:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folder")
        assert loaded.config.model_type == target
        torch.testing.assert_close(out(loaded.eval(), x), expected, rtol=1e-5, atol=1e-5)
        return
    assert (tmp_path / "folder" / EXPERTS_FILE).is_file()
    loaded = load_upcycled(tmp_path / "folder").eval()
    torch.testing.assert_close(out(loaded, x), expected, rtol=1e-5, atol=1e-5)
    plain = type(dense).from_pretrained(tmp_path / "folder")
    name, kind = getattr(model, "moe_plugin_upcycled")["sites"][0]
    w1 = upcycled_blocks(model)[0][2].moe.experts.w1_EDH.mean(0).t()
    first = {"gated": "gate_proj", "plain": "fc1", "pair": "intermediate.dense"}[kind]
    torch.testing.assert_close(plain.get_submodule(f"{name}.{first}").weight, w1[:plain.get_submodule(
        f"{name}.{first}").weight.shape[0]])


def test_export_warns_when_the_model_drops_tokens(tmp_path):
    dense, _ = dense_model("llama")
    model = upcycle(dense, num_experts=4, top_k=2, capacity_factor=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_hf(model, tmp_path / "folder")
    assert any("the exported mixtral folder computes the dropless output" in str(w.message) for w in caught)
    generic = upcycle(dense_model("vit")[0], num_experts=4, top_k=2, capacity_factor=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_hf(generic, tmp_path / "generic")
    assert any("load_upcycled restores them" in str(w.message) for w in caught)


def expert_parallel_worker(rank, world, folder):
    """ep_size 2 against one process (outputs, input and expert gradients, export), then DeepSpeed: "moe"
    sections contradicting the blocks, engine steps, save_checkpoint / load_checkpoint into another draw."""
    import logging
    import deepspeed
    from deepspeed.utils import logger
    from moe_plugin.integrations.deepspeed import initialize
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    report = {}
    torch.manual_seed(5)
    dense, _ = dense_model("llama")
    settings = dict(num_experts=4, top_k=2, every=2, noise=0.3, capacity_factor=1.0, block_class=HFMoEBlock)
    batches = [torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(40 + r)) for r in range(world)]
    torch.manual_seed(6)
    reference = upcycle(copy.deepcopy(dense), **settings)
    torch.manual_seed(6)
    parallel = upcycle(copy.deepcopy(dense), ep_size=2, **settings)
    outputs = [reference(input_ids=ids).logits for ids in batches]
    sum(o.square().sum() for o in outputs).backward()
    mine = parallel(input_ids=batches[rank]).logits
    mine.square().sum().backward()
    report["output"] = (mine - outputs[rank]).abs().max().item()
    ref_blocks, blocks = upcycled_blocks(reference), upcycled_blocks(parallel)
    local = slice(2 * rank, 2 * rank + 2)
    report["expert_grad"] = max((b.moe.experts.w1_EDH.grad - r.moe.experts.w1_EDH.grad[local]).abs().max().item()
                                for (_, _, r), (_, _, b) in zip(ref_blocks, blocks))
    report["expert_weight"] = max((b.moe.experts.w2_EHD - r.moe.experts.w2_EHD[local]).abs().max().item()
                                  for (_, _, r), (_, _, b) in zip(ref_blocks, blocks))

    export_hf(parallel, folder)   # every expert gathered; rank 0 writes
    if rank == 0:
        loaded, expected = load_upcycled(folder).eval(), reference.eval()
        logits = [m(input_ids=batches[0]).logits for m in (loaded, expected)]
        report["export"] = (logits[0] - logits[1]).abs().max().item()
        reference.train()

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "moe": {"backend": "tutel", "ep_size": 2, "capacity_factor": 1.0}}

    def upcycled(seed, base=dense):
        torch.manual_seed(seed)
        return upcycle(copy.deepcopy(base), num_experts=4, top_k=2, every=2, noise=0.3, capacity_factor=1.0,
                       ep_size=2)

    model = upcycled(6)
    # a "moe" section contradicting the upcycled blocks is an error naming the key (the model is left as it was)
    for key, value, message in [("num_experts", 8, r'"moe.num_experts"=8 contradicts block .*num_experts=4'),
                                ("top_k", 1, r'"moe.top_k"=1 contradicts block .*top_k=2'),
                                ("min_capacity", 1, r'"moe" sets min_capacity=1, but block .*min_capacity=4'),
                                ("num_expert", 4, r'"moe" has no key .num_expert. \(did you mean .num_experts')]:
        with pytest.raises(ValueError, match=message):
            initialize(model=model, config={**config, "moe": {**config["moe"], key: value}})
    engine, _, _, _ = initialize(model=model, config=config)
    losses = []
    for _ in range(3):
        loss = engine(input_ids=batches[rank], labels=batches[rank]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report.update(has_moe=engine.has_moe_layers, losses=losses,
                  reference_loss=reference(input_ids=batches[rank], labels=batches[rank]).loss.item())

    # engine.save_checkpoint, then load_checkpoint into an engine of other draws (dense model, noise, router):
    # the same logits, and the same loss after one more step each (the ZeRO-1 weight partitions loaded too)
    checkpoints = os.path.join(os.path.dirname(folder), "checkpoints")
    engine.save_checkpoint(checkpoints, tag="upcycled")
    torch.manual_seed(8)
    loaded, _, _, _ = initialize(model=upcycled(7, dense_model("llama")[0]), config=config)
    probe = batches[0]

    def logits(e):
        e.eval()
        with torch.no_grad():
            y = e(input_ids=probe).logits
        e.train()
        return y
    want = logits(engine)
    report["fresh_logits"] = (logits(loaded) - want).abs().max().item()
    loaded.load_checkpoint(checkpoints, tag="upcycled")
    report["loaded_logits"] = (logits(loaded) - want).abs().max().item()
    after = []
    for e in (engine, loaded):
        e.backward(e(input_ids=batches[rank], labels=batches[rank]).loss)
        e.step()
        after.append(e(input_ids=batches[rank], labels=batches[rank]).loss.item())
    report["loss_after_step"] = after
    return report


@pytest.mark.slow
def test_expert_parallel_and_deepspeed(tmp_path):
    pytest.importorskip("deepspeed")
    reports = run_workers(expert_parallel_worker, 2, str(tmp_path / "folder"), timeout=600)
    assert reports[0]["export"] < 1e-5
    for report in reports:
        assert report["output"] < 1e-5 and report["expert_grad"] < 1e-5 and report["expert_weight"] == 0
        assert report["has_moe"]
        assert abs(report["losses"][0] - report["reference_loss"]) < 1e-5
        assert report["losses"][-1] < report["losses"][0]
        assert report["fresh_logits"] > 1e-2 and report["loaded_logits"] < 1e-6
        saved, loaded = report["loss_after_step"]
        assert abs(saved - loaded) < 1e-6 and saved != report["losses"][-1]
