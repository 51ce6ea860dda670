"""Building on the meta device: to_empty, then reset_parameters() draws every parameter and buffer as a
plain construction does (same seed, same tensors); the router never reads its bias with balancing off."""
import warnings

import pytest
import torch

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.train.models import ModelConfig, TransformerLM

from helpers.init_checks import assert_normal, assert_uniform

CONFIGS = [
    dict(),
    dict(bias=False, activation="swiglu", router="sigmoid", num_experts=8, top_k=3, num_groups=4, topk_groups=2,
         shared_hidden_size=7, expert_bias_update_rate=0.01),
    dict(router="cosine", activation="gelu", shared_hidden_size=5, shared_gate=True, num_experts=5, top_k=1),
]


def config(**overrides):
    return MoEConfig(**{**dict(model_dim=12, hidden_size=9, num_experts=6, top_k=2, capacity_factor=0.0), **overrides})


def garbage_(module):
    """What to_empty may leave: huge values (1e25 was seen) in every parameter and buffer."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            tensor.fill_(1e25)
    return module


def meta_built(build):
    with torch.device("meta"):
        module = build()
    assert all(t.is_meta for t in module.parameters())
    return garbage_(module.to_empty(device="cpu"))


@pytest.mark.parametrize("overrides", CONFIGS)
def test_layer_built_on_meta_and_reset_equals_a_plain_construction(overrides):
    torch.manual_seed(7)
    plain = MoELayer(config(**overrides))
    layer = meta_built(lambda: MoELayer(config(**overrides)))
    torch.manual_seed(7)
    layer.reset_parameters()
    ours, expected = layer.state_dict(), plain.state_dict()
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    assert not layer.router.expert_bias_E.any()
    x = torch.randn(3, 11, 12)
    assert torch.equal(layer(x), plain(x))


def test_init_std_draws_normal_weights_and_zero_biases():
    layer = MoELayer(config(shared_hidden_size=40, shared_gate=True, model_dim=64, hidden_size=48))
    for part in (layer.router, layer.experts, layer.shared_expert):
        part.init_std = 0.05
    garbage_(layer).reset_parameters()
    for name, tensor in layer.named_parameters():
        if name.split(".")[-1].startswith("b"):
            assert not tensor.any(), name
        else:
            assert_normal(tensor, 0.05, name)
    assert not layer.router.expert_bias_E.any()


def test_default_init_is_uniform_in_the_fan_in_bound():
    layer = garbage_(MoELayer(config(model_dim=64, hidden_size=48, shared_hidden_size=40, shared_gate=True)))
    layer.reset_parameters()
    fan_in = {"router.weight_ED": 64, "experts.w1_EDH": 64, "experts.b1_EH": 64, "experts.w2_EHD": 48,
              "experts.b2_ED": 48, "shared_expert.w1_DH": 64, "shared_expert.b1_H": 64, "shared_expert.w2_HD": 40,
              "shared_expert.b2_D": 40, "shared_expert.gate_D": 64}
    assert sorted(fan_in) == sorted(name for name, _ in layer.named_parameters())
    for name, tensor in layer.named_parameters():
        assert_uniform(tensor, fan_in[name] ** -0.5, name)
    assert not layer.router.expert_bias_E.any()


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_router_reads_the_bias_only_with_balancing_on(rate):
    layer = MoELayer(config(router="sigmoid", num_experts=8, top_k=2, expert_bias_update_rate=rate)).double()
    x = torch.randn(40, 12, dtype=torch.float64)
    unbiased = layer.router(x).expert_TK
    with torch.no_grad():
        layer.router.expert_bias_E.copy_(torch.tensor([1e25, 0, 0, 0, 0, 0, 0, 1e25]))
    chosen = layer.router(x).expert_TK
    if rate == 0:
        assert not layer.router.bias_routes and torch.equal(chosen, unbiased)
    else:
        assert (chosen.sort(-1).values == torch.tensor([0, 7])).all()
    layer.router.fixed_bias = True     # a host model's fixed bias (DeepSeek-V3) routes with balancing off too
    assert (layer.router(x).expert_TK.sort(-1).values == torch.tensor([0, 7])).all()


def test_router_ignoring_the_bias_compiles():
    layer = MoELayer(config())
    with torch.no_grad():
        layer.router.expert_bias_E.fill_(float("nan"))
    x = torch.randn(17, 12)
    expected = layer(x)
    compiled = torch.compile(layer, backend="eager", fullgraph=False)
    assert torch.equal(compiled(x), expected) and torch.isfinite(expected).all()


def tiny_lm():
    moe = config(model_dim=16, hidden_size=12, shared_hidden_size=6)
    return TransformerLM(ModelConfig(dim=16, layers=2, heads=2, seq_len=8, ffn_hidden=20, moe_every=2,
                                     tie_embeddings=False), moe, vocab_size=23)


def test_native_model_built_on_meta_and_reset_equals_a_plain_one_reset():
    plain = tiny_lm()
    torch.manual_seed(3)
    plain.reset_parameters()
    model = meta_built(tiny_lm)
    torch.manual_seed(3)
    model.reset_parameters()
    expected = plain.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    ids = torch.randint(0, 23, (2, 8))
    assert torch.equal(model(ids), plain(ids))


def test_native_model_reset_draws_as_its_construction():
    """reset_parameters() draws each tensor from the distribution __init__ draws it from (not merely finite
    values). Reset draws in another order than construction, so values differ; compare per tensor the values
    pooled over many models instead: equal constants, or the same spread (std within 25%, max within 1.5x;
    with >= 300 values per side these hold for equal distributions and fail for a wrong scale)."""
    copies = 50
    built = [dict(tiny_lm().named_parameters()) for _ in range(copies)]
    reset = []
    for _ in range(copies):
        model = garbage_(tiny_lm())
        model.reset_parameters()
        reset.append(dict(model.named_parameters()))
    for name in built[0]:
        a = torch.stack([params[name].detach() for params in built])
        b = torch.stack([params[name].detach() for params in reset])
        assert torch.isfinite(b).all(), name
        if a.std() == 0:
            assert torch.equal(b, a), name
            continue
        std_ratio, max_ratio = float(b.std() / a.std()), float(b.abs().max() / a.abs().max())
        assert 0.8 < std_ratio < 1.25 and 1 / 1.5 < max_ratio < 1.5, (name, std_ratio, max_ratio)


@pytest.mark.parametrize("general_path", [False, True])
def test_expert_parameter_tags_survive_to_empty(general_path):
    """to_empty makes new parameter objects; DeepSpeed's tags on the expert parameters (allreduce=False:
    reduce over the expert-data-parallel group only) move to them, else an expert's gradient would be
    averaged with other ranks' different experts. Stacked experts and expert modules (the general path) alike."""
    cfg = config(bias=True)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the general path's "slower path" warning
        layer = MoELayer(cfg, expert=torch.nn.Linear(cfg.model_dim, cfg.model_dim) if general_path else None)
    for param in layer.experts.parameters():
        param.allreduce, param.group_name = False, "ep_size_2"
    old = list(layer.experts.parameters())
    layer.to_empty(device="cpu").reset_parameters()
    assert all(p is not o for p, o in zip(layer.experts.parameters(), old))
    assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in layer.experts.parameters())
    assert not any(hasattr(p, "allreduce") for p in layer.router.parameters())
