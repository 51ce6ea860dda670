"""Swapped HF models built on the meta device, as transformers' own test_init_weights_can_init_buffers builds
them: under torch.device("meta"), swap_moe_blocks, to_empty, then HF's init_weights() (or the blocks'
reset_parameters()). Every tensor of every swapped block is then drawn as HF draws its own block
(normal(0, initializer_range), the DeepSeek-V3 bias 0); the model then computes what a normally built one
computes with the same weights, and HF-named weights load into it.

What this module tests (moved here from the README):

Tested for every family, swapped inside and after the meta context, both block classes
  (tests/integrations/transformers/test_transformers_meta_init.py): every tensor finite, the bias exactly 0, each weight
  with mean 0 and the configured std and normal tails; buffers equal a normally built swapped model's; given
  its weights, exactly its logits; an unswapped model's HF-named state dict loads and gives HF's logits
  (1e-5); with `ep_size=2` on 2 processes each rank holds exactly its share of a one-process model's experts.
"""
import copy
import importlib.util

import pytest
import torch

from helpers.compare import assert_close_rel
from helpers.hf import FAMILIES, build_model, family_config, hf_moe, needs_transformers, tokens, transformers
from helpers.init_checks import assert_normal
from helpers.launch import run_workers

pytestmark = [needs_transformers, pytest.mark.timeout(300)]
STD = 0.05      # not HF's default 0.02: the blocks must read initializer_range from the config
TOL = 1e-5


