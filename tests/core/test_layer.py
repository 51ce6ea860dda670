import itertools

import pytest
import torch

from moe_plugin import MoEConfig, MoELayer, aux_loss
from moe_plugin.reference import reference_moe
from helpers.reference import assert_matches_reference, make_layer

MATRIX = [(k, e, cf) for k, e, cf in itertools.product([1, 2, 4], [1, 4, 16], [-1.0, 0.0, 0.5, 1.25]) if k <= e]


@pytest.mark.parametrize("top_k, num_experts, capacity_factor", MATRIX)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_matches_einsum_reference(top_k, num_experts, capacity_factor, dtype, tolerance):
    layer = make_layer(dtype, num_experts=num_experts, top_k=top_k, capacity_factor=capacity_factor)
    x = torch.randn(3, 29, 12, dtype=dtype)   # 87 tokens
    assert_matches_reference(layer, x, tolerance)
    dropped = layer.stats["dropped_fraction"]
    if capacity_factor == 0.0:
        assert dropped == 0.0
    if capacity_factor == 0.5:
        assert dropped > 0.0


@pytest.mark.parametrize("options", [
    dict(router="sigmoid"), dict(router="cosine"), dict(router="softmax", fp32_router=False),
    dict(activation="gelu"), dict(activation="silu"), dict(activation="swiglu"), dict(bias=False),
    dict(normalize_gate="none"), dict(normalize_gate="after_drop"), dict(normalize_gate="after_drop", top_k=3),
    dict(normalize_gate="before_drop", top_k=1), dict(normalize_gate="after_drop", top_k=1),
    dict(batch_prioritized_routing=True), dict(batch_prioritized_routing=True, top_k=3, num_experts=5),
    dict(aux_loss="switch"), dict(aux_loss="none", z_loss_coef=0.0), dict(z_loss_coef=0.1, aux_loss_coef=1.0),
    dict(min_capacity=9), dict(top_k=8, num_experts=8, capacity_factor=0.3),
])
@pytest.mark.parametrize("capacity_factor", [0.6, 0.0])
def test_options_match_einsum_reference(options, capacity_factor):
    layer = make_layer(**dict(dict(capacity_factor=capacity_factor), **options))
    assert_matches_reference(layer, torch.randn(53, 12, dtype=torch.float64), 1e-10)


def test_eval_capacity_factor_applies_in_eval_mode():
    layer = make_layer(capacity_factor=2.0, eval_capacity_factor=0.25)
    x = torch.randn(64, 12, dtype=torch.float64)
    layer(x)
    train_capacity = layer.stats["capacity"]
    layer.eval()
    assert_matches_reference(layer, x, 1e-10)
    assert (train_capacity, layer.stats["capacity"]) == (64, 8)


def test_batch_prioritized_routing_keeps_the_most_confident_tokens():
    layer = make_layer(top_k=1, num_experts=1, capacity_factor=0.25, batch_prioritized_routing=True,
                       router="sigmoid")
    x = torch.randn(40, 12, dtype=torch.float64)
    y = layer(x)
    score = torch.sigmoid(x @ layer.router.weight_ED.t()).squeeze(1)
    kept = y.abs().sum(1) > 0
    assert int(kept.sum()) == 10
    assert score[kept].min() >= score[~kept].max()


def test_gradcheck_fp64():
    layer = make_layer(num_experts=3, top_k=2, capacity_factor=0.8, model_dim=5, hidden_size=6, activation="gelu")
    names = [n for n, _ in layer.named_parameters()]

    def run(x, *params):
        return torch.func.functional_call(layer, dict(zip(names, params)), (x,))
    inputs = (torch.randn(11, 5, dtype=torch.float64, requires_grad=True),) + tuple(
        p.detach().clone().requires_grad_() for p in layer.parameters())
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
def test_bf16_runs_close_to_fp32(activation):
    config = MoEConfig(model_dim=64, hidden_size=128, num_experts=8, top_k=2, capacity_factor=1.25,
                       activation=activation)
    layer_bf16 = MoELayer(config).to(torch.bfloat16)
    layer_fp32 = MoELayer(config)
    layer_fp32.load_state_dict({k: v.float() for k, v in layer_bf16.state_dict().items()})
    x_bf16 = torch.randn(4, 50, 64).to(torch.bfloat16).requires_grad_()
    x_fp32 = x_bf16.detach().float().requires_grad_()
    y_bf16, y_fp32 = layer_bf16(x_bf16), layer_fp32(x_fp32)
    assert y_bf16.dtype == torch.bfloat16 and layer_bf16.stats == layer_fp32.stats
    assert (y_bf16.float() - y_fp32).abs().max() <= 2e-2 * y_fp32.abs().max()
    upstream = torch.randn_like(y_fp32)
    y_bf16.backward(upstream.to(torch.bfloat16))
    y_fp32.backward(upstream)
    # relu's derivative jumps at 0, so bf16 rounding flips a few mask entries (plain PyTorch autograd in
    # bf16 shows the same); smooth activations stay within 2e-2, relu within 5e-2, in norm
    tolerance = 5e-2 if activation == "relu" else 2e-2
    for name, grad_bf16, grad_fp32 in [("x", x_bf16.grad, x_fp32.grad)] + [
            (n, p.grad, dict(layer_fp32.named_parameters())[n].grad) for n, p in layer_bf16.named_parameters()]:
        error = (grad_bf16.float() - grad_fp32).norm() / grad_fp32.norm()
        assert error <= tolerance, f"grad {name}: {error:.3g}"


