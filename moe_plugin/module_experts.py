"""The general path: experts that are any nn.Module, each local expert its own copy of the module.

The fast path (experts.py) runs experts Linear(D, H) -> activation -> Linear(H, D) as stacked weights on
grouped GEMMs. Any other module (a single Linear, an expert with a LayerNorm, a custom module) runs here:
the rows grouped by expert are cut at their counts (read to the host once per call) and each block goes
through its own expert's module. It meets the experts contract (experts.BaseExperts) as experts.Experts does
(forward(x_RD, rows_per_expert) -> y_RD, rows past the last expert's block give 0) with no stacked weights:
weights() is None. Under autocast the modules run under autocast of the
rows' dtype, and their outputs come back in it.

The state dict holds expert i (local index) as `local.<i>.<the module's own names>`.

Shape legend: moe_plugin/__init__.py (here R routed rows grouped by expert, D model dim, E experts).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Mapping, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import MoEConfig
from .experts import BaseExperts

PROBE_ROWS = 3


class ModuleExperts(BaseExperts):
    """This rank's experts [first_expert, first_expert + local_experts), each a copy of `module` (as
    DeepSpeed's Experts: copies, so every expert starts from the module's weights)."""

    def __init__(self, config: MoEConfig, module: nn.Module, first_expert: int = 0,
                 local_experts: Optional[int] = None, slices: int = 1):
        super().__init__()
        name = type(module).__name__
        if slices != 1:
            raise ValueError(f"expert module {name} runs on the general path, which cannot slice an expert's "
                             f"hidden dim over processes (ep_size={config.ep_size} > "
                             f"num_experts={config.num_experts}); use ep_size <= num_experts")
        if config.ep_size > 1 and config.parallel != 1:
            raise ValueError(f"MoEConfig.parallel={config.parallel!r} is invalid with expert module {name} (the "
                             f"general path): it runs expert parallel only, parallel=1")
        check_module(module, config.model_dim)
        local_experts = config.num_experts if local_experts is None else local_experts
        self.config, self.first_expert, self.module_name = config, first_expert, name
        self.local = nn.ModuleList(copy.deepcopy(module) for _ in range(local_experts))
        _warn_slower(name)

    def reset_parameters(self) -> None:
        """Draws expert i afresh with its submodules' own reset_parameters under a generator seeded from
        a base seed (from the global CPU RNG) and i, so the same seed gives the same experts whatever the
        ep_size. On the meta device it only draws the seed."""
        base_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        for i, expert in enumerate(self.local):
            if any(t.is_meta for t in expert.parameters()):
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(base_seed + self.first_expert + i)
                for module in expert.modules():
                    if callable(getattr(module, "reset_parameters", None)):
                        module.reset_parameters()

    def parallel_degrees(self, layout) -> list:
        return [1]

    def check_degree(self, layout, r: int) -> None:
        if r != 1:
            raise ValueError(f"parallel degree {r} is not supported with expert module {self.module_name} "
                             f"(the general path runs expert parallel only: parallel=1)")
        layout.check_degree(r)

    def forward(self, x_RD: torch.Tensor, rows_per_expert) -> torch.Tensor:
        """rows_per_expert: a list of ints or a tensor (read to the host); x_RD may hold more rows."""
        rows = rows_per_expert.tolist() if torch.is_tensor(rows_per_expert) else list(rows_per_expert)
        assert len(rows) == len(self.local), (len(rows), len(self.local))
        dtype, device_type = x_RD.dtype, x_RD.device.type
        cast = self.parameter_dtype(dtype) != dtype
        recompute = self.config.recompute == "experts" and torch.is_grad_enabled()
        outputs, start = [], 0
        for expert, count in zip(self.local, rows):
            # every expert runs, on 0 rows too: its parameters get a (zero) gradient, as on the fast path
            with torch.autocast(device_type, dtype=dtype) if cast else contextlib.nullcontext():
                rows_RD = x_RD[start:start + count]
                # recompute "experts": the module keeps only its input rows, and runs again in backward
                y_RD = checkpoint(expert, rows_RD, use_reentrant=False) if recompute else expert(rows_RD)
            _check_output(y_RD, self.module_name, count, self.config.model_dim)
            outputs.append(y_RD.to(dtype))
            start += count
        if start < x_RD.shape[0]:
            outputs.append(x_RD.new_zeros(x_RD.shape[0] - start, x_RD.shape[1]))
        return torch.cat(outputs)

    def local_share(self, state: Mapping[str, torch.Tensor], prefix: str = "experts.", first: int = 0) -> dict:
        """From a state dict holding every expert (`<prefix>local.<global i>.*`; or experts first, first + 1, ... as
        `local.0`, `local.1`, ...): this rank's experts under their local indices, the rest of the state as given."""
        own = range(self.first_expert - first, self.first_expert - first + len(self.local))
        share = {}
        for key, value in state.items():
            if not key.startswith(prefix + "local."):
                share[key] = value
                continue
            index, rest = key[len(prefix + "local."):].split(".", 1)
            if int(index) in own:
                share[f"{prefix}local.{int(index) - own.start}.{rest}"] = value
        return share


def check_module(module: nn.Module, model_dim: int) -> None:
    """Runs a copy of module once on random rows [3, model_dim]: it must give a tensor of that shape
    and leave its buffers unchanged (the experts are copies that never share a buffer update)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expert must be a torch.nn.Module, got {type(module).__name__}")
    name = type(module).__name__
    probe = copy.deepcopy(module)
    tensors = list(probe.parameters()) + list(probe.buffers())
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.get_default_dtype())
    before = {key: b.clone() for key, b in probe.named_buffers()} if device.type != "meta" else {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            y = probe(torch.randn(PROBE_ROWS, model_dim, dtype=dtype, device=device))
        except Exception as error:
            raise ValueError(f"expert module {name} cannot run on routed rows [rows, model_dim={model_dim}]: "
                             f"{type(error).__name__}: {error}") from error
    _check_output(y, name, PROBE_ROWS, model_dim)
    changed = [key for key, b in probe.named_buffers() if key in before and not torch.equal(before[key], b)]
    if changed:
        raise ValueError(f"expert module {name} changes its buffers {changed} in forward (e.g. BatchNorm's "
                         f"running statistics); moe_plugin's experts cannot update buffers: use a module "
                         f"without such state (e.g. LayerNorm)")


def _check_output(y, name: str, rows: int, model_dim: int) -> None:
    if not torch.is_tensor(y) or tuple(y.shape) != (rows, model_dim):
        got = f"shape {tuple(y.shape)}" if torch.is_tensor(y) else type(y).__name__
        raise ValueError(f"expert module {name} must map rows [rows, model_dim] to [rows, model_dim={model_dim}]; "
                         f"on {rows} rows it gave {got}")


@functools.lru_cache(maxsize=None)
def _warn_slower(name: str) -> None:
    warnings.warn(f"moe_plugin: expert module {name} is not Linear -> activation -> Linear; it runs on the "
                  f"general path (each expert's module in turn), slower than the stacked-weights fast path",
                  RuntimeWarning, stacklevel=4)
