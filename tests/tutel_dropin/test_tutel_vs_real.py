"""The drop-in against real Tutel, where Tutel is installed (skipped otherwise, saying so): the same parameters from
the same seed, and after loading Tutel's state dict the same output, l_aux and gradients at fp32 rounding; state
dicts load both ways, strictly."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tutel_common import HAVE_TUTEL, NO_TUTEL, grads_in_tutel_layout, real_tutel_moe

from moe_plugin import tutel as tutel_moe

pytestmark = pytest.mark.skipif(not HAVE_TUTEL, reason=NO_TUTEL)

D, H, E = 16, 12, 8
RELU = {"activation_fn": F.relu}


class TanhExperts(nn.Module):
    """A custom expert module in Tutel's contract: all local experts at once, x [E_local, C, D] -> [E_local, C, D]."""

    def __init__(self, model_dim, num_experts_per_device, sharded_count, scale=1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts_per_device, model_dim, model_dim) * 0.2)
        self.scale = scale

    def forward(self, x, ctx):
        return torch.tanh(torch.matmul(x, self.weight)) * self.scale * ctx.num_global_experts


# name: (gate_type, experts (type ffn unless it says), layer arguments, forward arguments, training)
CASES = {
    "top1 cf1": ({"type": "top", "k": 1}, RELU, {}, {}, False),
    "top2 cf1 T100": ({"type": "top", "k": 2, "capacity_factor": 1.0}, RELU, {}, {}, False),
    "top2 cf0.75": ({"type": "top", "k": 2, "capacity_factor": 0.75}, RELU, {}, {}, False),
    "top2 dropless": ({"type": "top", "k": 2, "capacity_factor": 0.0}, RELU, {}, {}, False),
    "top2 cf-0.5": ({"type": "top", "k": 2, "capacity_factor": -0.5}, RELU, {}, {}, False),
    "top3 cf1.25 fp32 gate": ({"type": "top", "k": 3, "capacity_factor": 1.25, "fp32_gate": True}, RELU, {}, {},
                              False),
    "batch prioritized": ({"type": "top", "k": 2, "capacity_factor": 0.75}, RELU,
                          {"batch_prioritized_routing": True}, {}, False),
    "is_postscore False": ({"type": "top", "k": 2, "capacity_factor": 0.75}, RELU, {"is_postscore": False}, {},
                           False),
    "normalize_gate False": ({"type": "top", "k": 3}, RELU, {"normalize_gate": False}, {}, False),
    "gate noise": ({"type": "top", "k": 2, "capacity_factor": 0.75, "gate_noise": 1.0}, RELU, {}, {}, True),
    "load_importance": ({"type": "top", "k": 2, "gate_noise": 1.0}, RELU, {"is_gshard_loss": False}, {}, True),
    "cosine_top": ({"type": "cosine_top", "k": 2, "capacity_factor": 0.75, "proj_dim": 6, "init_t": 0.3}, RELU, {},
                   {}, False),
    "llama_ffn": ({"type": "top", "k": 2, "capacity_factor": 0.75}, {"type": "llama_ffn"}, {}, {}, False),
    "gelu": ({"type": "top", "k": 2}, {"activation_fn": F.gelu}, {}, {}, False),
    "lambda activation": ({"type": "top", "k": 2, "capacity_factor": 0.75},
                          {"activation_fn": lambda h: F.relu(h) ** 2}, {}, {}, False),
    "no fc2 bias": ({"type": "top", "k": 2}, {**RELU, "has_fc2_bias": False}, {}, {}, False),
    "no biases": ({"type": "top", "k": 2}, {**RELU, "has_fc1_bias": False, "has_fc2_bias": False}, {}, {}, False),
    "custom experts": ({"type": "top", "k": 2, "capacity_factor": 0.75},
                       {"type": "custom", "module": TanhExperts, "scale": 0.5}, {}, {}, False),
    "Top2Gate string": ("Top2Gate", RELU, {}, {}, False),
    "two gates, second": ([{"type": "top", "k": 2}, {"type": "cosine_top", "k": 1, "proj_dim": 4}], RELU, {},
                          {"gate_index": 1}, False),
    "per-call overrides": ({"type": "top", "k": 1}, RELU, {},
                           {"top_k": 3, "capacity_factor": 0.6, "a2a_ffn_overlap_degree": 3}, False),
    "seeds": ({"type": "top", "k": 2}, RELU, {"seeds": (3, 4, 5)}, {}, False),
}


