"""transformers.Trainer fine-tuning a tiny swapped Mixtral with PEFT's LoRA on the experts (by HF's names) and on
attention, on 2 gloo processes under DeepSpeed ZeRO-2 (tests/integrations/hf_trainer_lora_worker.py)."""
import json
import os
import sys

import pytest
import torch

from hf_helpers import needs_transformers

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[lora])")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e .[deepspeed])")

pytestmark = [needs_transformers, pytest.mark.slow, pytest.mark.spawns, pytest.mark.timeout(600)]


def test_trainer_lora_on_swapped_experts_under_zero2_equals_one_process(tmp_path):
    """The first step equals one process's SGD step of PEFT on HF's own model over both ranks' batches; the loss
    falls; both ranks hold the same adapters. (Not checked: trainer.save_model's adapter folder, which under
    DeepSpeed's MoE blocks misses the expert adapters: see the README's limits.)"""
    import subprocess

    import hf_trainer_lora_worker as worker
    steps = 16
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               worker.__file__, str(tmp_path), str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert any(".mlp.experts." in n for n in result["trainable"]) and all("lora_" in n for n in result["trainable"])
        losses = result["losses"]
        assert len(losses) == steps and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses

    reference = worker.peft_model(swap=False)      # PEFT's own path on HF's experts, the same draws
    batch = torch.cat([torch.load(tmp_path / f"batch{rank}.pt") for rank in (0, 1)])
    reference(input_ids=batch, labels=batch).loss.backward()
    step1 = torch.load(tmp_path / "adapters0_step1.pt")
    params = dict(reference.named_parameters())
    assert set(step1) == {n for n, p in params.items() if p.requires_grad}
    for name, value in step1.items():
        update = worker.LR * params[name].grad
        error = float((value - (params[name].detach() - update)).abs().max())
        assert error <= 1e-4 * float(update.abs().max()) + 1e-6, f"{name}: {error} off one process's step"

    final = [torch.load(tmp_path / f"adapters{rank}.pt") for rank in (0, 1)]
    assert all(torch.equal(final[0][n], final[1][n]) for n in final[0])
    assert any(not torch.equal(final[0][n], step1[n]) for n in step1 if ".mlp.experts." in n)
