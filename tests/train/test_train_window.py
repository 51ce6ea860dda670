"""The training step's metrics window reads nothing from the device: each step's loss, aux loss, accuracy and
routing are summed where they are, and read once per record; the record equals what reading them every step
gives."""
import traceback

import pytest
import torch
import torch.nn.functional as F
from helpers.host_syncs import HostSyncs
from helpers.paths import package_path
from helpers.train import TINY

from moe_plugin import aux_loss, train
from moe_plugin.train.faults import Signals
from moe_plugin.train.loop import _step
from moe_plugin.train.metrics import Window
from moe_plugin.train.parts import build, data_parallel
from moe_plugin.train.processes import start_processes


class DeviceReads(HostSyncs):
    """Each host-syncing op, .tolist() and .item() while it is on: the file that asked (moe_plugin's relative
    path, or "elsewhere": torch's optimizers keep their step counts on the host)."""

    def __enter__(self):
        self.asked = []
        self.saved = torch.Tensor.tolist, torch.Tensor.item
        for name, method in zip(("tolist", "item"), self.saved):
            setattr(torch.Tensor, name, self._counting(method))
        return super().__enter__()

    def __exit__(self, *args):
        torch.Tensor.tolist, torch.Tensor.item = self.saved
        return super().__exit__(*args)

    def _counting(self, method):
        def read(tensor, *args):
            self._note()
            return method(tensor, *args)
        return read

    def _note(self):
        caller = [f.filename for f in traceback.extract_stack() if f.filename != __file__][-1]
        self.asked.append(package_path(caller) or "elsewhere")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self._note()
        return func(*args, **(kwargs or {}))


class Logits(torch.nn.Module):
    """The model, keeping each step's logits (for the reference loss)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, x):
        logits = self.model(x)
        self.seen.append(logits.detach())
        return logits


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device (real host syncs)"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overrides", [[], ["moe.capacity_factor=0.5", "moe.num_experts=5", "moe.top_k=3"]],
                         ids=["default", "dropping_k3"])
def test_a_step_reads_the_device_once_and_the_record_is_exact(tmp_path, fresh_seed, overrides, device):
    cfg = train.load_config(None, TINY + [f"log.out_dir={tmp_path}", f"train.seed={fresh_seed}",
                                          f"train.device={device}"] + overrides)
    procs = start_processes(device)
    parts = build(cfg, procs)
    wrapped = Logits(data_parallel(parts.model, procs))
    layers = parts.model.moe_layers()
    targets, losses, auxes, loads, dropped = [], [], [], [], []
    real_next = parts.data.train.next

    def next_batch():
        x, y = real_next()
        targets.append(y)
        return x, y
    parts.data.train.next = next_batch
    window, steps = Window(), 3
    with Signals() as signals:
        for step in range(1, steps + 1):
            with DeviceReads() as reads:
                window, _ = _step(cfg, procs, parts, wrapped, window, step, signals, 7)
            ours = [name for name in reads.asked if name != "elsewhere" and not name.startswith("ops/")]   # ops/:
            # the CPU kernels' own loops over experts
            assert ours == ["train/faults.py"], reads.asked      # the non-finite verdict, nothing else
            auxes.append(float(aux_loss(parts.model).detach()))
            stats = [layer.stats for layer in layers]
            loads.append([s["tokens_per_expert"] for s in stats])
            dropped.append(sum(s["dropped_fraction"] for s in stats) / len(stats))
    for logits, y in zip(wrapped.seen, targets):
        losses.append(F.cross_entropy(logits.flatten(0, -2), y.to(logits.device).flatten()).item())
    record = window.record(procs, steps, 0.5)
    assert record["loss"] == pytest.approx(sum(losses) / steps, rel=1e-6)
    assert record["aux_loss"] == pytest.approx(sum(auxes) / steps, rel=1e-6)
    assert record["dropped_fraction"] == pytest.approx(sum(dropped) / steps, rel=1e-9, abs=1e-12)
    assert record["tokens_per_expert"] == [[sum(step[i][e] for step in loads) for e in range(len(loads[0][i]))]
                                           for i in range(len(layers))]
    assert sum(map(sum, record["tokens_per_expert"])) == steps * cfg.train.batch_size * cfg.model.seq_len * \
        len(layers) * layers[0].config.top_k
    assert window.state()["steps"] == steps and "pending_V" not in window.state()
    if overrides:
        assert record["dropped_fraction"] > 0
