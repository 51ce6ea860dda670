"""A swapped HF model sharded with fully_shard_moe trains under transformers.Trainer with Accelerate's FSDP2
(fsdp_version 2) on 2 gloo processes, at ep_size 1 and 2, with the losses of HF's own blocks sharded by
Accelerate's FSDP2 in the same run setup (tests/helpers/workers/hf_fsdp_worker.py); export_hf of the sharded model
gives a folder plain from_pretrained loads as the trained model, and so does trainer.save_model's (Accelerate's FSDP2 full state dict)
for HF's own blocks and the swapped model at ep_size 1 and 2; at ep_size 2 Trainer's checkpoints (Accelerate's
sharded state dicts of model and AdamW, through DCP) resume exactly, and FULL_STATE_DICT checkpoints, which torch's
broadcast load cannot resume, are refused at their first save.

What this module tests (moved here from the README):

`tests/integrations/transformers/test_transformers_fsdp.py` (Trainer + Accelerate FSDP2, 2 processes, ep 1 and 2:
losses = HF's own blocks under Accelerate's FSDP2; Accelerate's FSDP2 full state dict equals the gathered
trained tensors at ep 1; `export_hf`'s folder loads as the trained model; `trainer.save_model`'s folder loads as
the trained model for HF's own blocks and for the swapped model at ep_size 1 and 2; at ep 2 a Trainer run with
AdamW resumed from its sharded step-2 checkpoint, from other starting weights, ends as the uninterrupted run
(without the 2-D form it ends 0.16 off); a rank stuck in save_model dumps its stack and fails the test).
"""
import json
import os
import subprocess
import sys

import pytest

from helpers.paths import REPO, TESTS

WORKER = TESTS / "helpers" / "workers" / "hf_fsdp_worker.py"


SAVE_MODEL_EPS = (0, 1, 2)   # trainer.save_model checked for these (0: HF's own blocks)


def launch(out, ep_size, steps=4):
    save_model = int(ep_size in SAVE_MODEL_EPS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), str(out), str(ep_size), str(steps), str(save_model)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads((out / f"result{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_trainer_with_accelerate_fsdp2_trains_a_sharded_swapped_model_as_hf_own_blocks(tmp_path):
    own = launch(tmp_path / "hf", 0)
    assert own[0]["blocks"] == [] and len(own[0]["losses"]) == 4
    assert own[0]["losses"][-1] < own[0]["losses"][0] - 0.3
    assert own[0]["save_model_logits_diff"] < 1e-4   # save_model's folder loads as the trained model
    for ep_size in (1, 2):
        swapped = launch(tmp_path / f"ep{ep_size}", ep_size)
        for rank in range(2):
            assert swapped[rank]["blocks"] and swapped[rank]["losses"] == pytest.approx(own[rank]["losses"], rel=1e-5)
        assert swapped[0]["export_logits_diff"] < 1e-4   # export_hf of the FSDP2 shards loads as the trained model
        if ep_size == 1:
            assert swapped[0]["full_state_dict_equal"] is True   # torch's get_model_state_dict (save_model's first half)
        else:   # resumed from Trainer's sharded step-2 checkpoint: every rank's shards end as the whole run's
            for rank_result in swapped:
                assert rank_result["resumed_moved"] > 0.05, "the resumed run must start elsewhere"
                assert rank_result["resumed_difference"] < 1e-6, rank_result["resumed_difference"]
                message = rank_result["full_checkpoint_refused"]   # its resume cannot work: refused by name
                assert "SHARDED_STATE_DICT" in message and "ep_size=2" in message, message
        if ep_size in SAVE_MODEL_EPS:
            assert swapped[0]["save_model_logits_diff"] < 1e-4
