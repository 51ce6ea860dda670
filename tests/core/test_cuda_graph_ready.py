"""What CUDA graphs need of the layer, checked on CPU: the stats and the aux loss's value live in tensors every
forward writes into (a replay overwrites its outputs, so nothing may be read from a past call's), they read
correctly after repeated calls, eager and under torch.compile(mode="reduce-overhead"). The CUDA path's step
reads nothing back to the host: tests/ops/test_launch_budget.py counts its synchronizations (none).

Legend: T tokens, D model dim, E experts.
"""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer, fused_route


def expected(layer, x_TD):
    """(tokens per expert, kept per expert, aux loss) of x_TD on the reference path."""
    with torch.no_grad():
        _, aux, plan, _ = fused_route.reference(layer, x_TD, layer.capacity_factor(), x_TD.dtype)
    return plan.load_E.tolist(), plan.kept_E.tolist(), float(aux)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_stats_and_aux_value_persist_and_follow_each_call(capacity_factor):
    layer = MoELayer(MoEConfig(model_dim=16, hidden_size=8, num_experts=5, top_k=2, capacity_factor=capacity_factor,
                               z_loss_coef=0.01, activation="swiglu"))
    buffers = (layer._stats_2E.data_ptr(), layer.aux_loss_value.data_ptr())
    held = layer.aux_loss_value
    for T in (23, 40, 23):
        x_TD = torch.randn(T, 16)
        layer(x_TD).sum().backward()
        load, kept, aux = expected(layer, x_TD)
        stats = layer.stats
        assert stats["tokens_per_expert"] == load and sum(load) == 2 * T
        assert stats["dropped_fraction"] == pytest.approx(1 - sum(kept) / (2 * T))
        assert float(held) == pytest.approx(aux, rel=1e-5) == float(layer.aux_loss)   # the same tensor, updated
        assert (layer._stats_2E.data_ptr(), layer.aux_loss_value.data_ptr()) == buffers
    assert not held.requires_grad and layer.aux_loss.requires_grad


def test_persistent_stats_follow_the_layer_across_devices_and_copies():
    import copy
    with torch.device("meta"):
        layer = MoELayer(MoEConfig(model_dim=8, hidden_size=8, num_experts=3, top_k=1))
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    layer(torch.randn(7, 8))
    assert layer._stats_2E.device.type == "cpu" and sum(layer.stats["tokens_per_expert"]) == 7
    twin = copy.deepcopy(layer)
    twin(torch.randn(3, 8))
    assert sum(twin.stats["tokens_per_expert"]) == 3 and sum(layer.stats["tokens_per_expert"]) == 7


@pytest.mark.slow
def test_reduce_overhead_compile_reads_stats_and_aux_after_repeated_calls():
    torch._dynamo.reset()
    layer = MoELayer(MoEConfig(model_dim=16, hidden_size=8, num_experts=4, top_k=2, capacity_factor=1.0,
                               activation="swiglu"))
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    inputs = [torch.randn(31, 16) for _ in range(3)]
    seen = []
    for x_TD in inputs:
        y = compiled(x_TD)
        (y.sum() + layer.aux_loss).backward()
        seen.append((layer.stats, float(layer.aux_loss_value)))
    for x_TD, (stats, aux) in zip(inputs, seen):
        load, kept, aux_ref = expected(layer, x_TD)
        assert stats["tokens_per_expert"] == load and aux == pytest.approx(aux_ref, rel=1e-5)


def test_stats_persist_in_copies_and_in_layers_pickled_before_the_row_views():
    """The stats rows are views of the persistent buffer made once: after a deep copy and a pickle (which alone
    would copy views apart) they are views of the copy's own buffer; a layer pickled before they existed gets them."""
    import copy
    import pickle
    layer = MoELayer(MoEConfig(model_dim=16, hidden_size=24, num_experts=5, top_k=2, capacity_factor=0.0))
    old_state = layer.__getstate__()
    assert "_stats_rows" not in old_state     # as in a layer pickled before the rows existed
    old = MoELayer.__new__(MoELayer)
    old.__setstate__(old_state)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer)), old):
        x_TD = torch.randn(int(torch.randint(3, 30, ())), 16)
        clone(x_TD)
        load, kept, aux = expected(clone, x_TD)
        assert clone.stats["tokens_per_expert"] == load and clone._stats_2E[1].tolist() == kept
        assert clone.aux_loss_value.item() == pytest.approx(aux, rel=1e-5)
    assert layer.stats == {}      # the original ran no forward: the copies wrote only their own buffers
