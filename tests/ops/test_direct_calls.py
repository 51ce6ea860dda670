"""In eager mode the layer calls its kernels directly, skipping the custom ops' dispatch; wherever something
must see the ops (autograd on their inputs, a dispatch mode, meta tensors, torch.compile) they run as ops.
Both ways give the einsum reference's numbers."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_plugin import ops
from moe_plugin.ops import grouped
from helpers.reference import assert_matches_reference, make_layer

OPS = {ops: ("_route_slots_op", "_scatter_rows_op", "_gather_sum_op", "_swiglu_op", "_swiglu_backward_op",
             "_clamped_swiglu_op", "_clamped_swiglu_backward_op"),
       grouped: ("_grouped_mm_op",)}
LAYERS = [dict(activation="swiglu", bias=False, top_k=3, num_experts=5),
          dict(activation="gelu", capacity_factor=0.5),          # dropped choices: rows past the kept ones
          dict(activation="swiglu", activation_limit=0.5, capacity_factor=0.0)]


def refuse_ops(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a custom op was called in an eager step")
    for module, names in OPS.items():
        for name in names:
            monkeypatch.setattr(module, name, refused)


@pytest.mark.parametrize("options", LAYERS, ids=["swiglu_k3", "gelu_dropping", "clamped_swiglu_dropless"])
def test_eager_training_step_calls_no_custom_op(monkeypatch, options):
    layer = make_layer(**options)
    refuse_ops(monkeypatch)
    assert_matches_reference(layer, torch.randn(3, 17, 12, dtype=torch.float64), 1e-12)


class SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_ops():
    layer = make_layer(activation="swiglu", bias=False)
    x = torch.randn(2, 9, 12, dtype=torch.float64, requires_grad=True)
    with SeenOps() as seen:
        (layer(x).sum() + layer.aux_loss).backward()
    assert {"moe_plugin.route_slots", "moe_plugin.scatter_rows", "moe_plugin.gather_sum",
            "moe_plugin.grouped_mm"} <= seen.names, seen.names


def test_inputs_that_need_autograd_go_through_the_op():
    """dispatch.encode's rows need the op's registered backward: their gradient must match a plain gather."""
    x_TD = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    pos_TK = torch.tensor([[0, 3], [1, -1], [2, 4], [5, -1], [-1, 6], [7, -1]])
    assert not ops.direct(x_TD) and ops.direct(x_TD.detach())
    rows_RD = ops.scatter_rows(x_TD, pos_TK, None, None, 9)[0]
    weight_RD = torch.randn(9, 4, dtype=torch.float64)
    (rows_RD * weight_RD).sum().backward()
    expected_TD = torch.zeros(6, 4, dtype=torch.float64)
    for t, k in zip(*torch.nonzero(pos_TK >= 0, as_tuple=True)):
        expected_TD[t] += weight_RD[pos_TK[t, k]]
    torch.testing.assert_close(x_TD.grad, expected_TD, rtol=0, atol=1e-15)


def test_meta_tensors_and_compiling_take_the_op():
    assert not ops.direct(torch.empty(2, device="meta"))
    assert ops.direct(torch.empty(2), None, torch.nn.Parameter(torch.empty(2), requires_grad=False))
    assert torch.compile(lambda x: torch.tensor(ops.direct(x)), fullgraph=True)(torch.empty(2)).item() is False
