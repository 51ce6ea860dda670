"""The fast layer against the einsum reference (moe_plugin/reference.py): outputs, aux loss and gradients."""
import torch

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.reference import reference_moe

from .compare import relative_error


def make_layer(dtype=torch.float64, **overrides) -> MoELayer:
    values = dict(model_dim=12, hidden_size=20, num_experts=4, top_k=2, capacity_factor=1.0, min_capacity=0,
                  z_loss_coef=0.01)
    values.update(overrides)
    return MoELayer(MoEConfig(**values)).to(dtype)


def outputs_and_grads(forward, layer, x):
    """Output, and gradients of (output . fixed random weights + aux loss) w.r.t. x and every parameter."""
    x = x.detach().requires_grad_()
    y, aux = forward(x)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad((y * upstream).sum() + aux, [x] + params, allow_unused=True)
    return y.detach(), aux.detach(), dict(zip(["x"] + [n for n, _ in layer.named_parameters()], grads))


def fast(layer):
    def forward(x):
        y = layer(x)
        return y, layer.aux_loss
    return forward


def reference(layer):
    return lambda x: reference_moe(layer, x)


def assert_matches_reference(layer, x, tolerance):
    y, aux, grads = outputs_and_grads(fast(layer), layer, x)
    y_ref, aux_ref, grads_ref = outputs_and_grads(reference(layer), layer, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    errors = {"y": relative_error(y, y_ref), "aux": relative_error(aux, aux_ref)}
    # a one-element parameter's gradient (the cosine router's log_scale) sums terms over every token and expert that
    # can cancel: its rounding error is measured against the layer's largest gradient, not against that sum alone
    largest = max([float(g.detach().abs().max()) for g in grads_ref.values() if g is not None and g.numel()] + [0.0])
    errors.update({f"grad {name}": relative_error(grads[name], grads_ref[name],
                                                  floor=largest if g is not None and g.numel() == 1 else 1e-30)
                   for name, g in grads_ref.items()})
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{worst} off by {errors[worst]:.3g} (all: {errors})"
    return errors
