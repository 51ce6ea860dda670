"""The devices a plan is made for: each one's memory and the cost model's rates (parallel/cost_model.py).

The A100 profile is the cost model's calibrated Azure NDm A100 v4 (the Tutel paper's cluster). The H100 profile
takes the same start-up terms and the hardware's published rates; it is not fitted to any measurement. The CPU
profile is this repository's gloo fit (GLOO_HERE)."""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel.cost_model import GLOO_HERE, NDM_A100_V4, Params

GIB = 1024 ** 3


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    params: Params
    note: str


DEVICES = {
    "a100": Device("a100", 80 * GIB, NDM_A100_V4,
                   "A100 80 GB, NVSwitch within a node (196 GB/s per rank in an all-to-all), 200 Gb/s InfiniBand "
                   "per GPU (25 GB/s), 150 TFLOP/s on expert GEMMs; fitted to the Tutel paper (cost_model.py)"),
    "h100": Device("h100", 80 * GIB, NDM_A100_V4.with_(intra_gbps=360.0, inter_gbps=50.0, compute_tflops=400.0),
                   "H100 80 GB, NVLink 4 within a node (assumed 360 GB/s per rank in an all-to-all), 400 Gb/s "
                   "InfiniBand NDR per GPU (50 GB/s), 400 TFLOP/s achieved (40% of the 989 peak); start-ups as "
                   "the A100 fit; not fitted to measurements"),
    "cpu": Device("cpu", 16 * GIB, GLOO_HERE,
                  "gloo processes on a shared 2-core CPU host (GLOO_HERE, fitted on this repository's machine), "
                  "16 GiB assumed"),
}


def device(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"--device={name!r} is invalid: must be one of {', '.join(DEVICES)}")
    return DEVICES[name]
