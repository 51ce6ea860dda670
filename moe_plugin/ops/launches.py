"""Counts the kernels a CUDA device would launch for some code, on any machine: the code runs on CPU tensors
on the CUDA code path (choice.simulated_cuda: the Triton kernels run under the Triton interpreter), a
TorchDispatchMode counts the aten ops that launch a kernel, and a wrapper counts each Triton kernel launch.

The model of an aten op (what torch's CUDA backend does): views, allocations and metadata launch nothing;
a grouped GEMM launches two (torch's CUDA _grouped_mm prepares its per-group arguments in a kernel of its own,
then runs the GEMM: the H200's profile, 2026-11-28); every other op launches one kernel. Ops known to read a device
value back to the host (a host synchronization, which a CUDA graph cannot capture) are counted apart, in .syncs.
The count is checked against torch.profiler's kernel count on a GPU by benchmarks/gpu (where a GPU was at hand).

    with count_launches() as counter:          # TRITON_INTERPRET=1 must be set before triton is imported
        layer(x).sum().backward()
    counter.total, counter.by_name
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Counter, Iterator

from torch._library import custom_ops
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .choice import simulated_cuda, triton_modules

# aten ops that launch no kernel: views, allocations, metadata
NO_LAUNCH = frozenset("""
    view _unsafe_view reshape _reshape_alias t transpose permute expand expand_as slice select unsqueeze squeeze
    as_strided alias detach split split_with_sizes chunk unbind narrow diagonal view_as lift_fresh
    empty empty_like empty_strided new_empty new_empty_strided set_ resize_ sym_size sym_stride
    sym_numel sym_storage_offset is_same_size _has_compatible_shallow_copy_type result_type promote_types
""".split())
# aten ops that launch two kernels on CUDA: op -> the name the second is counted under
TWO_LAUNCHES = {"_grouped_mm": "cuda.grouped_mm_arguments"}
# aten ops that read device memory back to the host (a synchronization a CUDA graph cannot capture)
SYNCS = frozenset("_local_scalar_dense nonzero masked_select unique _unique2 bincount repeat_interleave".split())


class LaunchCounter(TorchDispatchMode):
    """Counts aten kernel launches (by_name: "aten.<op>"), Triton launches ("triton.<kernel>") and host syncs."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = collections.Counter()
        self.syncs: Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace not in ("aten", "prims"):    # a custom op (ours): count what its implementation launches
            with self:
                return _implementation(func)(*args, **kwargs)
        if name in SYNCS:
            self.syncs[f"{namespace}.{name}"] += 1
        if name not in NO_LAUNCH:
            self.by_name[f"{namespace}.{name}"] += 1
        if name in TWO_LAUNCHES:
            self.by_name[TWO_LAUNCHES[name]] += 1
        return func(*args, **kwargs)

    def count_triton(self, kernel_name: str) -> None:
        self.by_name[f"triton.{kernel_name}"] += 1


def _implementation(func):
    """The Python function behind a torch.library.custom_op."""
    opdef = custom_ops.OPDEFS.get(func._schema.name)
    if opdef is None:
        raise NotImplementedError(f"count_launches cannot look inside the op {func._schema.name}")
    return opdef._init_fn


class _CountedKernel:
    """A Triton kernel whose launches (kernel[grid](...)) are counted, run with the counting mode off (the
    interpreter's own tensor copies are no launches)."""

    def __init__(self, kernel, name: str, counter: LaunchCounter):
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.counter.count_triton(self.name)
            with _disable_current_modes():
                return launch(*args, **kwargs)
        return run

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)


@contextlib.contextmanager
def count_launches() -> Iterator[LaunchCounter]:
    """Counts, inside the context, what the CUDA code path would launch (see the module's docstring)."""
    counter = LaunchCounter()
    with simulated_cuda(), kernels_replaced(lambda kernel, name: _CountedKernel(kernel, name, counter)):
        with counter:
            yield counter


@contextlib.contextmanager
def kernels_replaced(wrap: Callable[[object, str], object]) -> Iterator[None]:
    """Inside: each Triton kernel of ops/triton_kernels.py, triton_route.py and triton_grouped.py replaced by
    wrap(kernel, its name) (the counter above; benchmarks/count_launches.py --host makes them no-ops)."""
    kernels = [(module, name, value) for module in triton_modules() for name, value in vars(module).items()
               if name.startswith("_") and name.endswith("_kernel")]
    try:
        for module, name, kernel in kernels:
            setattr(module, name, wrap(kernel, name.strip("_")))
        yield
    finally:
        for module, name, kernel in kernels:
            setattr(module, name, kernel)
