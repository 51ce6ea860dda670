"""`moe-plugin plan` in this process: its figures against hand counts from the model's own parameters, its roles
against every rank built one by one, its errors (one line, exit code 2), its JSON, the memory warning and the
largest micro-batch, and its cost at 2,048 ranks (one build per role, not per rank). The checks against real
multi-process runs are in test_plan_real_runs.py.
"""
import json
from pathlib import Path

import pytest
import torch

from moe_plugin import cli, train
from moe_plugin.activations import first_width
from moe_plugin.layer import MoELayer
from moe_plugin.plan import experiment, plan_experiment
from moe_plugin.plan.assembly import forward_without_data
from moe_plugin.plan.devices import DEVICES, device
from moe_plugin.plan.state_bytes import state_bytes
from moe_plugin.train.parts import build_model

ROOT = Path(__file__).resolve().parents[2]

TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.hidden_size=48", "moe.num_experts=4", "train.batch_size=4"]


def unsharded_bytes(cfg):
    """(dense, all experts') parameter bytes of the run's model built whole (ep_size 1) on the meta device."""
    with torch.device("meta"):
        model = build_model(train.load_config(None, ["moe.num_experts=64"]))
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    params = list(model.parameters())
    return (sum(p.numel() * 4 for p in params if id(p) not in experts),
            sum(p.numel() * 4 for p in params if id(p) in experts))


def test_ddp_at_2048_ranks_is_one_role_built_once_and_holds_its_share_of_the_experts(monkeypatch):
    builds = []
    build_role = experiment.build_role
    monkeypatch.setattr(experiment, "build_role", lambda *a, **k: builds.append(a[1]) or build_role(*a, **k))
    cfg = train.load_config(None, ["parallel.ep_size=8", "moe.num_experts=64"])
    plan = plan_experiment(cfg, 2048, 8, device("h100"))
    dense, experts = unsharded_bytes(cfg)
    assert builds == [0] and len(plan.roles) == 1 and plan.roles[0].ranks == list(range(2048))
    role = plan.roles[0]
    assert role.parameters_bytes == role.gradients_bytes == dense + experts // 8
    tensors = len(list(experiment.build_role(cfg, 0, 2048, 8, shard=False).parameters()))   # tied ones once
    assert role.optimizer_bytes == 2 * role.parameters_bytes + 4 * tensors     # AdamW's two moments and a step
    assert role.all_reduce_bytes == dense + experts // 8     # experts: all-reduced over their 256 holders


def test_all_to_all_bytes_by_hand():
    # the default experiment: T = 16 rows x 128 = 2048 tokens, K 2, E 8, D 128, fp32; capacity ceil(1.25 x 512) =
    # 640 >= the balanced 512 per expert: 4096 rows per pass; 4 passes x 2 layers x 4096 x 128 x 4 bytes
    plan = plan_experiment(train.load_config(None, ["parallel.ep_size=4"]), 8, 8, device("a100"))
    assert [(t.capacity, t.rows_balanced) for t in plan.layers] == [(640, 4096)] * 2
    assert plan.roles[0].all_to_all_bytes == 4 * 2 * 4096 * 128 * 4
    # the busiest rank at the bound: its 2 experts filled to 640 by each of the 4 ranks (5120 <= 4 x 4096)
    assert plan.roles[0].all_to_all_bound_bytes == 4 * 2 * (4 * 2 * 640) * 128 * 4
    assert plan_experiment(train.load_config(None, []), 8, 8, device("a100")).roles[0].all_to_all_bytes == 0


@pytest.mark.parametrize("overrides", [["moe.capacity_formula=tutel", "moe.capacity_factor=0.1", "moe.min_capacity=0"],
                                       ["moe.capacity_formula=tutel", "moe.capacity_factor=1.1",
                                        "moe.capacity_alignment=24"],
                                       ["moe.capacity_factor=0.3", "moe.min_capacity=100"]])
