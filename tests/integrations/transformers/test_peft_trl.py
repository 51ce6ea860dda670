"""TRL's SFTTrainer fine-tuning a tiny swapped Mixtral with PEFT's LoRA on the experts (by HF's names) and on
attention, on 2 gloo processes under DeepSpeed ZeRO-2 (tests/helpers/workers/trl_sft_lora_worker.py)."""
import pytest
import torch

from helpers.hf import needs_transformers
from helpers.lora_runs import assert_final_adapters_saved, assert_first_step_is_one_sgd_step, run_two_ranks

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[lora])")
pytest.importorskip("trl", reason="trl is not installed (pip install -e .[lora])")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e .[deepspeed])")

pytestmark = [needs_transformers, pytest.mark.slow, pytest.mark.spawns, pytest.mark.timeout(600)]


def test_sft_trainer_lora_on_swapped_experts_under_zero2_equals_one_process(tmp_path):
    """SFTTrainer(peft_config=...) on a swapped model: the first step equals one process's SGD step of PEFT on HF's
    own model (the same initial adapters) over both ranks' batches, HF's router aux loss (which SFTTrainer asks
    MoE models for, through the swapped block's router-logits tap) included; the loss falls; both ranks hold the same
    adapters; the saved adapter folder loads with plain PEFT on HF's own model and computes what the trained one
    computes."""
    from helpers.workers import hf_trainer_lora_worker as lora_worker
    from helpers.workers import trl_sft_lora_worker as worker
    steps = 12
    run_two_ranks(worker, tmp_path, steps)

    reference = peft.get_peft_model(worker.build_model(), lora_worker.lora_config())   # PEFT on HF's experts
    init = torch.load(tmp_path / "adapters0_init.pt")
    params = dict(reference.named_parameters())
    assert set(init) == {n for n, p in params.items() if p.requires_grad}
    with torch.no_grad():
        for name, value in init.items():
            params[name].copy_(value)
    for rank in (0, 1):   # SFTTrainer adds each rank's router aux loss (output_router_logits): per rank, averaged
        batch = torch.load(tmp_path / f"batch{rank}.pt")
        (reference(input_ids=batch, labels=batch, output_router_logits=True).loss / 2).backward()
    step1 = torch.load(tmp_path / "adapters0_step1.pt")
    assert_first_step_is_one_sgd_step(step1, reference, lora_worker.LR)
    batch = torch.cat([torch.load(tmp_path / f"batch{rank}.pt") for rank in (0, 1)])
    assert_final_adapters_saved(tmp_path, step1, batch)
