"""The expert and router features Hugging Face families need (GeGLU, squared ReLU, clamped SwiGLU and
gpt-oss's variant, a router bias, sqrt(softplus) scores, groups scored by their best expert, gating on
the expert input) against the einsum reference, in fp64 and fp32, on the native and the torch kernels;
their backward against autograd; compile, bf16 and hidden slices. The HF blocks they serve are checked
in tests/integrations/transformers/test_hf_features.py."""
import pickle

import pytest
import torch

from helpers.compare import relative_error
from helpers.expert_parallel import D, H, expected_shard, single_process_grads
from helpers.launch import run_workers
from helpers.reference import assert_matches_reference, make_layer, outputs_and_grads
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.activations import Activation, activate, activation_backward, forward
from moe_plugin.experts import Experts
from moe_plugin.ops import ENV
from moe_plugin.reference import reference_moe


GATED = ["swiglu", "geglu", "geglu_tanh", "swiglu_oai"]
ACTIVATIONS = [Activation("geglu"), Activation("geglu_tanh"), Activation("relu2"), Activation("swiglu", 0.3),
               Activation("swiglu_oai", 0.4, 1.702), Activation("swiglu_oai", 7.0, 1.702)]

FEATURES = {
    "geglu shared": dict(activation="geglu", shared_hidden_size=7, shared_gate=True),
    "geglu_tanh no bias": dict(activation="geglu_tanh", bias=False, top_k=3),
    "relu2 sigmoid groups": dict(activation="relu2", router="sigmoid", num_experts=8, top_k=2, num_groups=4,
                                 topk_groups=2, shared_hidden_size=5, route_scale=2.5),
    "swiglu clamped shared": dict(activation="swiglu", activation_limit=0.3, shared_hidden_size=6, bias=False),
    "swiglu clamped, shared not": dict(activation="swiglu", activation_limit=0.3, shared_hidden_size=6,
                                       clamp_shared=False),
    "gpt-oss": dict(activation="swiglu_oai", activation_limit=0.4, activation_alpha=1.702, router_bias=True,
                    num_experts=8, top_k=4),
    "router bias sigmoid": dict(router="sigmoid", router_bias=True, activation="swiglu", normalize_gate="none"),
    "sqrt_softplus": dict(router="sqrt_softplus", num_experts=8, top_k=3, activation="swiglu",
                          activation_limit=0.5, route_scale=1.5, shared_hidden_size=4),
    "sqrt_softplus groups": dict(router="sqrt_softplus", num_experts=12, top_k=2, num_groups=4, topk_groups=2,
                                 group_score="max", normalize_gate="after_drop"),
    "group max softmax": dict(num_experts=16, top_k=3, num_groups=8, topk_groups=2, group_score="max",
                              normalize_gate="none", route_scale=16.0, activation="swiglu", shared_hidden_size=5),
    "llama4": dict(router="sigmoid", top_k=1, gate_on_input=True, normalize_gate="none", activation="swiglu",
                   bias=False, shared_hidden_size=9),
    "gate on input softmax": dict(top_k=1, gate_on_input=True, activation="geglu_tanh", router_bias=True),
    "gate on input top-3": dict(num_experts=8, top_k=3, gate_on_input=True),
    "tutel capacity": dict(num_experts=8, top_k=2, capacity_formula="tutel", capacity_alignment=3, min_capacity=0),
    "cosine projected": dict(router="cosine", router_proj_dim=5, num_experts=6, top_k=2),
    "gemma4": dict(router_norm=True, expert_gate_scale=True, activation="geglu_tanh", bias=False, num_experts=8,
                   top_k=3),
}


