"""One forward+backward captured as a CUDA graph, its replays timed and checked against eager (issue 33 item 4).

Used by benchmarks/gpu/launches_graphs.py and benchmarks/bench_peers.py. forward(x_TD) returns the tensors to
backpropagate (the layer's output and its aux loss); their upstream gradients are fixed. The .grad tensors are
allocated inside the capture (the graph's memory pool) and each replay overwrites them in place.

Legend: T tokens, D model dim.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence

import torch


class GraphedStep:
    """step() replays the captured forward+backward and returns its wall seconds (synchronized)."""

    def __init__(self, forward: Callable[[torch.Tensor], Sequence[torch.Tensor]], params, x_TD: torch.Tensor,
                 grads: Sequence[torch.Tensor], warmup: int = 3):
        self.params = [p for p in params if p.requires_grad]
        self.x_TD = x_TD.detach().clone().requires_grad_()
        self.grads = list(grads)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):    # warm-up off the capture: lazy state, Triton compiles, cuBLAS workspaces
            for _ in range(warmup):
                self._zero()
                torch.autograd.backward(list(forward(self.x_TD)), self.grads)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self._zero()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outputs = list(forward(self.x_TD))
            torch.autograd.backward(outputs, self.grads)
        self.outputs = [out.detach() for out in outputs]
        self.grad_tensors = [t.grad for t in self.params + [self.x_TD]]   # in the graph's pool: replays write here

    def restore(self) -> None:
        """Points .grad back at the graph's gradient tensors (after an eager step replaced them)."""
        for t, grad in zip(self.params + [self.x_TD], self.grad_tensors):
            t.grad = grad

    def _zero(self) -> None:
        for p in self.params + [self.x_TD]:
            p.grad = None

    def step(self) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.graph.replay()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def gradients(self) -> List[torch.Tensor]:
        return self.grad_tensors


def eager_reference(forward, params, x_TD: torch.Tensor, grads) -> Dict[str, List[torch.Tensor]]:
    """Outputs and gradients (parameters', then x's) of one eager forward+backward on a copy of x_TD."""
    params = [p for p in params if p.requires_grad]
    x_TD = x_TD.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    outputs = list(forward(x_TD))
    torch.autograd.backward(outputs, list(grads))
    result = {"outputs": [o.detach().clone() for o in outputs],
              "gradients": [t.grad.detach().clone() for t in params + [x_TD]]}
    for p in params:
        p.grad = None
    return result


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (0 when both are zero); NaN anywhere gives inf."""
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    norm = b.norm()
    return float((a - b).norm() / norm) if norm > 0 else float((a - b).norm())


def check_replay(graphed: GraphedStep, forward, params, grads) -> Dict[str, float]:
    """Replays once, then compares the replay's outputs and gradients with an eager step on the same x:
    the largest relative error of each."""
    graphed.graph.replay()
    torch.cuda.synchronize()
    replay = {"outputs": [o.clone() for o in graphed.outputs], "gradients": [g.clone() for g in graphed.gradients()]}
    eager = eager_reference(forward, params, graphed.x_TD, grads)
    graphed.restore()
    return {key: max(relative_error(r, e) for r, e in zip(replay[key], eager[key])) for key in ("outputs", "gradients")}
