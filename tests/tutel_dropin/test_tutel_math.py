"""The drop-in (moe_plugin.tutel.moe_layer) against tutel_reference.py, Tutel's semantics written out plainly: output,
l_aux and every gradient, for each gate and expert type and the options that change the math."""
import pytest
import torch
import torch.nn.functional as F
from tutel_common import grads_in_tutel_layout
from tutel_reference import tutel_reference

from moe_plugin import tutel as tutel_moe

D, H, E = 6, 5, 8
RELU = {"activation_fn": F.relu}

# name: (gate_type, experts, layer arguments, forward arguments, tokens, training)
CASES = {
    "top1 cf1": ({"type": "top", "k": 1}, RELU, {}, {}, 37, False),
    "top2 cf1, T 100 (26 slots, not 25)": ({"type": "top", "k": 2, "capacity_factor": 1.0}, RELU, {}, {}, 100, False),
    "top2 cf0.75 drops": ({"type": "top", "k": 2, "capacity_factor": 0.75}, RELU, {}, {}, 37, False),
    "top2 dropless": ({"type": "top", "k": 2, "capacity_factor": 0.0}, RELU, {}, {}, 37, False),
    "top2 negative cf": ({"type": "top", "k": 2, "capacity_factor": -0.5}, RELU, {}, {}, 37, False),
    "top3 cf1.25": ({"type": "top", "k": 3, "capacity_factor": 1.25}, RELU, {}, {}, 37, False),
    "few tokens, empty experts": ({"type": "top", "k": 1, "capacity_factor": 0.0}, RELU, {}, {}, 5, False),
    "batch prioritized": ({"type": "top", "k": 2, "capacity_factor": 0.75}, RELU,
                          {"batch_prioritized_routing": True}, {}, 37, False),
    "gate on input (is_postscore False)": ({"type": "top", "k": 2, "capacity_factor": 0.75}, RELU,
                                           {"is_postscore": False}, {}, 37, False),
    "gates not normalized": ({"type": "top", "k": 3}, RELU, {"normalize_gate": False}, {}, 37, False),
    "gate noise, gshard loss": ({"type": "top", "k": 2, "capacity_factor": 0.75, "gate_noise": 1.0}, RELU, {}, {},
                                37, True),
    "load_importance loss": ({"type": "top", "k": 2, "gate_noise": 0.5}, RELU, {"is_gshard_loss": False}, {}, 37,
                             True),
    "cosine gate": ({"type": "cosine_top", "k": 2, "capacity_factor": 0.75, "proj_dim": 4, "init_t": 0.3}, RELU, {},
                    {}, 37, False),
    "llama_ffn": ({"type": "top", "k": 2, "capacity_factor": 0.75}, None, {}, {}, 37, False),
    "activation lambda (general path)": ({"type": "top", "k": 2, "capacity_factor": 0.75},
                                         {"activation_fn": lambda h: torch.tanh(h) * 2}, {}, {}, 37, False),
    "fc1 bias only (general path)": ({"type": "top", "k": 2}, {**RELU, "has_fc2_bias": False}, {}, {}, 37, False),
    "per-call top_k, capacity, overlap alignment": ({"type": "top", "k": 1}, RELU, {},
                                                    {"top_k": 2, "capacity_factor": 0.6, "a2a_ffn_overlap_degree": 4},
                                                    37, False),
    "llama_ffn with tanh (general path)": ({"type": "top", "k": 2, "capacity_factor": 0.75},
                                           {"type": "llama_ffn", "activation_fn": torch.tanh}, {}, {}, 37, False),
    "activation_fn_with_self (general path)": ({"type": "top", "k": 2},
                                               {"activation_fn_with_self": lambda h, module: gelu_with_self(h, module)},
                                               {}, {}, 37, False),
    "custom experts": ({"type": "top", "k": 2, "capacity_factor": 0.75},
                       {"type": "custom", "module": lambda **kw: TanhExperts(**kw), "scale": 0.5}, {}, {}, 37, False),
    "second gate of two": ([{"type": "top", "k": 1}, {"type": "cosine_top", "k": 2, "proj_dim": 3,
                                                      "capacity_factor": 0.75}], RELU, {}, {"gate_index": 1}, 37,
                           False),
}