def test_the_planned_capacity_is_the_layers(overrides):
    """The plan's capacity per expert is what the real layer uses on that micro-batch (its formula, alignment and
    lower bound)."""
    cfg = train.load_config(None, [*TINY, "model.layers=4", "parallel.ep_size=2", "train.batch_size=3", "model.seq_len=50",
                                   *overrides])
    plan = plan_experiment(cfg, 2, 2, device("a100"))
    layer = MoELayer(train.moe_config(cfg).replace(ep_size=1))
    layer(torch.randn(150, cfg.model.dim))
    assert [t.capacity for t in plan.layers] == [layer.stats["capacity"]] * 2


def test_fsdp_roles_equal_every_rank_built_and_sharded_one_by_one():
    # 6 ranks, ep 2: dense tensors in 6 chunks along dim 0 (the 256-row embedding: 5 x 43 + 41), each rank's 4
    # experts over their 3 holders along dim 0 (2 + 2 + 0): several roles
    cfg = train.load_config(None, [*TINY, "moe.num_experts=8", "parallel.ep_size=2", "parallel.fsdp=true"])
    plan = plan_experiment(cfg, 6, 6, device("cpu"))
    assert len(plan.roles) > 1
    for rank in range(6):
        held = state_bytes(experiment.build_role(cfg, rank, 6, 6, shard=True))
        role = next(role for role in plan.roles if rank in role.ranks)
        assert (role.parameters_bytes, role.gradients_bytes, role.optimizer_bytes) == \
            (held.parameters, held.gradients, held.optimizer), rank


def test_the_largest_micro_batch_fits_and_one_more_row_does_not():
    plan = plan_experiment(train.load_config(None, TINY), 2, 2, device("cpu"))
    memory = DEVICES["cpu"].memory_bytes
    fixed = plan.roles[0].peak_bytes - plan.roles[0].activations_bytes
    per_row = plan.activation_bytes_per_row
    assert fixed + plan.roles[0].activations_bytes + (plan.max_micro_batch - 4) * per_row <= memory
    assert fixed + plan.roles[0].activations_bytes + (plan.max_micro_batch - 3) * per_row > memory
    # the rows' activations are linear: a plan at twice the rows adds as many rows' worth
    double = plan_experiment(train.load_config(None, [*TINY, "train.batch_size=8"]), 2, 2, device("cpu"))
    assert double.roles[0].activations_bytes == plan.roles[0].activations_bytes + 4 * per_row


def test_a_plan_over_the_memory_warns_with_the_largest_micro_batch(capsys):
    assert cli.main(["plan", "--world-size", "2", "--device", "cpu", "train.batch_size=8192"]) == 0
    err = capsys.readouterr().err
    largest = plan_experiment(train.load_config(None, []), 2, 2, device("cpu")).max_micro_batch
    assert f"train.batch_size={largest}" in err and "parallel.ep_size" in err and 0 < largest < 8192


