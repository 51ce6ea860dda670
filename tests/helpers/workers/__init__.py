"""Scripts the tests run under torchrun (each rank a fresh interpreter, as the host frameworks' launchers start
them): Hugging Face Trainer, Accelerate, TRL and DeepSpeed runs on tiny models. They import `helpers.workers...`
through PYTHONPATH, which helpers.plugin puts tests/ on for every process the tests start."""


def leave_together() -> None:
    """At a worker's end (its results written): every rank waits for the others, the process groups are torn down,
    and the process ends at once, skipping the interpreter's teardown. A rank that exits while another still uses
    the group can make gloo abort a process at exit ('terminate called without an active exception', seen on rank 1
    of the Accelerate run of test_deepspeed_hook while rank 0 computed its reference); on 2026-12-05 rank 1 of
    hf_fsdp_worker (ep_size 1) aborted so after both had passed the barrier, in the interpreter's teardown."""
    import os
    import sys

    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