class TanhExperts(torch.nn.Module):
    """A user's expert module in Tutel's contract: every local expert at once, x [E_local, C, D] -> [E_local, C, D]."""

    def __init__(self, model_dim, num_experts_per_device, sharded_count, scale=1.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(num_experts_per_device, model_dim, model_dim) * 0.3)
        self.scale = scale

    def forward(self, x, ctx):
        return torch.tanh(torch.matmul(x, self.weight)) * self.scale * ctx.num_global_experts


def custom_reference(state, e, x_D):
    return torch.tanh(x_D @ state["experts.weight"][e]) * 0.5 * E


SEEN_BY_ACTIVATION = []    # what activation_fn_with_self was called with (Tutel passes the experts module)


def gelu_with_self(h, module):
    SEEN_BY_ACTIVATION.append(module)
    return F.gelu(h) + 0.1 * h


def build(gate_type, experts, layer_args):
    spec = {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H,
            **({"type": "llama_ffn"} if experts is None else experts)}
    if spec["type"] == "custom":
        spec.pop("hidden_size_per_expert")
    return tutel_moe.moe_layer(gate_type=gate_type, model_dim=D, experts=spec, **layer_args)


def activation_of(experts):
    """The activation the reference applies: the case's, or the expert type's default."""
    experts = experts or {"type": "llama_ffn"}
    if "activation_fn_with_self" in experts:
        return lambda h: F.gelu(h) + 0.1 * h
    return experts.get("activation_fn", F.silu if experts.get("type") == "llama_ffn" else F.relu)


def reference_arguments(gate_type, experts, layer_args, forward_args):
    index = forward_args.get("gate_index", 0)
    gate = gate_type[index] if isinstance(gate_type, list) else gate_type
    overlap = forward_args.get("a2a_ffn_overlap_degree", 1)
    return dict(top_k=forward_args.get("top_k") or gate.get("k", 1), gate=index,
                capacity_factor=forward_args.get("capacity_factor") or gate.get("capacity_factor", 1.0),
                normalize_gate=layer_args.get("normalize_gate", True),
                is_postscore=layer_args.get("is_postscore", True),
                batch_prioritized_routing=layer_args.get("batch_prioritized_routing", False),
                is_gshard_loss=layer_args.get("is_gshard_loss", True), gate_noise=gate.get("gate_noise", 0.0),
                activation=activation_of(experts), llama=(experts or {"type": "llama_ffn"}).get("type") == "llama_ffn",
                alignment=overlap, expert_fn=custom_reference if (experts or {}).get("type") == "custom" else None)


def run_both(name, dtype, seed):
    gate_type, experts, layer_args, forward_args, T, training = CASES[name]
    layer = build(gate_type, experts, layer_args).to(dtype).train(training)
    state = {key: value.detach().clone().requires_grad_(value.is_floating_point())
             for key, value in layer.state_dict().items()}
    x = torch.randn(T, D, dtype=dtype)
    x_mine, x_ref = x.clone().requires_grad_(), x.clone().to(torch.promote_types(dtype, torch.float32))
    x_ref.requires_grad_()
    torch.manual_seed(seed)
    y = layer(x_mine, **forward_args)
    torch.manual_seed(seed)
    noise_TE = torch.randn(T, E, dtype=torch.promote_types(dtype, torch.float32)) if training else None
    ref_state = {key: value.to(x_ref.dtype) if value.is_floating_point() else value for key, value in state.items()}
    want, want_aux, kept = tutel_reference(ref_state, x_ref, noise_TE=noise_TE,
                                           **reference_arguments(gate_type, experts, layer_args, forward_args))
    grad = torch.randn_like(want)
    (y.to(want.dtype) * grad).sum().add(0.3 * y.l_aux.to(want.dtype)).backward()
    (want * grad).sum().add(0.3 * want_aux).backward()
    return layer, y, want, want_aux, kept, (x_mine, x_ref), state