def test_json_has_the_fields_as_integers(capsys):
    assert cli.main(["plan", *TINY, "parallel.ep_size=2", "--world-size", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 4 and plan["step_seconds"] > 0
    assert [r for role in plan["roles"] for r in role["ranks"]] == [0, 1, 2, 3]
    for role in plan["roles"]:
        for key in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
                    "all_to_all_bytes", "peak_bytes"):
            assert isinstance(role[key], int) and role[key] > 0, key


# the errors the issue asks for before anything is built
BEFORE_BUILD = [
    (["--world-size", "6", "parallel.ep_size=4"],
     "parallel.ep_size=4 is invalid: must divide the number of processes, 6 (plan with --world-size N, N a multiple "
     "of 4"),
    (["--world-size", "4", "parallel.ep_size=4", "moe.num_experts=6"], "ep_size=4 cannot hold num_experts=6"),
    # Tutel's formula: 2 * int(0.003 * ceil(2048 / 8)) = 0 slots (the "ceil" formula never gives 0 at cf > 0)
    (["--world-size", "2", "moe.capacity_formula=tutel", "moe.capacity_factor=-0.003", "moe.min_capacity=0"],
     "moe.capacity_factor=-0.003 gives each expert 0 slots at 2048 tokens per rank"),
]


@pytest.mark.parametrize("arguments, message", BEFORE_BUILD, ids=["ep_size", "experts", "capacity"])
def test_the_issues_errors_come_before_any_model_is_built(monkeypatch, capsys, arguments, message):
    monkeypatch.setattr(experiment, "build_role", lambda *a, **k: pytest.fail(f"a model was built before: {message}"))
    assert cli.main(["plan", *arguments]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    *BEFORE_BUILD,
    (["--world-size", "12", "--node-size", "8"], "--node-size=8 is invalid: must divide --world-size=12"),
    (["--world-size", "0"], "--world-size=0 is invalid: must be an integer >= 1"),
    (["--world-size", "2", "--device", "tpu"], "--device='tpu' is invalid: must be one of a100, h100, cpu"),
    # 8 experts per rank over 256 holders: sharded along the model dim, 128 rows over 256 ranks, which FSDP2 refuses
    (["--world-size", "2048", "parallel.fsdp=true", "parallel.ep_size=8", "moe.num_experts=64"],
     "parallel.fsdp=true fails at --world-size=2048: FSDP2 says FSDP does not support uneven sharding on dim 1"),
])
def test_errors_are_one_line_naming_the_setting(capsys, arguments, message):
    assert cli.main(["plan", *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def suggested(err: str) -> list:
    """The values an error message offers: the list after its last 'one of '."""
    return json.loads(err.rsplit("one of ", 1)[1].split("]")[0] + "]")


@pytest.mark.parametrize("arguments", [
    ["parallel.ep_size=8", "moe.num_experts=16", "--world-size", "12", "--node-size", "4"],   # the issue's
    ["parallel.ep_size=4", "moe.num_experts=6", "--world-size", "4"],    # 4 divides the world, not the 6 experts
    ["parallel.ep_size=16", "moe.num_experts=8", "--world-size", "24", "--node-size", "8"],   # slices: 48 / 2, / 3
])
def test_every_ep_size_an_error_suggests_is_then_accepted(capsys, arguments):
    """Issue 58 item 10: ep_size values that divide the world AND that every MoE layer takes, nothing else."""
    assert cli.main(["plan", *TINY, *arguments]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.ep_size" in err, err
    values = suggested(err)
    world = int(arguments[arguments.index("--world-size") + 1])
    assert values and all(world % v == 0 for v in values)

    def plan(ep_size):
        return cli.main(["plan", *TINY, *arguments[:2], f"parallel.ep_size={ep_size}", *arguments[2:]])
    for value in values:
        assert plan(value) == 0, capsys.readouterr().err
    capsys.readouterr()
    others = [v for v in range(1, world + 1) if world % v == 0 and v not in values]   # the divisors left out fail
    for value in others:
        assert plan(value) == 2
    assert len(capsys.readouterr().err.splitlines()) == len(others)


def test_a_default_is_blamed_by_name_never_as_a_flag_the_user_gave(capsys):
    assert cli.main(["plan", *TINY, "--world-size", "12"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--node-size=8" not in err, err
    assert "--world-size=12 is not a multiple of the default --node-size, 8 processes per node" in err
    for node_size in suggested(err):
        assert cli.main(["plan", *TINY, "--world-size", "12", "--node-size", str(node_size)]) == 0
    capsys.readouterr()
    assert cli.main(["plan", *TINY, "--world-size", "12", "--node-size", "8"]) == 2    # given: named as given
    assert "--node-size=8 is invalid: must divide --world-size=12" in capsys.readouterr().err
    assert cli.main(["plan", *TINY, "--world-size", "4"]) == 0     # under 8 processes: one node of 4



@pytest.mark.parametrize("device", ["a100", "h100"])
def test_the_assumptions_say_the_node_size_the_plan_used(capsys, device):
    """The device's note names its links, not a node size: the plan's own line says how many ranks a node holds."""
    for node_size in (2, 4, 8):
        assert cli.main(["plan", *TINY, "--world-size", "16", "--node-size", str(node_size), "--device", device]) == 0
        out = capsys.readouterr().out
        assert f"world 16 ranks ({node_size} per node)" in out
        assert [n for n in (2, 4, 8) if f"{n} per node" in out] == [node_size], out

def test_step_time_by_hand():
    # 2 gloo ranks on this host's fitted profile, ep 2, one MoE layer: T = 4 x 32 tokens, K 2, every row kept
    # (capacity 2.0): each rank sends S = 256 rows x 32 x 4 bytes per pass, half of it to the other rank; gloo's
    # two link levels are used one after the other: 1,750 us per call + S/2 at 0.4 GB/s; four passes
    plan = plan_experiment(train.load_config(None, [*TINY, "parallel.ep_size=2", "moe.capacity_factor=2.0"]), 2, 2,
                           device("cpu"))
    assert plan.step.all_to_all == pytest.approx(4 * (1750e-6 + 256 * 32 * 4 / 2 / 0.4e9))
    # the dense gradients all-reduced over 2 ranks on one node (a ring: 2 x (1,750 us + half the bytes at 0.4 GB/s))
    dense = plan.roles[0].all_reduce_bytes
    assert plan.step.gradients == pytest.approx(2 * (1750e-6 + dense / 2 / 0.4e9))
    # compute: the expert GEMMs FlopCounterMode does not see (2 x 256 rows x 32 x 48 x 2 matrices) on top of its count
    tiny = train.load_config(None, TINY)
    _, counted = forward_without_data(lambda: build_model(tiny), 4, 32)
    assert plan.step.compute == pytest.approx(3 * (counted + 2 * 256 * 32 * 48 * 2) / 0.028e12)


def test_fsdp_step_time_by_hand():
    # FSDP2 on 2 gloo ranks of one node, ep 1: the parameters gathered forward and backward and the gradients
    # reduce-scattered, a ring call each (1,750 us + half the bytes at 0.4 GB/s), but the root unit (embedding, final
    # norm, head: outside the blocks) stays gathered after forward, so backward gathers the blocks alone
    cfg = train.load_config(None, [*TINY, "parallel.fsdp=true"])
    plan = plan_experiment(cfg, 2, 2, device("cpu"))
    with torch.device("meta"):
        model = build_model(cfg)
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    assert 0 < blocks < every

    def ring(nbytes):
        return 1750e-6 + nbytes / 2 / 0.4e9
    assert plan.step.gradients == pytest.approx(2 * ring(every) + ring(blocks))


def test_the_plan_shows_what_each_recompute_mode_keeps(capsys):
    """The figures of the mode not configured are those of a plan with that mode configured; "experts" keeps less
    and so fits a larger micro-batch."""
    plans = {mode: plan_experiment(train.load_config(None, [*TINY, f"moe.recompute={mode}"]), 2, 2, device("h100"))
             for mode in ("none", "experts")}
    for mode, plan in plans.items():
        assert plan.recompute[mode].activations_bytes == plan.roles[0].activations_bytes
        assert plan.recompute[mode].peak_bytes == plan.roles[0].peak_bytes
        assert plan.recompute[mode].max_micro_batch == plan.max_micro_batch
        other = plans["experts" if mode == "none" else "none"]
        assert plan.recompute != {} and plan.recompute == other.recompute
        assert plan.recompute[mode].step_seconds == plan.step.seconds
    none, experts = plans["none"].recompute["none"], plans["none"].recompute["experts"]
    assert experts.activations_bytes < none.activations_bytes and experts.max_micro_batch > none.max_micro_batch
    # the first projection again in backward: 2 x rows x D x H FLOPs per MoE layer (2H gated) at the device's rate
    cfg = train.load_config(None, TINY)
    rows, width = plans["none"].layers[0].rows_kept, first_width(cfg.moe["activation"], cfg.moe["hidden_size"])
    extra = len(plans["none"].layers) * 2 * rows * cfg.model.dim * width
    rate = DEVICES["h100"].params.compute_tflops * 1e12
    assert experts.step_seconds - none.step_seconds == pytest.approx(extra / rate, rel=1e-9)
    assert cli.main(["plan", *TINY, "--world-size", "2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["recompute"]
    assert set(shown) == {"none", "experts"}
    for option in shown.values():
        assert all(isinstance(option[k], int) for k in ("activations_bytes", "peak_bytes", "max_micro_batch"))
        assert option["step_seconds"] > 0
    assert cli.main(["plan", *TINY, "--world-size", "2"]) == 0
    assert "'experts' keeps" in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [[], ["moe.capacity_factor=0", "moe.top_k=3", "moe.activation=swiglu"]],
                         ids=["default", "dropless_k3_swiglu"])
def test_each_moe_layers_activations_are_what_a_real_forward_keeps(overrides, fresh_seed):
    """The plan splits the micro-batch's activations into each MoE layer's and the rest's: within 10% of what a
    real forward on real data keeps for backward inside each MoE layer and outside them."""
    from moe_plugin.plan.state_bytes import storage_key
    cfg = train.load_config(None, [*TINY, "model.layers=4", f"train.seed={fresh_seed}", *overrides])
    plan = plan_experiment(cfg, 1, 1, device("a100"))
    torch.manual_seed(fresh_seed)
    model = build_model(cfg)
    inside = {"layer": None}
    kept = {name: 0 for name in [n for n, m in model.named_modules() if isinstance(m, MoELayer)] + ["rest"]}
    seen, held = {storage_key(p) for p in model.parameters()}, []

    def pack(tensor):
        if storage_key(tensor) not in seen:
            seen.add(storage_key(tensor))
            held.append(tensor)
            kept[inside["layer"] or "rest"] += tensor.untyped_storage().nbytes()
        return tensor
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            module.register_forward_pre_hook(lambda m, args, name=name: inside.update(layer=name))
            module.register_forward_hook(lambda m, args, out: inside.update(layer=None))
    x_BS = torch.randint(model.token_embedding.num_embeddings, (cfg.train.batch_size, cfg.model.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(x_BS)
        torch.nn.functional.cross_entropy(logits.flatten(0, -2), x_BS.flatten())
    real = [kept[name] for name in kept if name != "rest"]
    assert len(real) == len(plan.moe_activations) == 2
    for planned, measured in zip(plan.moe_activations, real):
        assert planned == pytest.approx(measured, rel=0.1)
    assert plan.roles[0].activations_bytes - sum(plan.moe_activations) == pytest.approx(kept["rest"], rel=0.1)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs" / "plans").glob("*.yaml")))
def test_the_worked_setups_are_valid_experiments(path):
    """docs/planning.md's setups (configs/plans/) parse and pass the plan's checks at the world sizes it names (their
    plans take a minute, in benchmarks/RESULTS.md)."""
    cfg = train.load_config(str(ROOT / path), [])
    world = {"mixtral_8x7b.yaml": 8, "deepseek_v3.yaml": 2048}[Path(path).name]
    experiment.check_world(cfg, world, 8)
    assert cfg.hf is not None and cfg.parallel.fsdp and world % cfg.parallel.ep_size == 0
    assert f"moe-plugin plan {path} --world-size {world} --node-size 8" in (ROOT / "docs" / "planning.md").read_text()


def test_the_docs_example_is_what_the_command_prints(capsys):
    """docs/planning.md's first example, line by line (a line ending in '...' is a prefix of the printed one)."""
    text = (ROOT / "docs" / "planning.md").read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    command = block[0].removeprefix("$ moe-plugin ").split()
    assert cli.main(command) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(block) - 1
    for shown, line in zip(block[1:], printed):
        assert line.startswith(shown[:-3]) if shown.endswith("...") else line == shown, (shown, line)
