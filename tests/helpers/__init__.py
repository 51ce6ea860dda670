"""What the tests share, importable as `helpers.<module>` (pytest.ini puts tests/ on the path; spawned workers
inherit it, and torchrun'd scripts get it in PYTHONPATH from helpers.launch):

    plugin        the pytest plugin (loaded by tests/conftest.py): fresh seeds, the spawns marker and its guard
    launch        run_workers (gloo processes), torchrun_train (`moe-plugin train` on 2 processes)
    compare       relative_error (the one relative error) and assert_close_rel
    reference     the fast layer against the einsum reference (make_layer, assert_matches_reference ...)
    routes        random routes for the kernels' direct tests
    host_syncs    HostSyncs: which ops synchronized with the host
    init_checks   assert_normal, assert_uniform: a tensor drawn as an initializer draws it
    hf            tiny Hugging Face MoE models
    fairseq       a generated corpus and fairseq's commands as subprocesses
"""