def build_both(name, seed):
    gate_type, experts, layer_args, _, _ = CASES[name]
    spec = {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H, **experts}
    spec.setdefault("hidden_size_per_expert", H)
    if spec["type"] == "custom":
        spec.pop("hidden_size_per_expert")
    layers = []
    for make in (real_tutel_moe().moe_layer, tutel_moe.moe_layer):
        torch.manual_seed(seed)      # deep copies: Tutel pops the keys of the dicts it is given
        layers.append(make(gate_type=copy.deepcopy(gate_type), model_dim=D, experts=copy.deepcopy(spec),
                           **copy.deepcopy(layer_args)))
    return layers


def relative(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_seed_gives_tutels_parameters(name, fresh_seed):
    tutel, mine = build_both(name, fresh_seed)
    theirs, ours = tutel.state_dict(), mine.state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert ours[key].shape == value.shape and ours[key].dtype == value.dtype, key
        assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_l_aux_and_gradients_equal_tutels(name, fresh_seed):
    tutel, mine = build_both(name, fresh_seed)
    torch.manual_seed(fresh_seed + 1)      # a different state, so that equal parameters come from the load
    mine.load_state_dict(tutel.state_dict(), strict=True)
    training, forward_args = CASES[name][4], CASES[name][3]
    tutel.train(training)
    mine.train(training)
    T = 100 if name != "few tokens" else 5
    x = torch.randn(T, D)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(fresh_seed + 2)
    y_theirs = tutel(x_theirs, **forward_args)
    torch.manual_seed(fresh_seed + 2)
    y_ours = mine(x_ours, **forward_args)
    assert relative(y_ours, y_theirs) < 1e-6
    assert abs(float(y_ours.l_aux) - float(y_theirs.l_aux)) < 1e-6 * max(1.0, abs(float(y_theirs.l_aux)))
    assert mine.l_aux is y_ours.l_aux
    grad = torch.randn_like(y_theirs)
    (y_theirs * grad).sum().add(0.5 * y_theirs.l_aux).backward()
    (y_ours * grad).sum().add(0.5 * y_ours.l_aux).backward()
    assert relative(x_ours.grad, x_theirs.grad) < 1e-5
    theirs = {key: value.grad for key, value in tutel.state_dict(keep_vars=True).items() if value.requires_grad}
    ours = grads_in_tutel_layout(mine)
    assert sorted(ours) == sorted(theirs)
    for key, want in theirs.items():
        if want is None:
            assert ours[key] is None, key
        else:
            assert relative(ours[key].reshape(want.shape), want) < 2e-5, key


@pytest.mark.parametrize("name", ["top2 cf0.75", "cosine_top", "llama_ffn", "custom experts", "two gates, second",
                                  "no fc2 bias"])
def test_state_dicts_load_both_ways_strictly(name, fresh_seed):
    tutel, mine = build_both(name, fresh_seed)
    _, fresh = build_both(name, fresh_seed + 1)
    fresh.load_state_dict(tutel.state_dict(), strict=True)          # Tutel -> drop-in
    for layer in (tutel, fresh):
        for param in layer.parameters():
            param.data.add_(torch.randn_like(param) * 0.01)          # both move away from the seed's values
    tutel.load_state_dict(fresh.state_dict(), strict=True)          # drop-in -> Tutel
    tutel.eval()
    fresh.eval()
    x = torch.randn(40, D)
    forward_args = CASES[name][3]
    assert relative(fresh(x, **forward_args), tutel(x, **forward_args)) < 1e-6