@pytest.mark.parametrize("field_values, named", [
    (dict(activation="relu", activation_limit=7.0), ["activation_limit", "activation='relu'"]),
    (dict(activation="geglu", activation_limit=7.0), ["activation_limit", "activation='geglu'"]),
    (dict(activation="swiglu", activation_alpha=1.702), ["activation_alpha", "swiglu_oai"]),
    (dict(activation="swiglu_oai", activation_alpha=1.702), ["activation_limit", "swiglu_oai"]),
    (dict(activation="swiglu_oai", activation_limit=7.0), ["activation_alpha", "swiglu_oai"]),
    (dict(activation="swiglu", activation_limit=-1.0), ["activation_limit", "-1.0", "> 0"]),
    (dict(activation="swiglu", activation_limit=float("inf")), ["activation_limit", "finite"]),
    (dict(activation="swiglu", clamp_shared=False), ["clamp_shared", "activation_limit"]),
    (dict(router="cosine", router_bias=True), ["router_bias", "router='cosine'"]),
    (dict(router_bias="yes"), ["router_bias", "'yes'", "true or false"]),
    (dict(router_proj_dim=4), ["router_proj_dim", "router='softmax'"]),
    (dict(aux_loss="load_importance", gate_noise=1.0), ["load_importance", "gate_noise_kind"]),
    (dict(capacity_formula="floor"), ["capacity_formula", "'ceil', 'tutel'"]),
    (dict(group_score="sum"), ["group_score", "'sum'", "'top2_sum', 'max'"]),
    (dict(group_score="max"), ["group_score", "num_groups=1", "topk_groups=1"]),
    (dict(group_score="max", num_groups=4, topk_groups=4), ["group_score", "topk_groups=4"]),
    (dict(router="softplus"), ["router", "'sqrt_softplus'"]),
    (dict(activation="swish"), ["activation", "'geglu', 'geglu_tanh', 'relu2', 'swiglu_oai'"]),
    (dict(router_norm=True, router="cosine"), ["router_norm", "router='cosine'"]),
    (dict(router_norm=True, router_norm_eps=0.0), ["router_norm_eps", "0.0", "> 0"]),
    (dict(expert_gate_scale=1), ["expert_gate_scale", "true or false"]),
])
def test_invalid_combinations_name_the_fields(field_values, named):
    with pytest.raises(ValueError) as error:
        MoEConfig(model_dim=8, hidden_size=16, num_experts=8, **field_values)
    for text in named:
        assert text in str(error.value)


def test_defaults_add_nothing():
    config = MoEConfig(model_dim=8, hidden_size=16)
    assert (config.activation_limit, config.activation_alpha, config.clamp_shared, config.router_bias,
            config.gate_on_input, config.group_score) == (None, None, True, False, False, "top2_sum")
    layer = MoELayer(config)
    assert layer.router.bias_E is None and "router.bias_E" not in layer.state_dict()


