"""DeepSeek-V3-style routing against the einsum reference: balancing bias, group-limited choice,
route_scale, the (gated) shared expert and the sequence-wise aux loss."""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.reference import reference_moe
from moe_plugin.router import Router, balance_loss
from moe_plugin.shared_expert import SharedExpert
from helpers.host_syncs import HostSyncs
from helpers.reference import assert_matches_reference, make_layer


def with_random_bias(layer, scale=0.05):
    """A bias that routes whatever expert_bias_update_rate (a fixed bias, as DeepSeek-V3's)."""
    layer.router.fixed_bias = True
    layer.router.expert_bias_E.copy_(scale * torch.randn(layer.config.num_experts))
    return layer


FEATURES = [
    dict(router="sigmoid", num_experts=16, top_k=8, num_groups=4, topk_groups=2, route_scale=2.5),
    dict(router="sigmoid", num_experts=16, top_k=3, num_groups=8, topk_groups=3, shared_hidden_size=7),
    dict(router="softmax", num_experts=9, top_k=2, num_groups=3, topk_groups=1, shared_hidden_size=5,
         shared_gate=True, activation="swiglu"),
    dict(router="sigmoid", num_experts=12, top_k=5, num_groups=12, topk_groups=6, bias=False, shared_hidden_size=11,
         activation="gelu", normalize_gate="after_drop"),
    dict(router="softmax", num_experts=8, top_k=8, aux_loss="seq", route_scale=0.7, shared_hidden_size=3),
    dict(router="cosine", num_experts=6, top_k=1, num_groups=2, topk_groups=1, aux_loss="seq", shared_gate=True,
         shared_hidden_size=4, activation="silu"),
    dict(router="sigmoid", num_experts=16, top_k=4, num_groups=4, topk_groups=2, aux_loss="seq",
         normalize_gate="none", batch_prioritized_routing=True, expert_bias_update_rate=0.01),
]


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("capacity_factor", [0.0, 0.45, -1.0])
def test_features_match_einsum_reference_fp64(features, capacity_factor):
    layer = with_random_bias(make_layer(capacity_factor=capacity_factor, **features))
    x = torch.randn(3, 29, 12, dtype=torch.float64)   # 87 tokens in 3 sequences
    assert_matches_reference(layer, x, 1e-10)
    if capacity_factor == 0.45:
        assert layer.stats["dropped_fraction"] > 0.0


@pytest.mark.parametrize("features", FEATURES[:3])
def test_features_match_einsum_reference_fp32(features):
    layer = with_random_bias(make_layer(torch.float32, capacity_factor=0.7, **features))
    assert_matches_reference(layer, torch.randn(41, 12), 1e-5)


@pytest.mark.parametrize("features", FEATURES)
def test_empty_batch(features):
    layer = with_random_bias(make_layer(**features))
    x = torch.randn(0, 5, 12, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    (y.sum() + layer.aux_loss).backward()
    assert y.shape == x.shape and x.grad.shape == x.shape and float(layer.aux_loss) == 0.0
    assert reference_moe(layer, x)[0].shape == x.shape


def test_group_limit_changes_the_choice_and_stays_inside_the_best_groups():
    config = dict(model_dim=12, hidden_size=8, num_experts=16, top_k=4, router="sigmoid", capacity_factor=0.0)
    grouped = with_random_bias(MoELayer(MoEConfig(**config, num_groups=4, topk_groups=2)).double())
    plain = MoELayer(MoEConfig(**config)).double()
    plain.load_state_dict(grouped.state_dict())
    x_TD = torch.randn(200, 12, dtype=torch.float64)
    chosen_TK = grouped.router(x_TD).expert_TK
    assert not torch.equal(chosen_TK, plain.router(x_TD).expert_TK)
    choice_TE = (torch.sigmoid(x_TD @ grouped.router.weight_ED.t()) + grouped.router.expert_bias_E).detach()
    for t in range(200):   # written out: group score = sum of the two best, the 2 best groups, then top 4
        group_score = [sorted(choice_TE[t, 4 * g:4 * g + 4].tolist())[-2:] for g in range(4)]
        best = sorted(range(4), key=lambda g: -sum(group_score[g]))[:2]
        allowed = [e for g in best for e in range(4 * g, 4 * g + 4)]
        expected = sorted(allowed, key=lambda e: -float(choice_TE[t, e]))[:4]
        assert chosen_TK[t].tolist() == expected


def test_bias_chooses_experts_but_gates_use_unbiased_scores():
    layer = make_layer(router="sigmoid", num_experts=6, top_k=2, normalize_gate="none", capacity_factor=0.0)
    layer.router.fixed_bias = True
    layer.router.expert_bias_E.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0, 4.0]))
    x_TD = torch.randn(30, 12, dtype=torch.float64)
    routes = layer.router(x_TD)
    scores_TE = torch.sigmoid(x_TD @ layer.router.weight_ED.t())
    assert routes.expert_TK.tolist() == [[3, 5]] * 30
    assert torch.equal(routes.gate_TK, scores_TE[:, [3, 5]])


