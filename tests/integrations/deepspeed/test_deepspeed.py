"""DeepSpeed backend, in one process: the "moe" section, the config mapping, native names, clear errors."""
import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
import moe_plugin.integrations.deepspeed as dsi  # noqa: E402
from deepspeed.moe.layer import MoE as NativeMoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from moe_plugin.integrations.deepspeed.model import MoETransformerLM  # noqa: E402

from helpers.paths import REPO

D, H, E = 8, 16, 4


def native_layer(k=2, expert=None, **kwargs):
    expert = expert or nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    layer = NativeMoE(D, expert, num_experts=E, k=k, use_rts=False, top2_2nd_expert_sampling=False, **kwargs)
    for module in layer.deepspeed_moe.experts.deepspeed_experts.modules():   # distinct experts
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    return layer


def test_unknown_key_lists_the_known_keys():
    with pytest.raises(ValueError, match=r"no key 'capacity_fator' \(did you mean 'capacity_factor'\?\); "
                                         r"known keys: backend, num_experts, ep_size, top_k"):
        dsi.read_moe_section({"moe": {"backend": "tutel", "capacity_fator": 1.0}})


@pytest.mark.parametrize("key, value", [
    ("backend", "megablocks"), ("num_experts", 0), ("ep_size", 1.5), ("top_k", True), ("capacity_factor", 0),
    ("capacity_factor", "1.0"), ("eval_capacity_factor", -1.0), ("min_capacity", -1), ("drop_tokens", "yes"),
    ("router", "top2"), ("aux_loss_coef", -0.1), ("parallel", "fast"), ("overlap_degree", 0), ("a2a", "ring"),
    ("node_size", 0)])
def test_bad_values_name_the_field(key, value):
    section = {"backend": "tutel", key: value}
    with pytest.raises(ValueError, match=rf"\"moe\.{key}\"={value!r} is invalid: must be"):
        dsi.read_moe_section({"moe": section})


def test_section_needs_a_backend_and_softmax_for_deepspeed():
    assert dsi.read_moe_section({}) is None
    with pytest.raises(ValueError, match=r"\"moe.backend\" is required: \"tutel\" .* or \"deepspeed\""):
        dsi.read_moe_section({"moe": {"top_k": 2}})
    with pytest.raises(ValueError, match=r"\"moe.router\"='cosine' needs \"moe.backend\": \"tutel\""):
        dsi.read_moe_section({"moe": {"backend": "deepspeed", "router": "cosine"}})
    with pytest.raises(ValueError, match="must be an object"):
        dsi.read_moe_section({"moe": ["tutel"]})


def test_the_section_takes_both_tuners():
    per_load = dsi.read_moe_section({"moe": {"backend": "tutel", "parallel": "auto", "overlap_degree": "auto",
                                             "a2a": "auto"}})
    assert (per_load["parallel"], per_load["overlap_degree"], per_load["a2a"]) == ("auto", "auto", "auto")
    once = dsi.read_moe_section({"moe": {"backend": "tutel", "parallel": "auto_once", "overlap_degree": "auto_once"}})
    assert (once["parallel"], once["overlap_degree"]) == ("auto_once", "auto_once")
    with pytest.raises(ValueError, match="auto_once"):
        dsi.read_moe_section({"moe": {"backend": "tutel", "parallel": "sometimes"}})


def test_config_follows_deepspeed_gating():
    top1 = dsi.moe_config(D, H, E, 1, 1, 1.5, 2.0, 3, True, "relu", True)
    assert (top1.top_k, top1.capacity_factor, top1.eval_capacity_factor, top1.min_capacity) == (1, 1.5, 2.0, 3)
    assert (top1.normalize_gate, top1.aux_loss, top1.gate_noise, top1.batch_prioritized_routing) == \
        ("none", "gshard", 0.0, False)
    top2 = dsi.moe_config(D, H, E, 1, 2, 1.0, 1.0, 4, True, "gelu", False, router="sigmoid", aux_loss_coef=0.1,
                          parallel="auto", overlap_degree=2, a2a="2dh", node_size=1)
    assert (top2.normalize_gate, top2.aux_loss, top2.activation, top2.bias, top2.router) == \
        ("after_drop", "gshard", "gelu", False, "sigmoid")
    assert (top2.aux_loss_coef, top2.parallel, top2.overlap_degree, top2.a2a, top2.node_size) == \
        (0.1, "auto", 2, "2dh", 1)
    dropless = dsi.moe_config(D, H, E, 1, 3, 1.0, 1.0, 4, False, "relu", True)
    assert (dropless.capacity_factor, dropless.eval_capacity_factor, dropless.aux_loss) == (0.0, 0.0, "switch")


class NamedExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("expert", [None, NamedExpert()], ids=["sequential", "named"])
def test_swap_keeps_native_names_and_weights(expert):
    native = native_layer(expert=expert)
    model, replaced = dsi.swap_moe_layers(nn.ModuleDict({"moe": native}), {"backend": "tutel", "top_k": 1})
    ours = model["moe"]
    assert isinstance(ours, dsi.MoE) and isinstance(ours, NativeMoE)
    assert ours.deepspeed_moe.config.top_k == 1 and ours.deepspeed_moe.config.activation == \
        ("relu" if expert is None else "gelu")
    native_state, our_state = native.state_dict(), ours.state_dict()
    assert sorted(native_state) == sorted(our_state)
    for key, value in native_state.items():
        assert torch.equal(our_state[key], value), key
    # the state dict loads back into a fresh layer, every expert included
    fresh = dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), num_experts=E, k=1,
                    use_rts=False) if expert is None else dsi.MoE(D, NamedExpert(), num_experts=E, k=1, use_rts=False)
    fresh.load_state_dict(our_state)
    for name, param in ours.named_parameters():
        assert torch.equal(dict(fresh.named_parameters())[name], param), name
    # old parameters map to new ones: the gate to the router, experts to the stacked experts
    experts = set(map(id, ours.deepspeed_moe.experts.parameters()))
    assert {id(p) for p in replaced[id(native.deepspeed_moe.gate.wg.weight)]} == \
        {id(ours.deepspeed_moe.router.weight_ED)}
    assert {id(p) for p in replaced[id(native.deepspeed_moe.experts.deepspeed_experts[1][0].weight
                                        if expert is None else native.deepspeed_moe.experts.deepspeed_experts[1].fc1.weight)]} == experts


def test_expert_parameters_carry_deepspeed_flags():
    layer = dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.SiLU(), nn.Linear(H, D)), num_experts=E, k=2,
                    use_rts=False, top2_2nd_expert_sampling=False)
    for param in layer.deepspeed_moe.experts.parameters():
        assert param.allreduce is False and param.group_name == "ep_size_1"
    assert not hasattr(layer.deepspeed_moe.router.weight_ED, "allreduce")
    assert (layer.num_experts, layer.num_local_experts, layer.expert_group_name) == (E, E, "ep_size_1")
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(layer.parameters()), "name": "p"})
    assert [g.get("moe", False) for g in groups] == [False, True] and groups[1]["name"] == "ep_size_1"


def test_forward_returns_what_native_returns():
    layer = dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), num_experts=E, k=2,
                    capacity_factor=0.5, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(3, 10, D)
    y, l_aux, exp_counts = layer(x)
    assert exp_counts.dtype == torch.long and exp_counts.device == x.device   # as native: int64, not on the host
    assert y.shape == x.shape and l_aux.dim() == 0 and exp_counts.tolist() == \
        layer.deepspeed_moe.stats["tokens_per_expert"] and int(exp_counts.sum()) == 2 * 30
    assert torch.allclose(layer.deepspeed_moe.aux_loss, 0.01 * l_aux)   # aux_loss_coef weights .aux_loss only


def test_unsupported_native_options_fail_or_warn_clearly():
    expert = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    with pytest.raises(ValueError, match="noisy_gate_policy='jitter' is invalid; allowed: None, 'None', 'Jitter'"):
        dsi.MoE(D, expert, num_experts=E, noisy_gate_policy="jitter")   # the others: test_deepspeed_options.py
    with pytest.raises(ValueError, match="num_experts=4 must be a multiple of ep_size=3"):
        dsi.MoE(D, expert, num_experts=E, ep_size=3)
    with pytest.raises(ValueError, match="expert module Linear must map rows"):   # any other module runs
        dsi.MoE(D, nn.Linear(D, D + 1), num_experts=E)                          # (test_deepspeed_any_expert)
    with pytest.warns(UserWarning, match="random token selection"):
        dsi.MoE(D, expert, num_experts=E, k=1, use_rts=True)
    with pytest.warns(UserWarning, match="random token selection"):
        dsi.MoE(D, expert, num_experts=E, k=1)   # DeepSpeed's default
    with pytest.warns(UserWarning, match="sampled second expert"):
        dsi.MoE(D, expert, num_experts=E, k=2, use_rts=False, top2_2nd_expert_sampling=True)
    layer = dsi.MoE(D, expert, num_experts=E, k=1, use_rts=False)
    with pytest.raises(ValueError, match=r"used_token must be a tensor of one 0/1 value per token, shape \(6,\)"):
        layer(torch.randn(6, D), torch.ones(3, 2))