@pytest.mark.parametrize("capacity_factor", [1.0, 0.0, -1.0])
def test_empty_batch(capacity_factor):
    layer = make_layer(capacity_factor=capacity_factor)
    x = torch.randn(0, 7, 12, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    (y.sum() + layer.aux_loss).backward()
    assert y.shape == (0, 7, 12) and x.grad.shape == x.shape
    assert float(layer.aux_loss) == 0.0 and layer.stats["dropped_fraction"] == 0.0
    y_ref, aux_ref = reference_moe(layer, x)
    assert y_ref.shape == y.shape and float(aux_ref) == 0.0


def test_fully_dropped_tokens_pass_through_as_zeros():
    layer = make_layer(num_experts=2, top_k=1, capacity_factor=0.1)
    x = torch.randn(50, 12, dtype=torch.float64)
    y = layer(x)
    stats = layer.stats
    zero_rows = int((y.abs().sum(1) == 0).sum())
    assert stats["capacity"] == 3 and zero_rows == 50 - sum(min(n, 3) for n in stats["tokens_per_expert"])


def test_stats():
    layer = make_layer(num_experts=4, top_k=2, capacity_factor=0.5)
    layer(torch.randn(30, 12, dtype=torch.float64))
    stats = layer.stats
    kept = sum(min(n, stats["capacity"]) for n in stats["tokens_per_expert"])
    assert sum(stats["tokens_per_expert"]) == 60 and stats["capacity"] == 8
    assert stats["dropped_fraction"] == pytest.approx(1 - kept / 60)
    assert stats["capacity_used"] == pytest.approx(kept / 32)


def test_wrong_input_shape_and_dtype():
    layer = make_layer()
    with pytest.raises(ValueError, match=r"model_dim=12.*\(5, 13\)"):
        layer(torch.randn(5, 13, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(5, 12, dtype=torch.long))


def test_layer_accepts_config_dict_and_kwargs():
    assert MoELayer(model_dim=8, hidden_size=16, num_experts=2, top_k=1).config.num_experts == 2
    assert MoELayer({"model_dim": 8, "hidden_size": 16}, num_experts=3).config.num_experts == 3
    with pytest.raises(ValueError, match="no field 'experts'"):
        MoELayer({"model_dim": 8, "hidden_size": 16, "experts": 3})


def test_aux_loss_sums_every_layer_of_a_model():
    model = torch.nn.Sequential(make_layer(), torch.nn.Linear(12, 12).double(), make_layer(aux_loss="switch"))
    model(torch.randn(20, 12, dtype=torch.float64))
    total = aux_loss(model)
    assert torch.allclose(total, model[0].aux_loss + model[2].aux_loss)
    assert float(total.detach()) > 0 and total.requires_grad
    assert float(aux_loss(torch.nn.Linear(2, 2))) == 0.0


def test_gate_noise_changes_choices_only_in_training():
    layer = make_layer(num_experts=8, gate_noise=1.0, capacity_factor=0.0)
    x = torch.randn(200, 12, dtype=torch.float64)
    layer.eval()
    clean = layer(x)
    assert torch.equal(clean, layer(x))
    layer.train()
    torch.manual_seed(5)
    noisy = layer(x)
    torch.manual_seed(5)
    assert torch.equal(noisy, layer(x)) and not torch.equal(noisy, clean)
