"""State dicts: the drop-in saves Tutel's keys and layouts and loads them strictly (Swin-MoE's [E, 1, H] biases and
legacy files without _num_global_experts too); names.py converts them to and from a plain MoELayer's."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

from moe_plugin import MoELayer
from moe_plugin import tutel as tutel_moe
from moe_plugin.tutel import names

D, H, E, J = 8, 6, 4, 5

# name: (gate_type, experts, Tutel's keys with their shapes: the layout Tutel documents and saves)
LAYOUTS = {
    "top ffn": ({"type": "top", "k": 2}, {"type": "ffn", "activation_fn": F.relu},
                {"_num_global_experts": (), "experts.batched_fc1_w": (E, H, D), "experts.batched_fc2_w": (E, H, D),
                 "experts.batched_fc1_bias": (E, H), "experts.batched_fc2_bias": (E, D), "gates.0.wg.weight": (E, D)}),
    "cosine llama": ({"type": "cosine_top", "k": 2, "proj_dim": J}, {"type": "llama_ffn"},
                     {"_num_global_experts": (), "experts.W_fc1": (E * D * H,), "experts.W_fc2": (E * D * H,),
                      "experts.W_fc3": (E * H * D,), "gates.0.temperature": (1,), "gates.0.sim_matrix": (J, E),
                      "gates.0.cosine_projector.weight": (J, D), "gates.0.cosine_projector.bias": (J,)}),
    "two gates, no fc2 bias": ([{"type": "top", "k": 1}, {"type": "top", "k": 2}],
                               {"type": "ffn", "activation_fn": F.relu, "has_fc2_bias": False},
                               {"_num_global_experts": (), "experts.batched_fc1_w": (E, H, D),
                                "experts.batched_fc2_w": (E, H, D), "experts.batched_fc1_bias": (E, H),
                                "gates.0.wg.weight": (E, D), "gates.1.wg.weight": (E, D)}),
}


def build(name):
    gate_type, experts, _ = LAYOUTS[name]
    return tutel_moe.moe_layer(gate_type=gate_type, model_dim=D,
                               experts={**experts, "count_per_node": E, "hidden_size_per_expert": H}).eval()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_state_dict_has_tutels_keys_and_layouts(name):
    state = build(name).state_dict()
    assert {key: tuple(value.shape) for key, value in state.items()} == LAYOUTS[name][2]
    assert state["_num_global_experts"].dtype == torch.int64 and int(state["_num_global_experts"]) == E


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_saved_state_loads_strictly_into_a_fresh_layer(name, tmp_path):
    layer, other = build(name), build(name)
    torch.save(layer.state_dict(), tmp_path / "layer.pt")
    other.load_state_dict(torch.load(tmp_path / "layer.pt"), strict=True)
    x = torch.randn(2, 9, D)
    assert torch.equal(other(x), layer(x))
    assert other(x, gate_index=len(other.gates) - 1).shape == x.shape


@pytest.mark.parametrize("name", ["top ffn", "cosine llama"])
def test_names_convert_to_and_from_a_plain_moe_layer(name):
    layer = build(name)
    plain = MoELayer(layer.config).eval()
    plain.load_state_dict(names.tutel_to_moe(layer.state_dict(), num_local_experts=E), strict=True)
    x = torch.randn(23, D)
    assert torch.equal(plain(x), layer(x))
    for param in plain.parameters():
        param.data.add_(torch.randn_like(param) * 0.1)
    fresh = build(name)
    fresh.load_state_dict(names.moe_to_tutel(plain.state_dict(), llama=name == "cosine llama"), strict=True)
    assert torch.equal(fresh(x), plain(x))


def test_swin_moe_biases_and_legacy_files_load():
    layer = build("top ffn")
    state = layer.state_dict()
    old = {key: value for key, value in state.items() if key != "_num_global_experts"}
    old["experts.batched_fc1_bias"] = state["experts.batched_fc1_bias"].view(E, 1, H)
    old["experts.batched_fc2_bias"] = state["experts.batched_fc2_bias"].view(E, 1, D)
    fresh = build("top ffn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(old, strict=True)
    assert any("_num_global_experts" in str(w.message) for w in caught)
    x = torch.randn(11, D)
    assert torch.equal(fresh(x), layer(x))


def test_a_different_expert_count_is_an_error():
    state = build("top ffn").state_dict()
    state["_num_global_experts"] = torch.tensor(2 * E)
    with pytest.raises(ValueError, match=f"{2 * E} global experts, this layer {E}"):
        build("top ffn").load_state_dict(state)


def test_names_refuse_what_they_cannot_convert():
    two = build("two gates, no fc2 bias").state_dict()
    with pytest.raises(ValueError, match=r"gates \[0, 1\]"):
        names.tutel_to_moe(two)
    assert "router.weight_ED" in names.tutel_to_moe(two, gate=1)
    with pytest.raises(ValueError, match="layers.0.mlp"):
        names.tutel_to_moe({"layers.0.mlp." + key: value for key, value in two.items()})
    llama = build("cosine llama").state_dict()
    with pytest.raises(ValueError, match="num_local_experts"):
        names.tutel_to_moe(llama)
    plain = MoELayer(model_dim=D, hidden_size=H, num_experts=E).state_dict()
    plain["router.expert_bias_E"] += 1
    with pytest.raises(ValueError, match="expert_bias_E"):
        names.moe_to_tutel(plain)


def test_model_state_dicts_convert_every_layer():
    layer = build("top ffn")
    model = {"embed.weight": torch.randn(3, D), **{f"blocks.{i}.mlp._moe_layer.{key}": value
                                                   for i in range(2) for key, value in layer.state_dict().items()}}
    assert names.tutel_layer_prefixes(model) == ["blocks.0.mlp._moe_layer.", "blocks.1.mlp._moe_layer."]
    converted = names.model_tutel_to_moe(model)
    assert torch.equal(converted["embed.weight"], model["embed.weight"])
    assert torch.equal(converted["blocks.1.mlp._moe_layer.experts.w1_EDH"],
                       model["blocks.1.mlp._moe_layer.experts.batched_fc1_w"].transpose(1, 2))
    assert not any("batched" in key for key in converted)


@pytest.mark.parametrize("activation", [F.relu, torch.tanh])
def test_a_layer_copies_and_pickles_after_a_forward(activation):
    layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=D,
                                experts={"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H,
                                         "activation_fn": activation})
    x = torch.randn(7, D)
    layer(x).sum().backward()
    copied = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copied, loaded):
        assert torch.equal(other(x), layer(x))
        assert getattr(other.experts, "ctx", other) is other     # the general path's experts see their own layer
