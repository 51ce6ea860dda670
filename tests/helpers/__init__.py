"""What the tests share, importable as `helpers.<module>` (pytest.ini puts tests/ on the path; spawned workers
inherit it, and scripts run under torchrun get it in PYTHONPATH):

    plugin        the pytest plugin (loaded by tests/conftest.py): fresh seeds, the spawns marker and its guard
    launch        run_workers (gloo processes), torchrun_train (`moe-plugin train` on 2 processes)
    compare       relative_error (the one relative error) and assert_close_rel
    reference     the fast layer against the einsum reference (make_layer, assert_matches_reference ...)
    expert_parallel   a rank's share of a full expert tensor, and one process's gradients on every rank's tokens
    sgd_steps     a tiny TransformerLM's SGD steps on each rank against one process (DDP, FSDP)
    reshard       train, save, restore in another layout and compare (sharded checkpoints)
    train         `moe-plugin train` in this process at a tiny size
    routes        random routes for the kernels' direct tests
    host_syncs    HostSyncs: which ops synchronized with the host
    init_checks   assert_normal, assert_uniform: a tensor drawn as an initializer draws it
    hf            tiny Hugging Face MoE models
    fairseq       a generated corpus and fairseq's commands as subprocesses (run_modules: several in one interpreter)
"""