def relative(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("name", sorted(CASES))
def test_dropin_equals_tutel_semantics_fp64(name, fresh_seed):
    layer, y, want, want_aux, kept, (x_mine, x_ref), state = run_both(name, torch.float64, fresh_seed)
    assert y.shape == want.shape and y.dtype == torch.float64
    assert relative(y, want) < 1e-10
    assert y.l_aux is layer.l_aux and abs(float(y.l_aux) - float(want_aux)) < 1e-6 * max(1.0, abs(float(want_aux)))
    assert relative(x_mine.grad, x_ref.grad) < 1e-9
    grads = grads_in_tutel_layout(layer)
    assert sorted(grads) == sorted(key for key, value in state.items() if value.is_floating_point())
    for key, got in grads.items():
        if state[key].grad is None:
            assert got is None, key
        else:
            assert relative(got.reshape(state[key].shape), state[key].grad) < 1e-8, key
    if any(word in name for word in ("0.75", "0.6", "negative")):
        assert not all(all(row) for row in kept), "the case must drop some choices"
    if "with_self" in name:
        assert SEEN_BY_ACTIVATION and all(module is layer.experts.module for module in SEEN_BY_ACTIVATION)


def test_few_tokens_leave_experts_empty(fresh_seed):
    layer, *_ = run_both("few tokens, empty experts", torch.float64, fresh_seed)
    assert 0 in layer.stats["tokens_per_expert"]


@pytest.mark.parametrize("name", ["top2 cf0.75 drops", "gate on input (is_postscore False)", "llama_ffn"])
def test_dropin_equals_tutel_semantics_bf16(name, fresh_seed):
    gate_type, experts = CASES[name][:2]
    smooth = experts if experts is None else {**experts, "activation_fn": F.gelu}   # ReLU's kink flips with rounding
    CASES[name + " fp32 gate"] = ({**gate_type, "fp32_gate": True}, smooth) + CASES[name][2:]
    try:
        layer, y, want, want_aux, kept, (x_mine, x_ref), state = run_both(name + " fp32 gate", torch.bfloat16,
                                                                           fresh_seed)
    finally:
        del CASES[name + " fp32 gate"]
    assert y.dtype == torch.bfloat16
    assert relative(y, want) < 3e-2
    assert relative(x_mine.grad, x_ref.grad) < 5e-2


def test_parameter_iterators_give_tutel_names():
    layer = build([{"type": "top", "k": 2}, {"type": "cosine_top", "proj_dim": 4}], RELU, {})
    assert [name for name, _ in layer.get_parameter_iterator("gate")] == [
        "0.wg.weight", "1.temperature", "1.sim_matrix", "1.cosine_projector.weight", "1.cosine_projector.bias"]
    assert [name for name, _ in layer.get_parameter_iterator("local_experts")] == [
        "batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias"]
    assert all(getattr(param, "_tutel_expert", False) for _, param in layer.get_parameter_iterator("local_experts"))
    with pytest.raises(ValueError, match="param_type='router'"):
        layer.get_parameter_iterator("router")


@pytest.mark.parametrize("experts, names", [
    (None, ["W_fc1", "W_fc3"]),      # the fast path: W_fc1 and W_fc2 joined in one parameter [E, D, 2H]
    ({"type": "llama_ffn", "activation_fn": torch.tanh}, ["W_fc1", "W_fc2", "W_fc3"]),     # the general path
    ({"type": "ffn", **RELU}, ["batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias"])])
def test_the_expert_iterator_yields_each_expert_parameter_once(experts, names):
    """What Tutel's users do with it (scan_expert_func marks, optimizer groups) reaches the layer's own
    parameters: every expert parameter once, nothing else, under the names docs/tutel.md gives."""
    layer = build({"type": "top", "k": 2}, experts, {})
    pairs = list(layer.get_parameter_iterator("local_experts"))
    assert [name for name, _ in pairs] == names
    expert_params = {id(p) for name, p in layer.named_parameters() if name.startswith("experts.")}
    assert sorted(id(p) for _, p in pairs) == sorted(expert_params)
    gate_params = {id(p) for name, p in layer.named_parameters() if name.startswith("gates.")}
    assert {id(p) for _, p in layer.get_parameter_iterator("gate")} == gate_params


def test_result_func_and_scan_expert_func_are_applied():
    seen = []
    layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=D,
                                experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": H, **RELU},
                                scan_expert_func=lambda name, param: seen.append(name),
                                result_func=lambda y: y * 2)
    layer.eval()
    x = torch.randn(3, 4, D)
    doubled = layer(x)
    layer.result_func = None
    assert torch.equal(doubled, 2 * layer(x)) and doubled.shape == x.shape
    assert seen == ["batched_fc1_w", "batched_fc2_w", "batched_fc1_bias", "batched_fc2_bias"]