def test_route_scale_multiplies_the_final_gates_only():
    base = make_layer(router="sigmoid", num_experts=8, top_k=3, capacity_factor=0.5, shared_hidden_size=5)
    scaled = MoELayer(base.config.replace(route_scale=3.0)).double()
    scaled.load_state_dict(base.state_dict())
    x = torch.randn(40, 12, dtype=torch.float64)
    shared = base.shared_expert(x)
    assert torch.allclose(scaled(x) - shared, 3.0 * (base(x) - shared), rtol=1e-12, atol=1e-12)


def test_shared_expert_reaches_dropped_tokens():
    layer = make_layer(num_experts=2, top_k=1, capacity_factor=0.05, shared_hidden_size=6, shared_gate=True)
    x = torch.randn(50, 12, dtype=torch.float64)
    y = layer(x)
    shared = layer.shared_expert
    h = torch.relu(x @ shared.w1_DH + shared.b1_H)
    expected = (h @ shared.w2_HD + shared.b2_D) * torch.sigmoid(x @ shared.gate_D)[:, None]
    dropped = y.new_zeros(50, dtype=torch.bool)
    routes = layer.router(x)
    plan_rows = [[] for _ in range(2)]
    for t, e in enumerate(routes.expert_TK[:, 0].tolist()):
        plan_rows[e].append(t)
    for rows in plan_rows:
        dropped[rows[layer.stats["capacity"]:]] = True
    assert int(dropped.sum()) > 30
    assert torch.allclose(y[dropped], expected[dropped], rtol=1e-12, atol=1e-12)


def test_seq_aux_loss_written_out():
    E, K, N, S = 5, 2, 3, 7
    probs_TE = torch.softmax(torch.randn(N * S, E, dtype=torch.float64), -1)
    expert_TK = torch.rand(N * S, E).topk(K, dim=1).indices
    total = 0.0
    for n in range(N):
        rows = range(n * S, (n + 1) * S)
        for e in range(E):
            mean_score = sum(float(probs_TE[t, e]) for t in rows) / S
            fraction = sum(int(expert_TK[t, k]) == e for t in rows for k in range(K)) / (S * K)
            total += E * mean_score * fraction
    assert float(balance_loss("seq", probs_TE, expert_TK, E, seq_len=S)) == pytest.approx(total / N, rel=1e-12)
    switch = balance_loss("switch", probs_TE, expert_TK, E)
    assert float(balance_loss("seq", probs_TE, expert_TK, E, seq_len=N * S)) == pytest.approx(float(switch), rel=1e-12)
    assert float(balance_loss("seq", probs_TE, expert_TK, E)) == pytest.approx(float(switch), rel=1e-12)


def test_seq_aux_loss_of_a_2d_input_is_the_switch_loss():
    seq = make_layer(aux_loss="seq", router="sigmoid", aux_loss_coef=1.0, z_loss_coef=0.0)
    switch = MoELayer(seq.config.replace(aux_loss="switch")).double()
    switch.load_state_dict(seq.state_dict())
    x = torch.randn(23, 12, dtype=torch.float64)
    seq(x), switch(x)
    assert float(seq.aux_loss) == pytest.approx(float(switch.aux_loss), rel=1e-12)
    seq(x.view(1, 23, 12))
    assert float(seq.aux_loss) == pytest.approx(float(switch.aux_loss), rel=1e-12)


