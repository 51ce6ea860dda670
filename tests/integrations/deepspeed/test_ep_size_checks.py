"""ep_size must divide the number of processes: every entry point says so with a ValueError naming the setting, its
value and the number of processes, before DeepSpeed's groups fail with a bare `AssertionError: 2 is not divisible
by 4` (issue 31, item 2): moe_plugin's DeepSpeed initialize, the hooked deepspeed.initialize, the MoE class, the
HF block swap under a "moe" section, swap_moe_blocks and fully_shard_moe. The sizes that divide still build."""
import os

import pytest
from torch import nn

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.parallel.groups import check_ep_size

from helpers.hf import needs_transformers
from helpers.launch import run_workers
from helpers.paths import load_script

D, H = 8, 12
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
ON_2 = "is invalid: must divide the number of processes, 2 (launch with torchrun --nproc_per_node N"


def test_the_check_names_the_setting_the_processes_and_what_is_allowed():
    check_ep_size(3, "x.ep_size", world_size=6)
    check_ep_size(2, "x.ep_size", world_size=8, stages=2)
    with pytest.raises(ValueError) as error:
        check_ep_size(4, "x.ep_size", world_size=6)
    assert str(error.value) == ("x.ep_size=4 is invalid: must divide the number of processes, 6 (launch with torchrun "
                                "--nproc_per_node N, N a multiple of 4; or set it to one of [1, 2, 3, 6])")
    with pytest.raises(ValueError) as error:   # DeepSpeed splits the expert groups inside each pipeline stage
        check_ep_size(4, "x.ep_size", world_size=12, stages=2)
    assert str(error.value) == ("x.ep_size=4 is invalid: must divide the number of processes per pipeline stage, 6 "
                                "(12 processes in 2 pipeline stages; launch with torchrun --nproc_per_node N, N a "
                                "multiple of 8; or set it to one of [1, 2, 3, 6])")
    with pytest.raises(ValueError, match=r"^x.ep_size=2 needs torch.distributed to be initialized"):
        check_ep_size(2, "x.ep_size")   # this process started no torch.distributed
    check_ep_size(1, "x.ep_size")


@needs_transformers
def test_swap_moe_blocks_without_processes_names_its_argument_and_swaps_nothing():
    from helpers.hf import build_model
    from moe_plugin.integrations.transformers import HFMoEBlock, swap_moe_blocks
    model = build_model("mixtral", seed=0)
    with pytest.raises(ValueError, match=r"^swap_moe_blocks: ep_size=2 needs torch.distributed to be initialized"):
        swap_moe_blocks(model, ep_size=2)
    assert not any(isinstance(m, HFMoEBlock) for m in model.modules())


def deepspeed_worker(rank, world):
    """Every DeepSpeed entry point and swap_moe_blocks with sizes that do not divide 2 processes: the message of the
    ValueError each raises (None if it raised nothing), then sizes that divide, and the groups DeepSpeed made."""
    import logging

    import deepspeed
    from deepspeed.moe.layer import MoE as NativeMoE
    from deepspeed.utils import groups, logger

    pipeline_moe = load_script("examples/deepspeed/pipeline_moe.py")
    from helpers.hf import build_model
    from moe_plugin.integrations.deepspeed import MoE, enable, initialize
    from moe_plugin.integrations.deepspeed.hf import swap_for_section
    from moe_plugin.integrations.transformers import HFMoEBlock, swap_moe_blocks
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    enable()   # the hook, as moe_plugin_deepspeed_hook.pth enables it when deepspeed is imported

    def expert():
        return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))

    def native(ep_size):
        return nn.ModuleDict({"moe": NativeMoE(D, expert(), num_experts=4, ep_size=ep_size)})

    def moe(section):
        return {**BASE, "moe": section}

    deepseek, mixtral = build_model("deepseek_v3", seed=0), build_model("mixtral", seed=0)   # 8 and 6 experts
    cases = {
        "MoE ep 4": lambda: MoE(D, expert(), num_experts=4, ep_size=4, use_rts=False),
        "MoE 6 experts ep 3": lambda: MoE(D, expert(), num_experts=6, ep_size=3, use_rts=False),
        "initialize, native layers, tutel": lambda: initialize(model=native(4), config=moe({"backend": "tutel",
                                                                                           "ep_size": 4})),
        "initialize, native layers, deepspeed": lambda: initialize(model=native(4), config=moe({"backend": "deepspeed"})),
        "initialize, HF ep 4": lambda: initialize(model=deepseek, config=moe({"backend": "tutel", "ep_size": 4})),
        "initialize, HF 6 experts ep 3": lambda: initialize(model=mixtral, config=moe({"backend": "tutel",
                                                                                       "ep_size": 3})),
        "hooked deepspeed.initialize": lambda: deepspeed.initialize(model=mixtral, config=moe({"backend": "tutel",
                                                                                              "ep_size": 3})),
        "swap_for_section": lambda: swap_for_section(mixtral, {"backend": "tutel", "ep_size": 3}),
        "swap_moe_blocks ep 4": lambda: swap_moe_blocks(deepseek, ep_size=4),
        "swap_moe_blocks 6 experts ep 3": lambda: swap_moe_blocks(mixtral, ep_size=3),
    }
    report = {}
    for name, call in cases.items():
        try:
            call()
            report[name] = None
        except ValueError as error:
            report[name] = str(error)
    report["HF models untouched"] = not any(isinstance(m, (HFMoEBlock, MoE)) for model in (deepseek, mixtral)
                                            for m in model.modules())
    report["ep 2: local experts"] = [MoE(D, expert(), num_experts=4, ep_size=2, use_rts=False).num_local_experts,
                                     *{m.moe.groups.layout.local_experts for m in
                                       swap_moe_blocks(mixtral, ep_size=2).modules() if isinstance(m, HFMoEBlock)}]
    report["expert groups"] = sorted(groups._get_expert_parallel_group_dict())
    try:   # 2 stages of 1 process: DeepSpeed's expert groups live inside a stage
        initialize(model=pipeline_moe.pipeline({"backend": "tutel", "num_experts": 4, "ep_size": 2}, stages=2),
                   config=moe({"backend": "tutel", "ep_size": 2}))
        report["pipeline"] = None
    except ValueError as error:
        report["pipeline"] = str(error)
    finally:
        groups.mpu = None
    return report


