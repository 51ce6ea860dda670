"""The expert FFN's activations: forward, and backward from what forward kept, written out op by op (no
autograd inside backward, so torch.compile traces it). SwiGLU, clamped or not, and gpt-oss's variant run
the one-pass native kernels where they load (ops.swiglu, ops.clamped_swiglu); the others are torch
compositions. activation_backward_ is the backward writing over its dead inputs where it can (no new memory).

Shape legend: moe_plugin/__init__.py (here R rows, H hidden width). A gated activation takes pre_RH2 [R, 2H] =
[gate | up] and gives [R, H]; the others map [R, H] to [R, H]. An Activation also holds its clamp limit and a
swiglu_oai's alpha.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from . import ops
from .config import GATED_ACTIVATIONS, MoEConfig


class Activation(NamedTuple):
    """An activation and its parameters (a tuple: hashable, a constant to torch.compile)."""
    name: str
    limit: Optional[float] = None
    alpha: Optional[float] = None

    @property
    def gated(self) -> bool:
        return self.name in GATED_ACTIVATIONS


def of_config(config: MoEConfig, shared: bool = False) -> Activation:
    """The routed experts' activation, or (shared) the shared expert's (unclamped when not clamp_shared)."""
    limit = config.activation_limit if not shared or config.clamp_shared else None
    return Activation(config.activation, limit, config.activation_alpha)


def as_activation(value: Union[str, Activation]) -> Activation:
    """A name alone (modules pickled before Activation existed, callers passing a string) has no parameters."""
    return value if isinstance(value, Activation) else Activation(value)


def first_width(activation: Union[str, Activation], hidden: int) -> int:
    """Columns of the first projection: 2H = [gate | up] for gated activations."""
    return 2 * hidden if as_activation(activation).gated else hidden


_GELU_APPROXIMATE = {"geglu": "none", "geglu_tanh": "tanh"}


def forward(pre: torch.Tensor, activation: Union[str, Activation]) -> torch.Tensor:
    """The activation as a torch composition, differentiable by autograd (the shared expert's path)."""
    act = as_activation(activation)
    name = act.name
    if name == "identity":
        return pre
    if name in ("relu", "gelu", "silu"):
        return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[name](pre)
    if name == "relu2":
        return F.relu(pre).square()
    gate, up = pre.chunk(2, dim=-1)
    if name in _GELU_APPROXIMATE:
        return F.gelu(gate, approximate=_GELU_APPROXIMATE[name]) * up
    if act.limit is not None:
        gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
    if name == "swiglu":
        return F.silu(gate) * up
    return (up + 1) * gate * torch.sigmoid(act.alpha * gate)     # swiglu_oai


def activate(pre: torch.Tensor, activation: Union[str, Activation]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(activations, what backward needs): relu works in place and keeps its output as its own mask;
    identity keeps the pre-activation, which is the activation; the others keep the pre-activation and
    recompute in backward."""
    act = as_activation(activation)
    if act.name == "relu":
        out = pre.relu_()
        return out, out
    if act.name == "swiglu" and act.limit is None:
        return ops.swiglu(pre), pre
    if act.name in ("swiglu", "swiglu_oai"):
        return ops.clamped_swiglu(pre, *_clamp(act)), pre
    return forward(pre, act), pre


def kept(pre: torch.Tensor, activation: Union[str, Activation]) -> torch.Tensor:
    """What activate() keeps for backward, without the activations themselves (a recomputed first projection)."""
    return pre.relu_() if as_activation(activation).name == "relu" else pre


def _clamp(act: Activation) -> Tuple[float, float, float]:
    """(limit, alpha, beta) of the clamped kernels: SwiGLU clamped is alpha 1, beta 0; gpt-oss adds 1 to up."""
    return (act.limit, 1.0, 0.0) if act.name == "swiglu" else (act.limit, act.alpha, 1.0)


def activation_backward(saved: torch.Tensor, grad_act: torch.Tensor, activation: Union[str, Activation]
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """From what activate() kept and the activations' gradient: (the activations, grad of the pre-activation).
    A clamp passes the gradient where its input lies inside [min, max], bounds included (as torch.clamp)."""
    act = as_activation(activation)
    name = act.name
    if name == "identity":
        return saved, grad_act
    if name == "relu":
        return saved, torch.ops.aten.threshold_backward.grad_input(grad_act, saved, 0, grad_input=grad_act)
    if name == "gelu":
        return F.gelu(saved), torch.ops.aten.gelu_backward(grad_act, saved)
    if name == "silu":
        return F.silu(saved), torch.ops.aten.silu_backward(grad_act, saved)
    if name == "relu2":
        relu = F.relu(saved)
        return relu.square(), grad_act * relu * 2
    if name == "swiglu" and act.limit is None:
        grad_pre, out = ops.swiglu_backward(grad_act, saved)
        return out, grad_pre
    if name in ("swiglu", "swiglu_oai"):
        grad_pre, out = ops.clamped_swiglu_backward(grad_act, saved, *_clamp(act))
        return out, grad_pre
    gate, up = saved.chunk(2, dim=-1)
    gelu = F.gelu(gate, approximate=_GELU_APPROXIMATE[name])
    grad_gate = torch.ops.aten.gelu_backward(grad_act * up, gate, approximate=_GELU_APPROXIMATE[name])
    return gelu * up, torch.cat([grad_gate, grad_act * gelu], dim=-1)


def activation_backward_(saved: torch.Tensor, grad_act: torch.Tensor, activation: Union[str, Activation],
                         keep_grad_act: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """activation_backward, writing over its inputs where it can: SwiGLU (clamped or not) on the native CPU kernels,
    in eager mode, inside a backward pass that frees its graph (no retain_graph or create_graph: nothing reads the
    saved pre-activation again), writes the pre-activation's gradient over saved and the activations over grad_act
    (into new memory when keep_grad_act). That saves an [R, 2H] and an [R, H] buffer at the expert FFN's peak.
    Elsewhere, or for another activation, activation_backward (relu already writes into grad_act)."""
    act = as_activation(activation)
    kernel = _in_place_kernel(saved, grad_act, act)
    if kernel is None:
        return activation_backward(saved, grad_act, act)
    act_RH = ops.new_empty(grad_act, *grad_act.shape) if keep_grad_act else grad_act
    if act.limit is None and act.name == "swiglu":
        kernel.swiglu_backward_(grad_act, saved, act_RH)
    else:
        kernel.clamped_swiglu_backward_(grad_act, saved, act_RH, *_clamp(act))
    return act_RH, saved


def _in_place_kernel(saved: torch.Tensor, grad_act: torch.Tensor, act: Activation):
    """The native kernel module when activation_backward_ may write in place, else None."""
    if torch.compiler.is_compiling() or act.name not in ("swiglu", "swiglu_oai") or saved.device.type != "cpu":
        return None    # a compiled graph: the compiler plans its buffers itself
    if type(saved) is not torch.Tensor or type(grad_act) is not torch.Tensor or saved.dtype != grad_act.dtype \
            or not (saved.is_contiguous() and grad_act.is_contiguous()) or not _graph_freed() \
            or torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    module, name, _ = ops.kernels_for(saved.device)
    return module if name == "native" and hasattr(module, "swiglu_backward_") else None


def _graph_freed() -> bool:
    """Whether the backward pass running now frees the graph's saved tensors after each node (False outside a
    backward pass, with retain_graph or create_graph, and where torch cannot say)."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and not keep_graph()
