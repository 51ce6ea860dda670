"""Which kernel set runs on a device (MOE_PLUGIN_KERNELS, what loads), and whether a call may skip its
custom op's dispatch (direct)."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch

from . import native, torch_ops

ENV = "MOE_PLUGIN_KERNELS"
MODES = ("auto", "native", "torch")


def mode() -> str:
    return _mode(os.environ.get(ENV, "auto"))


@functools.lru_cache(maxsize=16)
def _mode(raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r} is not a kernel choice; allowed: {', '.join(MODES)}")
    return value


@functools.lru_cache(maxsize=None)
def triton_modules() -> Tuple[ModuleType, ModuleType, ModuleType]:
    """(triton_kernels, triton_route, triton_grouped), imported on first use only (a failed import is not cached)."""
    from . import triton_grouped, triton_kernels, triton_route   # import triton: slow; it reads TRITON_INTERPRET once
    return triton_kernels, triton_route, triton_grouped


@functools.lru_cache(maxsize=None)
def _triton() -> Tuple[Optional[ModuleType], str]:
    try:
        triton_kernels = triton_modules()[0]
    except ImportError as error:
        return None, str(error)
    usable, why = triton_kernels.available()
    return (triton_kernels, f"Triton {triton_kernels.triton.__version__}") if usable else (None, why)


def kernels_for(device: torch.device) -> Tuple[ModuleType, str, str]:
    """(kernel module, its name, why it was chosen) for tensors on device: worked out once per device type and
    MOE_PLUGIN_KERNELS value (the layer asks ~16 times per step), and inside resolved() once per call."""
    call = getattr(_CALL, "choice", None)
    if call is not None and call[0] == device.type:
        return call[1]
    if _SIMULATED[0] and device.type == "cpu":
        return _simulated_kernels()
    return _choose(device.type, mode())


_SIMULATED = [False]
_CALL = threading.local()


@contextlib.contextmanager
def resolved(device: torch.device, direct_calls: bool):
    """Inside (one call of the fused layer, forward or backward): kernels_for(device) answers from one look-up,
    and direct() answers direct_calls (the caller's inputs tested once) for tensors of no autograd."""
    before = getattr(_CALL, "choice", None), getattr(_CALL, "direct", None)
    _CALL.choice, _CALL.direct = (device.type, kernels_for(device)), direct_calls
    try:
        yield
    finally:
        _CALL.choice, _CALL.direct = before


@contextlib.contextmanager
def simulated_cuda():
    """CPU tensors take the CUDA code path (the Triton kernels, run by the Triton interpreter) inside this
    context: how ops/launches.py counts on CPU what a GPU would launch. Needs TRITON_INTERPRET=1 in the
    environment before triton is first imported."""
    _simulated_kernels()      # fails here, not half-way through a step
    before, _SIMULATED[0] = _SIMULATED[0], True
    try:
        yield
    finally:
        _SIMULATED[0] = before


@functools.lru_cache(maxsize=None)
def _simulated_kernels() -> Tuple[ModuleType, str, str]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("simulated_cuda() runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 "
                           "set before triton is imported")
    module, why = _triton()
    if module is None and "CUDA" not in why:
        raise RuntimeError(f"simulated_cuda() needs triton: {why}")
    return triton_modules()[0], "triton", "the CUDA path simulated on CPU under the Triton interpreter"


def device_kind(device: torch.device) -> str:
    """device.type, except "cuda" for CPU tensors inside simulated_cuda(): the branch a kernel choice takes."""
    return "cuda" if _SIMULATED[0] and device.type == "cpu" else device.type


@functools.lru_cache(maxsize=None)
def _choose(device_type: str, chosen: str) -> Tuple[ModuleType, str, str]:
    if chosen == "torch":
        return torch_ops, "torch", f"{ENV}=torch"
    module, why = _triton() if device_type == "cuda" else native.load() if device_type == "cpu" else \
        (None, f"no native kernels for device type {device_type}")
    name = "triton" if device_type == "cuda" else "native"
    if module is not None:
        return module, name, why
    if chosen == "native":
        raise RuntimeError(f"{ENV}=native but the {name} kernels for {device_type} are unavailable: {why}")
    # said once per device type and choice: the result is cached
    warnings.warn(f"moe_plugin: using the torch kernels on {device_type}: {why}", RuntimeWarning,
                  stacklevel=3)   # at kernels_for's caller
    return torch_ops, "torch", why


def eager_triton(device: torch.device) -> Optional[ModuleType]:
    """The Triton kernel module for CUDA tensors in eager mode where it is the chosen kernel set, else None (a
    compiled graph keeps the torch forms, which the compiler fuses itself)."""
    if device_kind(device) != "cuda" or torch.compiler.is_compiling():
        return None
    module, name, _ = kernels_for(device)
    return module if name == "triton" else None


def describe() -> Dict[str, str]:
    """Which kernels run on each device type and why (for `moe-plugin info`)."""
    report = {}
    for device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            report[device] = "no CUDA device"
            continue
        try:
            _, name, why = kernels_for(torch.device(device))
            report[device] = f"{name} ({why})"
        except (RuntimeError, ValueError) as error:
            report[device] = f"error: {error}"
    return report


def direct(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call may run the kernels itself rather than through its custom op, whose dispatch costs tens
    of microseconds of host time per call (measured: 29 us against 1.3 us for the kernel, 63 us with autograd):
    in eager mode, with no autograd to record for these inputs, no meta tensor (the op's fake function gives
    its shapes) and no tensor subclass, dispatch mode or functorch transform (fake tensors, tracing, vmap)
    that must see the op."""
    grad = torch.is_grad_enabled()
    call = getattr(_CALL, "direct", None)
    if call is not None and not grad:
        return call
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or _functorch_active():
        return False
    for t in tensors:      # a loop, not all(generator): this runs ~20 times per step
        if t is not None and (type(t) not in _PLAIN or t.is_meta or (grad and t.requires_grad)):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _functorch_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None