def test_section_must_describe_the_model():
    model = nn.ModuleDict({"moe": native_layer()})
    with pytest.raises(ValueError, match=r"\"moe.num_experts\"=8 differs from MoE layer 'moe' \(num_experts=4\)"):
        dsi.swap_moe_layers(model, {"backend": "tutel", "num_experts": 8})
    with pytest.raises(ValueError, match=r"\"moe.top_k\"=5 is invalid for MoE layer 'moe': must be between 1 and "
                                         r"its num_experts=4"):
        dsi.swap_moe_layers(model, {"backend": "tutel", "top_k": 5})
    with pytest.raises(ValueError, match=r"\"moe.ep_size\"=2 differs"):
        dsi.swap_moe_layers(model, {"backend": "deepspeed", "ep_size": 2})
    ours = nn.ModuleDict({"moe": dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)),
                                         num_experts=E, k=1, use_rts=False)})
    with pytest.raises(ValueError, match=r"\"moe.top_k\"=2 differs from MoE layer 'moe', built as moe_plugin's MoE"):
        dsi.swap_moe_layers(ours, {"backend": "tutel", "top_k": 2})
    with pytest.raises(ValueError, match=r"\"moe.backend\": \"deepspeed\" but MoE layer 'moe' is moe_plugin's"):
        dsi.swap_moe_layers(ours, {"backend": "deepspeed"})


def test_deepspeed_backend_applies_the_routing_keys_to_native_gates():
    model = nn.ModuleDict({"moe": native_layer(k=1)})
    same, replaced = dsi.swap_moe_layers(model, {"backend": "deepspeed", "top_k": 2, "capacity_factor": 2.0,
                                                 "drop_tokens": False, "aux_loss_coef": 0.1, "a2a": "2dh"})
    gate = same["moe"].deepspeed_moe.gate
    assert same is model and not replaced and (gate.k, gate.capacity_factor, gate.drop_tokens) == (2, 2.0, False)


def test_optimizer_groups_follow_the_swap():
    model = nn.ModuleDict({"moe": native_layer(), "head": nn.Linear(D, D)})
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    optimizer = torch.optim.SGD(groups, lr=0.1)
    new_model, replaced = dsi.swap_moe_layers(model, {"backend": "tutel"})
    for group in optimizer.param_groups:
        group["params"] = dsi._remap(group["params"], replaced)
    in_optimizer = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(in_optimizer) == sorted(map(id, new_model.parameters()))
    assert {id(p) for p in optimizer.param_groups[1]["params"]} == \
        set(map(id, new_model["moe"].deepspeed_moe.experts.parameters()))


def test_zero_stage_3_options_and_bad_sections_fail_before_anything_starts():
    model = MoETransformerLM({"num_experts": 4, "top_k": 1})
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    for key, zero, extra in [("zero_optimization.zero_hpz_partition_size=2", {"zero_hpz_partition_size": 2}, {}),
                             ("zero_optimization.zero_quantized_gradients=True", {"zero_quantized_gradients": True},
                              {}),
                             ("sequence_parallel_size=2", {}, {"sequence_parallel_size": 2})]:
        with pytest.raises(ValueError, match=rf"{key} is not supported with MoE layers at zero_optimization.stage 3"):
            dsi.initialize(model=model, config={**base, **extra, "zero_optimization": {"stage": 3, **zero},
                                                "moe": {"backend": "tutel"}})
    with pytest.raises(ValueError, match=r"\"moe.top_k\"=0 is invalid"):
        dsi.initialize(model=model, config={**base, "moe": {"backend": "tutel", "top_k": 0}})
    with pytest.raises(ValueError, match="needs a config"):
        dsi.initialize(model=model)


@pytest.mark.parametrize("name", ["moe_tutel.json", "moe_native.json", "moe_tutel_gpu_bf16.json"])
def test_shipped_configs_are_valid(name):
    import json
    import os
    path = os.path.join(REPO, "configs", "deepspeed", name)
    with open(path) as file:
        section = dsi.read_moe_section(json.load(file))
    assert section["backend"] == ("deepspeed" if "native" in name else "tutel")
    model = MoETransformerLM({**section, "ep_size": 1})   # one process here: ep_size 1
    dsi.swap_moe_layers(model, {**section, "ep_size": 1})
