"""transformers.Trainer fine-tuning a tiny swapped Mixtral with PEFT's LoRA on the experts (by HF's names) and on
attention, on 2 gloo processes under DeepSpeed ZeRO-2 (tests/helpers/workers/hf_trainer_lora_worker.py)."""
import json

import pytest
import torch

from helpers.hf import needs_transformers
from helpers.launch import torchrun
from helpers.lora_runs import assert_final_adapters_saved, assert_first_step_is_one_sgd_step, run_two_ranks

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e .[lora])")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e .[deepspeed])")

pytestmark = [needs_transformers, pytest.mark.slow, pytest.mark.spawns, pytest.mark.timeout(600)]


def test_trainer_lora_on_swapped_experts_under_zero2_equals_one_process(tmp_path):
    """The first step equals one process's SGD step of PEFT on HF's own model over both ranks' batches; the loss
    falls; both ranks hold the same adapters. trainer.save_model's adapter folder holds every adapter (the experts'
    under DeepSpeed's MoE blocks included) and loads with plain PEFT on HF's own model, computing what the trained
    model computes; DeepSpeed's own checkpoint (per-expert files) brings the adapters back."""
    from helpers.workers import hf_trainer_lora_worker as worker
    steps = 16
    results = run_two_ranks(worker, tmp_path, steps)

    reference = worker.peft_model(swap=False)      # PEFT's own path on HF's experts, the same draws
    batch = torch.cat([torch.load(tmp_path / f"batch{rank}.pt") for rank in (0, 1)])
    reference(input_ids=batch, labels=batch).loss.backward()
    step1 = torch.load(tmp_path / "adapters0_step1.pt")
    assert set(step1) == {n for n, p in reference.named_parameters() if p.requires_grad}
    assert_first_step_is_one_sgd_step(step1, reference, worker.LR)
    assert_final_adapters_saved(tmp_path, step1, batch)
    for result in results:
        assert result["restored"], "DeepSpeed's load_checkpoint did not bring the adapters back"
        assert {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(6)} \
            <= set(result["files"]), result["files"]


def test_trainer_lora_save_under_zero2_at_ep_size_2_holds_every_ranks_experts(tmp_path):
    """With the experts split over 2 ranks (ep_size 2, 3 of 6 per rank), trainer.save_model's adapter holds every
    expert's factors in HF's layout (gathered on every rank), not rank 0's: plain PEFT on HF's own model loads it
    and computes each rank's logits of the trained 2-process model. DeepSpeed's own checkpoint still writes one
    file per expert and brings each rank's adapters back; PEFT's load of the saved adapter onto the 2-process model
    gives each rank its own experts' share."""
    from helpers.workers import hf_trainer_lora_worker as worker
    torchrun(worker.__file__, str(tmp_path), "3", "2")
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["restored"], "DeepSpeed's load_checkpoint did not bring the adapters back"
        assert {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(6)} \
            <= set(result["files"]), result["files"]
        assert result["reloaded"], "PEFT's load of the saved adapter did not give each rank its experts' adapters"
    local = [torch.load(tmp_path / f"adapters{rank}.pt") for rank in (0, 1)]
    expert_A = [n for n in local[0] if ".mlp.experts." in n and ".lora_A." in n]
    assert expert_A and all(not torch.equal(local[0][n], local[1][n]) for n in expert_A)   # each rank its experts

    plain = peft.PeftModel.from_pretrained(worker.build_model(), tmp_path / "adapter")
    loaded = {n: p for n, p in plain.named_parameters() if "lora_" in n}
    assert set(loaded) == set(local[0]), sorted(set(local[0]) ^ set(loaded))
    for name in expert_A:   # rank r's experts are experts 3r .. 3r+2: HF's lora_A is expert-major [Q*E, I]
        assert torch.equal(loaded[name], torch.cat([local[0][name], local[1][name]]))
    plain.eval()
    with torch.no_grad():
        for rank in (0, 1):
            batch = torch.load(tmp_path / f"batch{rank}.pt")
            torch.testing.assert_close(plain(batch).logits, torch.load(tmp_path / f"logits{rank}.pt"),
                                       rtol=1e-5, atol=1e-5)


def _state_dict_on_rank_0_only(rank, world_size):
    from helpers.workers import hf_trainer_lora_worker as worker
    from moe_plugin.integrations.deepspeed import hf as deepspeed_hf
    deepspeed_hf.GATHER_WAIT_S = 5.0
    model = deepspeed_hf.use_deepspeed_blocks(worker.peft_model(swap=True, ep_size=world_size))
    name = "base_model.model.model.layers.0.mlp.experts.lora_A.default.weight"
    local_rows = model.get_parameter(name).shape[0]
    full_rows = model.state_dict()[name].shape[0]     # every rank: every expert's factor
    if rank == 0:
        with pytest.raises(ValueError, match="every rank") as error:
            model.state_dict()
        return local_rows, full_rows, str(error.value)
    return local_rows, full_rows, None


def test_state_dict_at_ep_size_2_on_one_rank_only_is_a_clear_error():
    """The gathered state dict needs every rank: taken on rank 0 only (PEFT's save_pretrained without
    is_main_process on every rank), it fails with an error saying so instead of hanging."""
    from helpers.launch import run_workers
    reports = run_workers(_state_dict_on_rank_0_only, 2, timeout=200)
    for local_rows, full_rows, _ in reports:
        assert (local_rows, full_rows) == (4 * 3, 4 * 6)
    assert "is_main_process" in reports[0][2]