def meta_swapped(family, swap_on_meta=True, block_class=None, **extra):
    """The family's model built on meta and swapped there (or swapped after leaving the meta context),
    then moved to CPU with to_empty: every tensor holds whatever memory it got (here: 1e25, as seen)."""
    config = family_config(family, initializer_range=STD, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
        if swap_on_meta:
            hf_moe.swap_moe_blocks(model, block_class=block_class)
    if not swap_on_meta:
        hf_moe.swap_moe_blocks(model, block_class=block_class)
    assert all(t.is_meta for t in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.fill_(1e25)
    return model


def blocks(model):
    return [m for m in model.modules() if isinstance(m, hf_moe.HFMoEBlock)]


def assert_drawn_as_hf_draws(model):
    """Each block: weights normal(0, initializer_range) as HF's _init_weights draws its routers, experts and
    shared-expert Linears; the expert bias exactly 0 (HF zeroes DeepSeek-V3's e_score_correction_bias)."""
    assert blocks(model)
    for i, block in enumerate(blocks(model)):
        for name, param in block.moe.named_parameters():
            assert_normal(param, STD, f"block {i} {name}")
        assert torch.equal(block.moe.router.expert_bias_E, torch.zeros_like(block.moe.router.expert_bias_E))
        assert block.moe.router.bias_routes == (model.config.model_type == "deepseek_v3")


@pytest.mark.parametrize("swap_on_meta", [True, False], ids=["swapped-on-meta", "swapped-after"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_init_weights_initializes_every_swapped_block(family, swap_on_meta, fresh_seed):
    model = meta_swapped(family, swap_on_meta)
    model.init_weights()
    assert_drawn_as_hf_draws(model)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        assert torch.isfinite(tensor).all() and tensor.abs().max() < 1e3, name

    # the buffers equal a normally built model's (transformers' test_init_weights_can_init_buffers)
    plain = hf_moe.swap_moe_blocks(transformers.AutoModelForCausalLM.from_config(family_config(family)))
    expected = dict(plain.named_buffers())
    assert sorted(expected) == sorted(name for name, _ in model.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, expected[name]), name

    # with a normally built (and swapped) model's weights it computes what that model computes
    normal = hf_moe.swap_moe_blocks(build_model(family, fresh_seed))
    model.load_state_dict(normal.state_dict())
    ids = tokens(fresh_seed + 1)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, normal(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_reset_parameters_initializes_them(family):
    model = meta_swapped(family)
    for block in blocks(model):
        block.reset_parameters()
    assert_drawn_as_hf_draws(model)


def test_both_block_classes_get_initialized():
    """HFMoEBlock and, when deepspeed is installed, the subclass DeepSpeed's paths build."""
    classes = [hf_moe.HFMoEBlock]
    if importlib.util.find_spec("deepspeed") is not None:
        from moe_plugin.integrations.deepspeed.hf import DeepSpeedHFMoEBlock
        classes.append(DeepSpeedHFMoEBlock)
    for block_class in classes:
        model = meta_swapped("qwen2_moe", block_class=block_class)
        assert all(type(b) is block_class for b in blocks(model))
        model.init_weights()
        assert_drawn_as_hf_draws(model)


def test_expert_parameter_tags_survive_to_empty():
    """to_empty replaces meta parameters by new objects; the tags hosts put on them move along (DeepSpeed
    reduces a parameter tagged allreduce=False over the expert-data-parallel group only: untagged, an
    expert's gradient would be averaged with other ranks' different experts)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(family_config("mixtral"))
        hf_moe.swap_moe_blocks(model, block_class=hf_moe.HFMoEBlock)
    for block in blocks(model):
        for param in block.moe.experts.parameters():
            param.allreduce, param.group_name = False, "ep_size_1"
    before = dict(model.named_parameters())
    model.to_empty(device="cpu")
    assert all(p is not before[name] for name, p in model.named_parameters())   # new objects indeed
    for block in blocks(model):
        assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in block.moe.experts.parameters())
        assert not any(hasattr(p, "allreduce") for p in block.moe.router.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_named_weights_load_into_a_model_swapped_on_meta(family, fresh_seed):
    """Build on meta, initialize (HF's non-persistent buffers, the rotary tables, are in no state dict), then
    load an unswapped model's state dict in HF's names and layouts into the swapped blocks (their load hook)."""
    hf_model = build_model(family, fresh_seed)     # DeepSeek-V3 with a non-zero correction bias
    model = meta_swapped(family)
    model.init_weights()
    model.load_state_dict(hf_model.state_dict())
    ids = tokens(fresh_seed + 1)
    with torch.no_grad():
        assert_close_rel(model(ids).logits, hf_model(ids).logits, TOL, "logits")
    for block in blocks(model):
        assert torch.isfinite(block.moe.router.expert_bias_E).all()


def test_a_second_init_weights_leaves_initialized_blocks_alone():
    """As HF's own modules: init_weights() marks what it initialized and skips it the next time."""
    model = meta_swapped("mixtral")
    model.init_weights()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.init_weights()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _meta_init_worker(rank, world_size, family, seed):
    """On each rank: a model swapped with ep_size 2 on meta and one with every expert, both initialized by
    HF's init_weights() after the same seed: this rank's experts are its share of the whole model's (each
    expert drawn from its own generator), and the two compute the same logits."""
    torch.set_num_threads(1)
    models = {}
    for ep_size in (1, world_size):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(family_config(family, initializer_range=STD))
        hf_moe.swap_moe_blocks(model, ep_size=ep_size)
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        model.init_weights()
        models[ep_size] = model
    for whole, part in zip(blocks(models[1]), blocks(models[world_size])):
        share = part.moe.experts.w1_EDH.shape[0]
        assert share == whole.moe.config.num_experts // world_size
        for name in ("w1_EDH", "w2_EHD"):
            expected = getattr(whole.moe.experts, name)[rank * share:(rank + 1) * share]
            assert torch.equal(getattr(part.moe.experts, name), expected), name
        assert torch.equal(part.moe.router.weight_ED, whole.moe.router.weight_ED)
    ids = tokens(seed + 1 + rank, length=(13, 7)[rank])
    with torch.no_grad():
        return float((models[world_size](ids).logits - models[1](ids).logits).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_meta_init_with_experts_over_two_processes_draws_the_whole_models_experts(family, fresh_seed):
    errors = run_workers(_meta_init_worker, 2, family, fresh_seed, timeout=300)
    assert max(errors) < 1e-5, errors