@pytest.mark.parametrize("act", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_activation_backward_equals_autograd(act, dtype):
    width = 2 * 33 if act.gated else 33
    pre = (torch.randn(17, width, dtype=torch.float64) * (act.limit or 1.0) * 1.5).to(dtype)
    if act.limit is not None:    # exactly at the bounds too: the clamp passes the gradient there
        pre[0, :4] = torch.tensor([act.limit, -act.limit, act.limit, -act.limit], dtype=dtype)
        pre[0, 33:37] = pre[0, :4]
    grad = torch.randn(17, 33, dtype=dtype)
    want_pre = pre.clone().requires_grad_()
    want = forward(want_pre, act)
    want.backward(grad)
    got, saved = activate(pre.clone(), act)
    again, grad_pre = activation_backward(saved, grad, act)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    assert relative_error(got, want.detach()) <= tol and relative_error(again, want.detach()) <= tol
    assert relative_error(grad_pre, want_pre.grad) <= tol
    if act.limit is not None:
        assert (pre.abs() > act.limit).any(), "the clamp must engage"


@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_features_match_einsum_reference_fp64(name, capacity_factor):
    layer = make_layer(capacity_factor=capacity_factor, **FEATURES[name])
    _perturb_router_bias(layer)
    assert_matches_reference(layer, torch.randn(3, 23, 12, dtype=torch.float64), 1e-10)
    if capacity_factor:
        assert layer.stats["dropped_fraction"] > 0


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_features_match_einsum_reference_fp32(name, kernels, monkeypatch):
    monkeypatch.setenv(ENV, kernels)
    layer = make_layer(torch.float32, capacity_factor=0.7, **FEATURES[name])
    _perturb_router_bias(layer)
    assert_matches_reference(layer, torch.randn(45, 12), 1e-5)


def _perturb_router_bias(layer):
    """The router bias, and the router's input and gate scales, away from their initial 0s and 1s."""
    with torch.no_grad():
        if layer.router.bias_E is not None:
            layer.router.bias_E.copy_(torch.randn_like(layer.router.bias_E))
        for scale in (layer.router.input_scale_D, layer.router.gate_scale_E):
            if scale is not None:
                scale.copy_(1 + 0.5 * torch.randn_like(scale))


def test_each_feature_changes_the_output():
    """The features are not silently ignored: switching one off changes the layer's output."""
    x = torch.randn(40, 12, dtype=torch.float64)
    cases = {"activation_limit": dict(activation="swiglu", activation_limit=0.3),
             "router_bias": dict(router_bias=True), "gate_on_input": dict(top_k=1, gate_on_input=True),
             "group_score": dict(num_experts=16, num_groups=8, topk_groups=2, group_score="max"),
             "router_norm": dict(router_norm=True), "expert_gate_scale": dict(expert_gate_scale=True)}
    for field, values in cases.items():
        torch.manual_seed(0)
        layer = make_layer(capacity_factor=0.0, **values)
        _perturb_router_bias(layer)
        plain = make_layer(capacity_factor=0.0, **{**values, field: MoEConfig.__dataclass_fields__[field].default})
        state = {k: v for k, v in layer.state_dict().items() if k in plain.state_dict()}
        plain.load_state_dict(state)
        assert not torch.allclose(layer(x), plain(x)), field


@pytest.mark.parametrize("activation", GATED + ["relu2"])
def test_hidden_slices_add_up_to_the_whole_expert(activation):
    """Sliced experts (parallel r > 1): each slice's [gate | up] columns act alone; the partial outputs add up."""
    extra = dict(activation_limit=0.3, activation_alpha=1.702) if activation == "swiglu_oai" else {}
    config = MoEConfig(model_dim=6, hidden_size=8, num_experts=1, top_k=1, activation=activation, **extra)
    act = Experts(config).activation
    whole = {k: v.double() for k, v in Experts.full_expert(config, seed=3).items()}
    x = torch.randn(9, 6, dtype=torch.float64)

    def run(e, with_b2):
        y = forward(x @ e["w1"] + e["b1"], act) @ e["w2"]
        return y + e["b2"] if with_b2 else y
    parts = [run(Experts.take_slice(whole, 4, i), i == 0) for i in range(4)]
    assert torch.allclose(sum(parts), run(whole, True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["gpt-oss", "llama4", "sqrt_softplus groups"])
def test_fullgraph_compile_equals_eager(name):
    """Each feature's layer traced whole by dynamo and AOT autograd (aot_eager: the graph capture and the backward
    graph, where a feature could break; inductor's code generation of the layer is tests/core/test_compile.py's)."""
    torch._dynamo.reset()
    layer = make_layer(torch.float32, capacity_factor=0.0, **FEATURES[name])
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(37, 12)
    y, aux, grads = outputs_and_grads(lambda x: (compiled(x), layer.aux_loss), layer, x)
    y_ref, aux_ref, grads_ref = outputs_and_grads(lambda x: (layer(x), layer.aux_loss), layer, x)
    assert relative_error(y, y_ref) <= 1e-5 and relative_error(aux, aux_ref) <= 1e-5
    for key in grads_ref:
        assert relative_error(grads[key], grads_ref[key]) <= 1e-5, key


@pytest.mark.parametrize("name", ["gpt-oss", "llama4", "geglu shared", "relu2 sigmoid groups"])
def test_bf16_autocast_follows_fp32(name):
    layer = make_layer(torch.float32, capacity_factor=0.0, **FEATURES[name])
    x = torch.randn(64, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = layer(x)
    y32 = layer(x)
    assert y16.dtype == torch.bfloat16 and relative_error(y16.float(), y32) <= 5e-2


def test_router_bias_and_activation_survive_state_dict_and_pickle():
    layer = make_layer(torch.float32, **FEATURES["gpt-oss"])
    _perturb_router_bias(layer)
    copy = make_layer(torch.float32, **FEATURES["gpt-oss"])
    copy.load_state_dict(layer.state_dict())
    x = torch.randn(20, 12)
    assert torch.equal(copy(x), layer(x))
    again = pickle.loads(pickle.dumps(layer))
    assert again.experts.activation == Activation("swiglu_oai", 0.4, 1.702) and torch.equal(again(x), layer(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
# limits exact in bf16, so that the rows placed at them sit on the bounds in every dtype
@pytest.mark.parametrize("limit, alpha, beta", [(0.375, 1.0, 0.0), (0.75, 1.702, 1.0), (7.0, 1.702, 1.0)])
def test_native_clamped_swiglu_matches_torch_ops(dtype, limit, alpha, beta):
    from moe_plugin.ops import native, torch_ops
    kernels, why = native.load()
    if kernels is None:
        pytest.skip(f"native kernels unavailable: {why}")
    pre = (torch.randn(37, 2 * 45, dtype=torch.float64) * 1.2 * limit).to(dtype)
    pre[0, :3] = torch.tensor([limit, -limit, limit], dtype=torch.float64).to(dtype)   # at the bounds
    pre[0, 45:48] = pre[0, :3]
    grad = torch.randn(37, 45, dtype=dtype)
    want_act = torch_ops.clamped_swiglu_forward(pre.double(), limit, alpha, beta)
    want_grad, want_act2 = torch_ops.clamped_swiglu_backward(grad.double(), pre.double(), limit, alpha, beta)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    got_grad, got_act2 = kernels.clamped_swiglu_backward(grad, pre, limit, alpha, beta)
    assert relative_error(kernels.clamped_swiglu_forward(pre, limit, alpha, beta), want_act) <= tol
    assert relative_error(got_act2, want_act2) <= tol and relative_error(got_grad, want_grad) <= tol
    assert (pre.double().abs() > limit).any(), "the clamp must engage"


PARALLEL_SPECS = [   # on 2 processes; hidden 8 and model dim 6 (helpers.expert_parallel's expected_shard)
    dict(name="gpt-oss ep", E=8, k=4, cf=0.0, r=1, d=1, tokens=[7, 4],
         features=dict(activation="swiglu_oai", activation_limit=0.4, activation_alpha=1.702, router_bias=True)),
    dict(name="llama4 drops overlap", E=4, k=1, cf=0.6, r=1, d=2, tokens=[9, 0],
         features=dict(router="sigmoid", gate_on_input=True, normalize_gate="none", activation="swiglu", bias=False,
                       shared_hidden_size=5)),
    dict(name="sliced geglu_tanh", E=1, k=1, cf=0.0, r=2, d=1, tokens=[5, 6],
         features=dict(activation="geglu_tanh", shared_hidden_size=3)),
    dict(name="sliced clamped swiglu, shared unclamped", E=1, k=1, cf=0.0, r=2, d=1, tokens=[6, 3],
         features=dict(activation="swiglu", activation_limit=0.3, clamp_shared=False, shared_hidden_size=4)),
    dict(name="relu2 sqrt_softplus group max gathered", E=8, k=2, cf=1.0, r=0, d=1, tokens=[8, 5],
         features=dict(activation="relu2", router="sqrt_softplus", num_groups=4, topk_groups=2, group_score="max")),
]


def _parallel_features(rank, world, specs):
    worst = {}
    for i, spec in enumerate(specs):
        config = dict(model_dim=D, hidden_size=H, num_experts=spec["E"], top_k=spec["k"], capacity_factor=spec["cf"],
                      min_capacity=0, z_loss_coef=0.01, **spec["features"])
        torch.manual_seed(i)
        reference = MoELayer(MoEConfig(**config)).double()
        layer = MoELayer(MoEConfig(**config, ep_size=world, parallel=spec["r"], overlap_degree=spec["d"])).double()
        layer.load_full_state_dict(reference.state_dict())
        generator = torch.Generator().manual_seed(i + 100)
        xs = [torch.randn(n, D, generator=generator, dtype=torch.float64) * 3 for n in spec["tokens"]]
        upstreams = [torch.randn(x.shape, generator=generator, dtype=torch.float64) for x in xs]
        names, total, mine = single_process_grads(reference, xs, upstreams, rank)
        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        ((y * upstreams[rank]).sum() + layer.aux_loss).backward()
        errors = {"y": relative_error(y.detach(), mine["y"], floor=1e-12),
                  "x.grad": relative_error(x.grad, mine["x.grad"], floor=1e-12)}
        params = dict(layer.named_parameters())
        for name in names:
            want = mine[name] if not name.startswith("experts.") else expected_shard(
                total[name], name, layer.groups.layout, layer.experts.activation.gated)
            errors[name] = relative_error(params[name].grad, want, floor=1e-12)
        worst[spec["name"]] = (max(errors.values()), max(errors, key=errors.get), layer.groups.layout.slices)
    return worst


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_match_one_process():
    results = run_workers(_parallel_features, 2, PARALLEL_SPECS, timeout=800)
    for spec in PARALLEL_SPECS:
        for rank, worst in enumerate(results):
            error, where, slices = worst[spec["name"]]
            assert error < 1e-10, f"{spec['name']}: rank {rank} {where} off by {error:.3g}"
            assert slices == (2 if spec["r"] == 2 else 1)


def test_router_bias_draws_as_its_weight():
    """Uniform in +-1/sqrt(D) by default; normal(0, init_std) as HF's _init_weights draws gpt-oss's router bias."""
    layer = MoELayer(MoEConfig(model_dim=16, hidden_size=8, num_experts=256, router_bias=True))
    bias = layer.router.bias_E.detach()
    assert bias.abs().max() <= 0.25 and bias.std() > 0.1
    layer.router.init_std = 0.02
    layer.router.reset_parameters()
    assert 0.015 < float(layer.router.bias_E.std()) < 0.025 and float(layer.router.bias_E.abs().max()) > 0.02


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_router_input_apart_from_the_experts_input(dtype, tolerance):
    """Gemma 4: the router sees one input (the residual stream), the experts another (its normed copy)."""
    layer = make_layer(dtype, capacity_factor=0.0, **FEATURES["gemma4"])
    _perturb_router_bias(layer)
    x, r = torch.randn(3, 11, 12, dtype=dtype), torch.randn(3, 11, 12, dtype=dtype)
    params = list(layer.parameters())
    upstream = torch.randn(x.shape, dtype=dtype)
    results = []
    for forward in (lambda x, r: (layer(x, router_input=r), layer.aux_loss), lambda x, r: reference_moe(layer, x, r)):
        xi, ri = x.clone().requires_grad_(), r.clone().requires_grad_()
        y, aux = forward(xi, ri)
        grads = torch.autograd.grad((y * upstream).sum() + aux, [xi, ri] + params)
        results.append((y.detach(),) + grads)
    for got, want in zip(*results):
        assert relative_error(got, want) <= tolerance
    assert not torch.allclose(layer(x, router_input=r), layer(x))
    with pytest.raises(ValueError, match="router_input must have x's shape"):
        layer(x, router_input=r[:, :5])
