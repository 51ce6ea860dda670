"""update_expert_bias against a written-out loop: counts over micro-batches, the sign rule, clearing."""
import math

import pytest
import torch

from moe_plugin import MoEConfig, MoELayer, update_expert_bias


def written_out_choices(layer, x_TD, bias):
    """Each token's top_k experts on sigmoid scores + bias, inside its best groups, by plain sorting."""
    cfg = layer.config
    W = layer.router.weight_ED.detach().tolist()
    M = cfg.num_experts // cfg.num_groups
    chosen = []
    for x in x_TD.tolist():
        score = [1 / (1 + math.exp(-sum(a * b for a, b in zip(x, w)))) + bias[e] for e, w in enumerate(W)]
        groups = sorted(range(cfg.num_groups), key=lambda g: -sum(sorted(score[g * M:(g + 1) * M])[-2:]))
        allowed = [e for g in groups[:cfg.topk_groups] for e in range(g * M, (g + 1) * M)]
        chosen += sorted(allowed, key=lambda e: -score[e])[:cfg.top_k]
    return chosen


def test_update_matches_a_written_out_loop_over_steps_and_micro_batches():
    base = dict(model_dim=6, hidden_size=5, router="sigmoid", capacity_factor=0.5)
    layers = torch.nn.ModuleList([
        MoELayer(MoEConfig(**base, num_experts=8, top_k=2, num_groups=4, topk_groups=2, expert_bias_update_rate=0.05)),
        MoELayer(MoEConfig(**base, num_experts=5, top_k=3, expert_bias_update_rate=0.2)),
        MoELayer(MoEConfig(**base, num_experts=4, top_k=1)),   # bias off: never updated
    ]).double()
    for layer in layers[:2]:
        layer.router.expert_bias_E.copy_(0.1 * torch.randn(layer.config.num_experts))
    biases = [layer.router.expert_bias_E.tolist() for layer in layers]
    for step in range(3):
        counts = [[0] * layer.config.num_experts for layer in layers]
        for tokens in [17, 0, 9, 30][:2 + step]:          # micro-batches of one optimizer step
            for i, layer in enumerate(layers):
                x_TD = torch.randn(tokens, 6, dtype=torch.float64)
                layer(x_TD)
                for e in written_out_choices(layer, x_TD, biases[i]):
                    counts[i][e] += 1
        assert update_expert_bias(layers) == 2
        for i, layer in enumerate(layers[:2]):
            mean = sum(counts[i]) / len(counts[i])
            rate = layer.config.expert_bias_update_rate
            biases[i] = [b + rate * ((mean > c) - (mean < c)) for b, c in zip(biases[i], counts[i])]
        for layer, bias in zip(layers, biases):   # an fp32 buffer: a wrong sign would be off by 2 * rate
            assert layer.router.expert_bias_E.tolist() == pytest.approx(bias, abs=1e-6)
    assert biases[2] == [0.0] * 4


def test_counts_only_in_training_and_cleared_by_the_update():
    layer = MoELayer(MoEConfig(model_dim=6, hidden_size=5, num_experts=4, top_k=1, expert_bias_update_rate=0.1))
    layer.eval()
    layer(torch.randn(40, 6))
    assert update_expert_bias(layer) == 1 and torch.equal(layer.router.expert_bias_E, torch.zeros(4))
    layer.train()
    layer.router.weight_ED.data[0] += 10.0    # expert 0 gets most tokens
    layer(torch.randn(40, 6).abs())
    update_expert_bias(layer)
    moved = layer.router.expert_bias_E.clone()
    assert moved[0] == pytest.approx(-0.1) and moved.abs().tolist() == pytest.approx([0.1] * 4)
    assert update_expert_bias(layer) == 1 and torch.equal(layer.router.expert_bias_E, moved)   # counts were cleared


def test_no_layer_with_the_bias_is_not_an_error():
    assert update_expert_bias(torch.nn.Linear(3, 3)) == 0
    assert update_expert_bias(MoELayer(MoEConfig(model_dim=4, hidden_size=4))) == 0


def test_balancing_evens_out_a_skewed_router():
    """With the bias on and no aux loss, the router weights fixed, the loads even out over steps."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=8, hidden_size=4, num_experts=8, top_k=2, router="sigmoid",
                               aux_loss="none", expert_bias_update_rate=0.005, capacity_factor=0.0))
    layer.router.weight_ED.data[:2] += 0.5
    x = torch.randn(512, 8)
    late_E = torch.zeros(8)
    with torch.no_grad():
        first_E = torch.bincount(layer.router(x).expert_TK.reshape(-1), minlength=8).float()
        for step in range(300):
            layer(x)
            if step >= 200:                 # the bias oscillates around balance: average the late loads
                late_E += layer.router.load_E.float()
            update_expert_bias(layer)
    before, after = float(first_E.max() / first_E.mean()), float(late_E.max() / late_E.mean())
    assert before > 1.3 and after < 1.1, (before, after)
