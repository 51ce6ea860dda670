"""The global balance loss's counts over an optimizer step's micro-batches (moe_plugin.begin_step) on a CUDA device,
against the one-process reference in fp64 on CPU (tests/helpers/balance_steps.py): fp32 and bf16 layers, with and
without activation checkpointing (whose recompute runs in the autograd engine's device thread there, not in the
caller's), also in a pipeline's 1F1B order, an empty micro-batch among them. benchmarks/gpu/run.sh --tests runs this file; on CPU it skips."""
import pytest
import torch

from helpers.balance_steps import build, micro_batches, one_f_one_b_run, spanning_reference, spanning_run
from helpers.compare import relative_error
from moe_plugin.one_process import fused_route

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (the global balance loss's step counts on cuda)")


@pytest.mark.parametrize("order", ["eager", "checkpointed", "1f1b checkpointed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_spanning_counts_on_cuda_match_the_fp64_reference(dtype, order):
    sizes = (37, 0, 130, 9)
    spec = dict(E=8, k=3, aux="switch")
    layer = build(spec, dtype, aux_loss_scope="global").cuda()
    with torch.no_grad():
        layer.router.weight_ED.mul_(3.0)
    reference = build(spec, torch.float64)
    reference.load_state_dict(layer.state_dict())          # the reference holds the layer's rounded weights
    xs, ups = micro_batches(sizes, dtype=dtype)
    probe_TD = xs[0].cuda()
    assert fused_route.routed_as_configured(layer, probe_TD)       # before begin_step: the fused routing's case

    xs_cuda, ups_cuda = [x.cuda() for x in xs], [up.cuda() for up in ups]
    if order == "1f1b checkpointed":
        grad_ED, x_grads, losses = one_f_one_b_run(layer, xs_cuda, ups_cuda)
    else:
        grad_ED, x_grads, losses = spanning_run(layer, xs_cuda, ups_cuda, checkpointed=order == "checkpointed")
    assert not fused_route.routed_as_configured(layer, probe_TD)   # spanning counts take the reference routing
    assert layer.router.step_counts_E1[-1].item() == sum(sizes)     # a recompute counted its micro-batch once
    grad_ref_ED, x_grads_ref, losses_ref = spanning_reference(reference, [x.double() for x in xs],
                                                              [up.double() for up in ups])
    # the router runs in fp32 either way (fp32_router): the balance losses are fp32-exact; in bf16 the router's
    # gradient carries the experts' rounding (3e-3 to 7e-3 measured on CPU), and the inputs' gradients more
    assert relative_error(losses.cpu(), losses_ref) <= 1e-5
    assert relative_error(grad_ED.cpu(), grad_ref_ED) <= (1e-4 if dtype == torch.float32 else 3e-2)
    if dtype == torch.float32:
        assert all(relative_error(g.cpu(), g_ref) <= 1e-4 for g, g_ref in zip(x_grads, x_grads_ref))
