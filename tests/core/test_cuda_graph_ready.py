"""What CUDA graphs need of the layer, checked on CPU: the stats and the aux loss's value live in tensors every
forward writes into (a replay overwrites its outputs, so nothing may be read from a past call's), they read
correctly after repeated calls, eager and under torch.compile(mode="reduce-overhead"). A forward does not keep the
last forward's graph alive (its parameters' AccumulateGrad nodes stay on the stream that made them: a capture on
another stream after an eager step then fails), checked on CPU and, with a GPU, by a capture after eager steps. The
CUDA path's step reads nothing back to the host: tests/ops/test_launch_budget.py counts its synchronizations (none).

Legend: T tokens, D model dim, E experts.
"""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.one_process import fused_route
from helpers.compare import relative_error

CUDA = torch.cuda.is_available()


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


def accumulate_grad_node(param):
    """param's AccumulateGrad node: the one a live graph holds, else a new one."""
    return param.view_as(param).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_a_forward_builds_its_graph_without_the_last_forwards(capacity_factor):
    """The last forward's aux loss (held by the layer, its backward never run here) must not keep the parameters'
    AccumulateGrad nodes alive into the next forward: a hook on the old node must not fire in the next backward."""
    layer = MoELayer(MoEConfig(model_dim=16, hidden_size=8, num_experts=4, top_k=2, capacity_factor=capacity_factor))
    layer(torch.randn(9, 16))            # output dropped: only layer.aux_loss holds this graph
    fired = []
    for param in (layer.router.weight_ED, layer.experts.w1_EDH):
        accumulate_grad_node(param).register_prehook(lambda grads, name=param.shape: fired.append(name))
    y = layer(torch.randn(11, 16))
    (y.sum() + layer.aux_loss).backward()
    assert fired == [], "the next forward reused the last forward's AccumulateGrad nodes"
    assert layer.router.weight_ED.grad is not None and layer.experts.w1_EDH.grad is not None


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (CUDA graph capture)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_capture_after_eager_steps_replays_as_eager(dtype):
    """A user's eager steps on the default stream (backward of the output only, aux loss left held), then the
    whole forward+backward captured as PyTorch's docs do it (warm-up on a side stream): the capture succeeds and a
    replay gives eager's outputs and gradients."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=64, hidden_size=96, num_experts=8, top_k=2, capacity_factor=1.25,
                               activation="relu", bias=True)).to(device="cuda", dtype=dtype)
    params = list(layer.parameters())
    x_TD = torch.randn(300, 64, device="cuda", dtype=dtype)
    grad_TD = torch.randn_like(x_TD)
    for _ in range(2):
        layer(x_TD).backward(grad_TD)

    def step(x):
        for p in params:
            p.grad = None
        torch.autograd.backward([layer(x), layer.aux_loss], [grad_TD, torch.ones((), device="cuda", dtype=dtype)])

    static_x = x_TD.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static_x)
    static_grads = [p.grad for p in params]
    new_x = torch.randn_like(x_TD)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [g.clone() for g in static_grads]
    step(new_x)
    for param, got in zip(params, replayed):
        assert relative_error(got, param.grad) <= 1e-6, tuple(param.shape)
