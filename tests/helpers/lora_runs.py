"""What the two-process LoRA fine-tuning tests (transformers.Trainer, TRL's SFTTrainer) check of their runs' files:
the run itself, the first step against one process's SGD step, and the final adapters against plain PEFT on HF's
own model."""
import json

import torch

from helpers.launch import torchrun


def run_two_ranks(worker, out, steps: int) -> list:
    """torchrun worker OUT STEPS on 2 ranks; each rank's result<rank>.json, checked: only LoRA factors train (the
    experts' among them), and the loss falls."""
    torchrun(worker.__file__, str(out), str(steps))
    results = [json.loads((out / f"result{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert any(".mlp.experts." in n for n in result["trainable"]) and all("lora_" in n for n in result["trainable"])
        losses = result["losses"]
        assert len(losses) == steps and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    return results


def assert_first_step_is_one_sgd_step(step1: dict, reference, lr: float) -> None:
    """step1 (the adapters after the first step) is reference's adapters minus lr times its gradients."""
    params = dict(reference.named_parameters())
    for name, value in step1.items():
        update = lr * params[name].grad
        error = float((value - (params[name].detach() - update)).abs().max())
        assert error <= 1e-4 * float(update.abs().max()) + 1e-6, f"{name}: {error} off one process's step"


def assert_final_adapters_saved(out, step1: dict, batch) -> None:
    """Both ranks end with the same adapters, the experts' trained past step1; the saved adapter folder (out/adapter)
    loads with plain PEFT on HF's own model to them, and computes what the swapped model with them computes."""
    import peft

    from helpers.workers import hf_trainer_lora_worker as lora_worker   # imports transformers: tests skip without it
    final = [torch.load(out / f"adapters{rank}.pt") for rank in (0, 1)]
    assert all(torch.equal(final[0][n], final[1][n]) for n in final[0])
    assert any(not torch.equal(final[0][n], step1[n]) for n in step1 if ".mlp.experts." in n)
    plain = peft.PeftModel.from_pretrained(lora_worker.build_model(), out / "adapter")
    loaded = {n: p for n, p in plain.named_parameters() if "lora_" in n}
    assert set(loaded) == set(final[0]), sorted(set(final[0]) ^ set(loaded))
    assert all(torch.equal(loaded[n], final[0][n]) for n in loaded)
    trained = lora_worker.peft_model(swap=True)
    with torch.no_grad():
        mine = dict(trained.named_parameters())
        for name, value in final[0].items():
            mine[name].copy_(value)
        torch.testing.assert_close(plain(batch).logits, trained(batch).logits, rtol=1e-5, atol=1e-5)
