"""moe_layer's arguments: each of Tutel's forms is accepted and means what it means in Tutel; what the drop-in cannot
honour is an error naming the argument and the value."""
import pytest
import torch
import torch.nn.functional as F

import moe_plugin
from moe_plugin import tutel as tutel_moe

D = 8
FFN = {"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 6, "activation_fn": F.relu}


def build(gate_type=None, experts=None, **kwargs):
    gate_type = {"type": "top", "k": 2} if gate_type is None else gate_type
    return tutel_moe.moe_layer(gate_type=gate_type, model_dim=kwargs.pop("model_dim", D),
                               experts=dict(experts or FFN), **kwargs)


@pytest.mark.parametrize("kwargs, named", [
    (dict(gate_type="Top2"), ["gate_type='Top2'", "Top2Gate"]),
    (dict(gate_type={"type": "custom", "module": object}), ["'custom'", "custom gate module"]),
    (dict(gate_type={"type": "top", "k": 2, "temperature": 1}), ["temperature", "allowed"]),
    (dict(gate_type={"type": "cosine_top", "init_t": 0.0}), ["init_t", "0.0"]),
    (dict(gate_type={"type": "top", "k": 0}), ["['k']=0"]),
    (dict(gate_type={"type": "top", "k": 1.5}), ["['k']=1.5"]),      # Tutel's int(k) would make it 1 silently
    (dict(gate_type=[]), ["gate_type=[]"]),
    (dict(experts={**FFN, "type": "moe"}), ["experts['type']='moe'", "'llama_ffn'"]),
    (dict(experts={**FFN, "count_per_node": -2}), ["count_per_node", "-2", "shared"]),
    (dict(experts={**FFN, "output_dim": 4}), ["output_dim", "4", "model_dim=8"]),
    (dict(experts={**FFN, "fused_custom_fn": None}), ["fused_custom_fn"]),
    (dict(experts={**FFN, "dropout": 0.1}), ["dropout"]),
    (dict(experts={**FFN, "activation_fn_with_self": lambda x, m: x}), ["activation_fn_with_self", "keep one"]),
    (dict(experts={"type": "custom", "count_per_node": 2}), ["custom", "module"]),
    (dict(model_dim=7), ["model_dim=7", "even"]),
    (dict(parallel_type="pipeline"), ["parallel_type='pipeline'"]),
    (dict(parallel_type="adaptive:x"), ["adaptive:x"]),
    (dict(is_gshard_loss=False), ["is_gshard_loss=False", "gate_noise"]),
    (dict(a2a_ffn_overlap_degree=0), ["a2a_ffn_overlap_degree=0"]),
    (dict(seeds=(1,)), ["seeds=(1,)"]),
    (dict(capacity=4), ["capacity"]),
])
def test_refused_arguments_are_named(kwargs, named):
    with pytest.raises(ValueError) as error:
        build(**kwargs)
    for text in named:
        assert text in str(error.value), (text, str(error.value))


def test_a_non_callable_activation_is_a_type_error():
    with pytest.raises(TypeError, match="activation_fn"):
        build(experts={**FFN, "activation_fn": "relu"})


@pytest.mark.parametrize("forward_args, named", [
    (dict(reserve_dims=2), "reserve_dims=2"),
    (dict(gate_index=1), "gate_index=1"),
    (dict(adaptive_r=2), "adaptive_r=2"),
])
def test_refused_forward_arguments_are_named(forward_args, named):
    with pytest.raises(ValueError, match=named):
        build()(torch.randn(4, D), **forward_args)


@pytest.mark.parametrize("variable", ["SKIP_MOE", "SKIP_EXPERT"])
def test_tutels_skip_switches_are_refused(variable, monkeypatch):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ValueError, match=variable):
        build()


def test_tutels_other_forms_and_environment_are_honoured(monkeypatch):
    assert build(gate_type="Top1Gate").gate_specs[0].top_k == 1
    assert build(experts={**{k: v for k, v in FFN.items() if k != "count_per_node"},
                          "num_experts_per_device": 3}).num_global_experts == 3
    assert build(experts={**FFN, "count_per_node": -1}).num_global_experts == 1
    assert build(pad_samples=True).gate_specs[0].kind == "top"
    assert [build(gate_type={"type": "top", "k": k}).gate_specs[0].top_k for k in (2.0, "2", 1)] == [2, 2, 1]
    monkeypatch.setenv("CAP_FACTOR", "0.5")
    monkeypatch.setenv("BATCH_PRIO", "1")
    layer = build()
    assert layer.gate_specs[0].capacity_factor == 0.5 and layer.config.batch_prioritized_routing


def test_known_activations_take_the_fast_path_and_others_the_general_one():
    assert build(experts={**FFN, "activation_fn": torch.nn.GELU()}).config.activation == "gelu"
    assert build(experts={**FFN, "activation_fn": F.silu}).config.activation == "silu"
    assert type(build(experts={**FFN, "activation_fn": torch.nn.GELU("tanh")}).experts).__name__ == "CustomExperts"
    assert build(experts={"type": "llama_ffn", "count_per_node": 2, "hidden_size_per_expert": 6}).config.activation \
        == "swiglu"


def test_the_drop_in_is_a_moe_layer():
    model = torch.nn.Sequential(build(), build(gate_type={"type": "top", "k": 1}))
    y = model(torch.randn(5, D))
    assert all(isinstance(layer, moe_plugin.MoELayer) for layer in model)
    assert torch.allclose(moe_plugin.aux_loss(model), model[0].l_aux + model[1].l_aux)
    assert y.l_aux is model[1].l_aux
    # as in Tutel, moe_layer is the class: code that finds its MoE layers by isinstance finds the drop-in's
    assert all(isinstance(layer, tutel_moe.moe_layer) for layer in model)
    assert tutel_moe.moe_layer.global_expert_count(3) == 3


@pytest.mark.parametrize("name", ["fast_encode", "top_k_routing", "fast_dispatcher"])
def test_tutels_routing_functions_are_named_as_not_provided(name):
    with pytest.raises(AttributeError) as error:
        getattr(tutel_moe, name)
    assert f"no {name!r}" in str(error.value) and "moe_layer" in str(error.value)
    with pytest.raises(AttributeError, match="no attribute 'nothing_like_it'"):
        tutel_moe.nothing_like_it