def test_bias_buffer_is_persistent_fp32_zeros_and_survives_casts():
    layer = MoELayer(MoEConfig(model_dim=8, hidden_size=8, num_experts=6, expert_bias_update_rate=0.1))
    bias = layer.state_dict()["router.expert_bias_E"]
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(6))
    layer.router.expert_bias_E.copy_(torch.randn(6) * 1e-3 + 0.1)
    before = layer.router.expert_bias_E.clone()
    layer.to(torch.bfloat16).double()
    assert layer.router.expert_bias_E.dtype == torch.float32 and torch.equal(layer.router.expert_bias_E, before)
    assert layer.router.weight_ED.dtype == torch.float64


def test_state_dict_without_the_bias_loads_with_a_zero_bias():
    layer = make_layer()
    layer.router.expert_bias_E.fill_(0.3)
    old = {k: v for k, v in layer.state_dict().items() if k != "router.expert_bias_E"}
    fresh = make_layer()
    fresh.load_state_dict(old)
    assert torch.equal(fresh.router.expert_bias_E, torch.zeros(4))


@pytest.mark.parametrize("module, config", [
    (Router, MoEConfig(model_dim=8, hidden_size=4, num_experts=6, router="cosine")),
    (SharedExpert, MoEConfig(model_dim=8, hidden_size=4, shared_hidden_size=5, shared_gate=True,
                             activation="swiglu")),
])
def test_new_modules_build_on_meta_and_reset(module, config):
    with torch.device("meta"):
        built = module(config)
    assert all(t.is_meta for t in list(built.parameters()) + list(built.buffers()))
    built.to_empty(device="cpu")
    built.reset_parameters()
    for name, tensor in list(built.named_parameters()) + list(built.named_buffers()):
        assert torch.isfinite(tensor).all(), name
        if name == "expert_bias_E":
            assert torch.equal(tensor, torch.zeros(6))
        else:
            assert 0 < tensor.abs().max() <= 0.5 or name == "log_scale", name   # uniform within 1/sqrt(fan_in >= 4)


def test_seq_aux_loss_of_ragged_sequences_written_out():
    E, K, T = 6, 3, 23
    probs_TE = torch.softmax(torch.randn(T, E, dtype=torch.float64), -1)
    expert_TK = torch.rand(T, E).topk(K, dim=1).indices
    sequence_T = torch.tensor([0] * 5 + [4] * 11 + [2] * 7)   # sequences 1 and 3 are empty (all padding)
    total = 0.0
    for n in (0, 4, 2):
        rows = [t for t in range(T) if int(sequence_T[t]) == n]
        for e in range(E):
            mean_score = sum(float(probs_TE[t, e]) for t in rows) / len(rows)
            fraction = sum(int(expert_TK[t, k]) == e for t in rows for k in range(K)) / (len(rows) * K)
            total += E * mean_score * fraction
    got = balance_loss("seq", probs_TE, expert_TK, E, sequence_T=sequence_T)
    assert float(got) == pytest.approx(total / 3, rel=1e-12)
    equal = torch.arange(T - 2) // 7
    assert float(balance_loss("seq", probs_TE[:21], expert_TK[:21], E, sequence_T=equal)) == pytest.approx(
        float(balance_loss("seq", probs_TE[:21], expert_TK[:21], E, seq_len=7)), rel=1e-12)


def test_routing_and_bias_update_add_no_host_synchronization():
    """No op whose result the host must read (.item(), data-dependent shapes) in the router's forward
    with groups, bias and the seq loss, the shared expert, or update_expert_bias."""
    from moe_plugin import update_expert_bias
    layer = with_random_bias(make_layer(router="sigmoid", num_experts=16, top_k=4, num_groups=4, topk_groups=2,
                                        aux_loss="seq", route_scale=2.0, expert_bias_update_rate=0.01,
                                        shared_hidden_size=6, shared_gate=True))
    x = torch.randn(3, 11, 12, dtype=torch.float64)
    with HostSyncs() as record:
        routes = layer.router(x.reshape(-1, 12), seq_len=11)
        (routes.gate_TK.sum() + routes.aux_loss + layer.shared_expert(x).sum()).backward()
        layer.router(x.reshape(-1, 12), sequence_T=torch.arange(33) % 5)
        update_expert_bias(layer)
    assert record.seen == []
    assert float(layer.router.expert_bias_E.abs().max()) > 0