@pytest.mark.slow
@needs_transformers
def test_every_deepspeed_entry_point_names_ep_size_and_the_number_of_processes():
    pytest.importorskip("deepspeed")
    section_4, section_3 = f"DeepSpeed config \"moe.ep_size\"=4 {ON_2}", f"DeepSpeed config \"moe.ep_size\"=3 {ON_2}"
    expected = {
        "MoE ep 4": f"ep_size=4 {ON_2}",
        "MoE 6 experts ep 3": f"ep_size=3 {ON_2}",
        "initialize, native layers, tutel": section_4,
        "initialize, native layers, deepspeed": f"MoE layer 'moe' ep_size=4 {ON_2}",
        "initialize, HF ep 4": section_4,
        "initialize, HF 6 experts ep 3": section_3,
        "hooked deepspeed.initialize": section_3,
        "swap_for_section": section_3,
        "swap_moe_blocks ep 4": f"swap_moe_blocks: ep_size=4 {ON_2}",
        "swap_moe_blocks 6 experts ep 3": f"swap_moe_blocks: ep_size=3 {ON_2}",
    }
    for report in run_workers(deepspeed_worker, 2, timeout=400):
        for name, start in expected.items():
            assert report[name] is not None and report[name].startswith(start), (name, report[name])
            assert report[name].endswith("or set it to one of [1, 2])"), (name, report[name])
        assert report["HF models untouched"], report
        assert report["ep 2: local experts"] == [2, 3], report
        assert report["expert groups"] == ["ep_size_2"], report   # DeepSpeed never got to ep_size 3 or 4
        assert report["pipeline"] is not None and report["pipeline"].startswith(
            "DeepSpeed config \"moe.ep_size\"=2 is invalid: must divide the number of processes per pipeline stage, "
            "1 (2 processes in 2 pipeline stages;"), report["pipeline"]


def fsdp_worker(rank, world, directory):
    """A model built at ep_size 2 on 2 processes, then sharded in a world of 1 process (each its own, as after an
    elastic restart with fewer processes): fully_shard_moe must stop with a ValueError before any collective."""
    import torch.distributed as dist

    from moe_plugin.parallel import fully_shard_moe
    model = nn.Sequential(nn.Linear(D, D), MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=4, ep_size=2)))
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{directory}/alone{rank}", rank=0, world_size=1)
    try:
        fully_shard_moe(model)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_fully_shard_moe_names_the_layer_s_ep_size_and_the_number_of_processes(tmp_path):
    for message in run_workers(fsdp_worker, 2, str(tmp_path), timeout=200):
        assert message == ("fully_shard_moe: MoE layer '1': ep_size=2 is invalid: must divide the number of processes, "
                           "1 (launch with torchrun --nproc_per_node N, N a multiple of 2; or set it to one of [1])")
