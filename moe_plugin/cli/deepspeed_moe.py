"""DeepSpeed's own MoE layer, wrapped as a baseline to compare moe_plugin against.

Legend: T tokens, D model dim (``model_dim``), H expert hidden dim (``hidden_size``),
E experts, K top-k.

``build_deepspeed_moe`` returns an ``nn.Module`` whose ``forward(x_*D) -> y_*D`` runs
``deepspeed.moe.layer.MoE`` in one process (ep_size=1) with E copies of the expert
``Linear(D, H) -> act -> Linear(H, D)``. The auxiliary (load-balancing) loss of the last
forward is kept on ``.aux_loss``; DeepSpeed's expert counts are dropped.

DeepSpeed is imported lazily, so this module imports with torch alone. DeepSpeed's MoE needs
torch.distributed and its expert-parallel groups even in one process: when torch.distributed
is not initialized we start a world-size-1 gloo group on 127.0.0.1 and a free port.

Measured facts about DeepSpeed 0.19.8's MoE (the behaviour this baseline inherits):
- k = 1 and k = 2 have dedicated gating functions; any other k uses its general ``topkgating``
  (which drops over-capacity routes by lowest gate probability, not by position).
- The gate always computes in fp32 (input and gate weight are cast with ``.float()``); the
  experts run in the module's dtype, and the combine sums the routes in fp32 before casting
  the output back to the input dtype. A bf16 module on a bf16 input returns bf16.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
from typing import Optional

import torch
from torch import nn

__all__ = ["build_deepspeed_moe", "deepspeed_version", "DeepSpeedMoEBaseline"]

class SwiGLU(nn.Module):
    """silu(gate) * up of a [..., 2H] = [gate | up] input (a gated expert: its first Linear is 2H wide)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "identity": nn.Identity, "swiglu": SwiGLU}
_INSTALL_HINT = "pip install 'moe_plugin[deepspeed]'"


def deepspeed_version() -> Optional[str]:
    """Installed DeepSpeed version, or None when DeepSpeed is not installed (no import)."""
    from importlib import metadata

    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def _import_deepspeed():
    try:
        import deepspeed  # noqa: F401
        import deepspeed.comm
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import logger as ds_logger
    except ImportError as err:
        raise ImportError(
            f"the DeepSpeed MoE baseline needs DeepSpeed, which is not importable ({err}); "
            f"install it with: {_INSTALL_HINT}") from err
    # DeepSpeed logs every layer creation and group setup at INFO.
    ds_logger.setLevel(logging.WARNING)
    return deepspeed, MoE


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_distributed(deepspeed) -> None:
    """Make torch.distributed and deepspeed.comm usable in this (possibly lone) process."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("the DeepSpeed MoE baseline needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group(backend="gloo", rank=0, world_size=1)
    if not deepspeed.comm.is_initialized():
        # torch.distributed is up, so this only wraps the existing group in DeepSpeed's backend
        # (on CPU it also loads its shared-memory comm op and print()s that it did).
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                            verbose=False)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class DeepSpeedMoEBaseline(nn.Module):
    """``deepspeed.moe.layer.MoE`` with a plain ``forward(x) -> y``; see build_deepspeed_moe."""

    def __init__(self, moe: nn.Module, model_dim: int) -> None:
        super().__init__()
        self.moe = moe
        self.model_dim = model_dim
        self.aux_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.model_dim:
            raise ValueError(f"input must have shape [..., {self.model_dim}], got {tuple(x.shape)}")
        y, l_aux, _exp_counts = self.moe(x)
        self.aux_loss = l_aux
        return y

    def extra_repr(self) -> str:
        return f"model_dim={self.model_dim}, deepspeed={deepspeed_version()}"


def build_deepspeed_moe(model_dim: int,
                        hidden_size: int,
                        num_experts: int,
                        top_k: int,
                        capacity_factor: float,
                        activation: str = "relu",
                        bias: bool = True,
                        min_capacity: int = 4,
                        *,
                        top2_2nd_expert_sampling: bool = False) -> nn.Module:
    """Build DeepSpeed's MoE layer (one process, ep_size=1) as a baseline module.

    Settings: drop_tokens=True, use_rts=False, noisy_gate_policy=None, use_residual=False,
    capacity_factor == eval_capacity_factor == ``capacity_factor``. Capacity per expert is
    max(ceil(T / E * capacity_factor * K), min_capacity).

    ``top2_2nd_expert_sampling`` (DeepSpeed's default is True) adds Gumbel noise when picking
    the second expert for k=2; it is off here so that routing is the plain, deterministic
    top-k that moe_plugin computes. The E experts are initialized independently (DeepSpeed
    deep-copies one expert, which would start all E with identical weights).

    The returned module's ``forward(x)`` takes [..., model_dim] and returns the same shape;
    ``.aux_loss`` holds the load-balancing loss of the last forward.
    """
    _check_positive_int("model_dim", model_dim)
    _check_positive_int("hidden_size", hidden_size)
    _check_positive_int("num_experts", num_experts)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in 1..num_experts ({num_experts}) for DeepSpeed's gating "
                         f"(k=1 and k=2 have dedicated gates, larger k uses its general top-k gate), got {top_k!r}")
    if not isinstance(capacity_factor, (int, float)) or isinstance(capacity_factor, bool) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be a number > 0, got {capacity_factor!r}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
        raise ValueError(f"min_capacity must be an int >= 0, got {min_capacity!r}")

    deepspeed, MoE = _import_deepspeed()
    _ensure_distributed(deepspeed)

    expert = nn.Sequential(
        nn.Linear(model_dim, 2 * hidden_size if activation == "swiglu" else hidden_size, bias=bias),
        _ACTIVATIONS[activation](),
        nn.Linear(hidden_size, model_dim, bias=bias),
    )
    moe = MoE(hidden_size=model_dim,
              expert=expert,
              num_experts=num_experts,
              ep_size=1,
              k=top_k,
              capacity_factor=float(capacity_factor),
              eval_capacity_factor=float(capacity_factor),
              min_capacity=min_capacity,
              use_residual=False,
              noisy_gate_policy=None,
              drop_tokens=True,
              use_rts=False,
              top2_2nd_expert_sampling=top2_2nd_expert_sampling)
    # Creates (or reuses) the "ep_size_1" expert-parallel group; DeepSpeed print()s when it creates one.
    with contextlib.redirect_stdout(io.StringIO()):
        moe.set_deepspeed_parallelism()

    for module in moe.deepspeed_moe.experts.deepspeed_experts.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    return DeepSpeedMoEBaseline(moe, model_dim)
