"""DeepSpeed options the tutel backend used to refuse (issue 31, item 3), each against DeepSpeed's own layer
(deepspeed.moe.layer.MoE) or a one-process run: noisy_gate_policy "Jitter" and "RSample" (exact under the same
RNG state; RSample's choices sampled from the softmax), used_token with k = 1, the per-expert view
experts.deepspeed_experts, and enable_expert_tensor_parallelism on 4 gloo processes (tensor-parallel groups of 2)."""
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
import deepspeed.moe.sharded_moe as sharded_moe  # noqa: E402
import moe_plugin.integrations.deepspeed as dsi  # noqa: E402
from deepspeed.moe.layer import MoE as NativeMoE  # noqa: E402
from helpers.launch import run_workers
from helpers.deepspeed import TorchWithStableTopk, native_named_grads  # noqa: E402

D, H, E, T = 8, 12, 4, 30
TOLERANCE = 1e-5   # fp32; DeepSpeed's gate computes in fp32


@pytest.fixture
def stable_topk(monkeypatch):
    """DeepSpeed's top-1 capacity selection takes torch.topk over a 0/1 mask, whose order among ties torch
    leaves open; by position (ours) is one allowed outcome, made certain here."""
    monkeypatch.setattr(sharded_moe, "torch", TorchWithStableTopk())


def pair(expert=None, **kwargs):
    """DeepSpeed's layer with distinct random experts, and ours with its weights."""
    expert = expert or nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    settings = dict(num_experts=E, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False, **kwargs)
    native = NativeMoE(D, expert, **settings)
    with torch.no_grad():
        for param in native.deepspeed_moe.experts.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = dsi.MoE(D, expert, **settings)
    ours.load_state_dict(native.state_dict())
    return native, ours


def run(layer, x_TD, upstream_TD, seed, *args, stacked=False, keep_grads=False):
    """Outputs and gradients of one training step's forward and backward, from RNG state `seed` (stacked: our
    stacked experts' gradients too, as "stacked <name>")."""
    x = x_TD.clone().requires_grad_()
    torch.manual_seed(seed)
    y, l_aux, exp_counts = layer(x, *args)
    ((y * upstream_TD).sum() + 0.1 * l_aux).backward()
    out = {"y": y.detach(), "l_aux": l_aux.detach(), "exp_counts": exp_counts.float(), "x.grad": x.grad,
           **native_named_grads(layer)}
    if stacked:
        out.update({f"stacked {n}": p.grad.clone() for n, p in layer.deepspeed_moe.experts.named_parameters()})
    if not keep_grads:
        layer.zero_grad()
    return out


def largest_difference(a, b):
    """The largest difference over the tensors, relative to each tensor's largest value (when above 1)."""
    assert a.keys() == b.keys()
    return max(((a[key] - b[key]).abs().max() / a[key].abs().max().clamp(min=1)).item() for key in a)


@pytest.mark.parametrize("policy, k", [("Jitter", 1), ("Jitter", 2), ("RSample", 1)])
def test_noisy_gate_policy_draws_as_deepspeed(policy, k, stable_topk):
    """The same RNG state gives DeepSpeed's numbers exactly (same noise, same choices); another state other
    numbers (the noise is on); in eval mode no noise at all."""
    native, ours = pair(k=k, capacity_factor=1.0, noisy_gate_policy=policy)
    x_TD, upstream_TD = torch.randn(T, D) * 3, torch.randn(T, D)
    theirs, mine = run(native, x_TD, upstream_TD, 5), run(ours, x_TD, upstream_TD, 5)
    assert largest_difference(theirs, mine) < TOLERANCE
    assert (run(ours, x_TD, upstream_TD, 6)["y"] - mine["y"]).abs().max() > 1e-3
    native.eval(), ours.eval()
    quiet, _ = pair(k=k, capacity_factor=1.0)
    quiet.load_state_dict(native.state_dict()), quiet.eval()
    with torch.no_grad():
        assert torch.equal(ours(x_TD)[0], ours(x_TD)[0])
        assert (ours(x_TD)[0] - quiet(x_TD)[0]).abs().max() < TOLERANCE


def test_rsample_chooses_as_sampling_the_softmax():
    """RSample's top-1 choice is a sample of the router's softmax (Gumbel-max); the gate stays the clean score.
    Without noise, or with Gaussian noise in its place, the frequencies miss the softmax by far more."""
    _, ours = pair(k=1, capacity_factor=0.0, noisy_gate_policy="RSample")
    router = ours.deepspeed_moe.router
    with torch.no_grad():
        router.weight_ED.copy_(torch.randn(E, D))
    x_TD = torch.randn(4, D)
    x_TD = x_TD / router.logits(x_TD).std(-1, keepdim=True)   # logits of spread ~1: every expert has a chance
    probs_TE = torch.softmax(router.logits(x_TD), -1).detach()
    draws = 4000
    counts_TE = torch.zeros_like(probs_TE)
    with torch.no_grad():
        for _ in range(draws):
            routes = router(x_TD)
            counts_TE.scatter_add_(1, routes.expert_TK, torch.ones_like(routes.gate_TK))
            assert torch.equal(routes.gate_TK, probs_TE.gather(1, routes.expert_TK))
    # 4 sigma of a frequency's standard deviation sqrt(p (1 - p) / draws) <= 0.032
    assert (counts_TE / draws - probs_TE).abs().max() < 0.032, (counts_TE / draws, probs_TE)
    argmax_TE = torch.zeros_like(probs_TE).scatter_(1, probs_TE.argmax(-1, keepdim=True), 1.0)
    assert (argmax_TE - probs_TE).abs().max() > 0.1   # the test tells "no noise" apart


@pytest.mark.parametrize("drop", [True, False], ids=["drops", "dropless"])
def test_used_token_masks_tokens_out_of_routing(drop, stable_topk):
    native, ours = pair(k=1, capacity_factor=0.5, drop_tokens=drop)   # capacity 4: 16 slots for 20 tokens
    x_TD, upstream_TD = torch.randn(T, D), torch.randn(T, D)
    used_T = torch.zeros(T).index_fill_(0, torch.randperm(T)[:20], 1.0)
    theirs, mine = run(native, x_TD, upstream_TD, 1, used_T), run(ours, x_TD, upstream_TD, 1, used_T)
    assert largest_difference(theirs, mine) < TOLERANCE
    assert (mine["y"][used_T == 0] == 0).all() and int(mine["exp_counts"].sum()) == int(used_T.sum())
    routed = int((mine["y"][used_T == 1].abs().sum(-1) > 0).sum())
    # with drops, the used tokens fill their experts' capacity: the masked ones took none of their slots
    assert routed == (int(mine["exp_counts"].clamp(max=4).sum()) if drop else 20) and (routed < 20) == drop
    # bool, and the input's leading shape, mean the same
    again = run(ours, x_TD.view(5, 6, D), upstream_TD.view(5, 6, D), 1, used_T.view(5, 6).bool())
    assert largest_difference({k: v.reshape(mine[k].shape) for k, v in again.items()}, mine) < TOLERANCE
    # all used: as without used_token
    every = run(ours, x_TD, upstream_TD, 1, torch.ones(T))
    assert largest_difference(every, run(ours, x_TD, upstream_TD, 1)) < TOLERANCE


def test_used_token_is_checked_and_ignored_above_top_1_as_deepspeed(stable_topk):
    _, ours = pair(k=1)
    with pytest.raises(ValueError, match=r"used_token must be a tensor of one 0/1 value per token, shape \(6,\)"):
        ours(torch.randn(6, D), torch.ones(5))
    with pytest.raises(ValueError, match="used_token must hold 0 .* or 1"):
        ours(torch.randn(6, D), torch.full((6,), 0.5))
    native, ours = pair(k=2, capacity_factor=1.0)
    x_TD, upstream_TD, used_T = torch.randn(T, D), torch.randn(T, D), (torch.rand(T) > 0.5).float()
    with pytest.warns(UserWarning, match="used_token is ignored with k=2"):
        mine = run(ours, x_TD, upstream_TD, 1, used_T)
    assert largest_difference(run(native, x_TD, upstream_TD, 1, used_T), mine) < TOLERANCE


def test_a_native_layer_with_a_noisy_gate_swaps_and_keeps_it(stable_topk):
    """The "moe" section's swap rebuilds DeepSpeed's layer as ours with its noisy_gate_policy (refused before)."""
    native, _ = pair(k=1, capacity_factor=1.0, noisy_gate_policy="RSample")
    ours = dsi.swap_moe_layers(nn.ModuleDict({"moe": native}), {"backend": "tutel"})[0]["moe"]
    assert isinstance(ours, dsi.MoE) and ours.deepspeed_moe.router.noise_policy == "gumbel"
    x_TD, upstream_TD = torch.randn(T, D) * 3, torch.randn(T, D)
    assert largest_difference(run(native, x_TD, upstream_TD, 2), run(ours, x_TD, upstream_TD, 2)) < TOLERANCE


def test_noisy_gate_policy_values_are_checked():
    expert = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    with pytest.raises(ValueError, match=r"noisy_gate_policy='Gaussian' is invalid; allowed: None, 'None', "
                                         r"'Jitter', 'RSample'"):
        dsi.MoE(D, expert, num_experts=E, use_rts=False, noisy_gate_policy="Gaussian")
    with pytest.warns(UserWarning, match="noisy_gate_policy='RSample' has no effect with k=2"):
        layer = dsi.MoE(D, expert, num_experts=E, k=2, use_rts=False, top2_2nd_expert_sampling=False,
                        noisy_gate_policy="RSample")
    assert layer.deepspeed_moe.router.noise_policy is None
    with pytest.raises(ValueError, match="enable_expert_tensor_parallelism='yes' is invalid"):
        dsi.MoE(D, expert, num_experts=E, use_rts=False, enable_expert_tensor_parallelism="yes")


class NamedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.ModuleDict({"fc1": nn.Linear(D, H)})
        self.act, self.fc2 = nn.GELU(), nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.block["fc1"](x)))


def test_deepspeed_experts_is_a_read_only_view_of_each_expert(stable_topk):
    native, ours = pair(k=1)
    theirs, mine = native.deepspeed_moe.experts.deepspeed_experts, ours.deepspeed_moe.experts.deepspeed_experts
    assert len(mine) == len(theirs) == E
    for i in range(E):
        for j in (0, 2):
            assert torch.equal(mine[i][j].weight, theirs[i][j].weight) and torch.equal(mine[i][j].bias,
                                                                                        theirs[i][j].bias)
        assert mine[i].state_dict().keys() == theirs[i].state_dict().keys()
        assert all(torch.equal(v, theirs[i].state_dict()[k]) for k, v in mine[i].state_dict().items())
    with torch.no_grad():   # reads the current values
        ours.deepspeed_moe.experts.w2_EHD[3].mul_(2)
    assert torch.equal(mine[3][2].weight, 2 * theirs[3][2].weight)
    x_TD, upstream_TD = torch.randn(T, D), torch.randn(T, D)
    ours.load_state_dict(native.state_dict())
    run(native, x_TD, upstream_TD, 1, keep_grads=True), run(ours, x_TD, upstream_TD, 1, keep_grads=True)
    mine = ours.deepspeed_moe.experts.deepspeed_experts   # and the gradients (plain .grad, as ZeRO 0 keeps them)
    for i in range(E):
        for j in (0, 2):
            assert torch.allclose(mine[i][j].weight.grad, theirs[i][j].weight.grad, atol=1e-5, rtol=1e-5)
            assert torch.allclose(mine[i][j].bias.grad, theirs[i][j].bias.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(AttributeError, match="read-only view of the stacked expert weights"):
        mine[1][0].weight = nn.Parameter(torch.zeros(H, D))
    with pytest.raises(AttributeError, match="expert 1 has no Linear '1'; its Linears are '0' and '2'"):
        mine[1][1]
    # named Linears, nested and without bias
    native, ours = pair(expert=NamedMLP(), k=1)
    theirs, mine = native.deepspeed_moe.experts.deepspeed_experts, ours.deepspeed_moe.experts.deepspeed_experts
    assert torch.equal(mine[2].block.fc1.weight, theirs[2].block.fc1.weight)
    assert torch.equal(mine[2].block["fc1"].bias, theirs[2].block["fc1"].bias) and mine[2].fc2.bias is None
    assert torch.equal(mine[2].fc2.weight, theirs[2].fc2.weight)
    # the general path's experts are modules: the view is the modules themselves
    native, ours = pair(expert=nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D)), k=1)
    mine = ours.deepspeed_moe.experts.deepspeed_experts
    assert isinstance(mine[0], nn.Sequential) and mine[0] is ours.deepspeed_moe.experts.local[0]
    assert torch.equal(mine[1][1].weight, native.deepspeed_moe.experts.deepspeed_experts[1][1].weight)


class TensorParallelUnit:
    """A minimal mpu: tensor-parallel groups of consecutive ranks, data-parallel groups across them."""

    def __init__(self, tp):
        import torch.distributed as dist
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.rank = tp, rank
        for start in range(0, world, tp):
            group = dist.new_group(list(range(start, start + tp)))
            if rank // tp == start // tp:
                self.tp_group = group
        for first in range(tp):
            group = dist.new_group(list(range(first, world, tp)))
            if rank % tp == first:
                self.dp_group = group
        self.world = world

    def get_model_parallel_rank(self):
        return self.rank % self.tp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self):
        return self.rank // self.tp

    def get_data_parallel_world_size(self):
        return self.world // self.tp

    def get_data_parallel_group(self):
        return self.dp_group


def sliced_state(full, layer, tp_rank, tp):
    """The whole experts' tensors (one-process layer's state) as this tensor-parallel rank holds them: its hidden
    slice of its local experts; the output bias on tensor-parallel rank 0 only (the ranks' parts are summed)."""
    experts = layer.deepspeed_moe.experts
    first, local = experts.first_expert, experts.w1_EDH.shape[0]
    Hs = experts.w1_EDH.shape[-1]
    hidden = slice(tp_rank * Hs, (tp_rank + 1) * Hs)
    own = slice(first, first + local)
    return {"w1_EDH": full["w1_EDH"][own][:, :, hidden], "b1_EH": full["b1_EH"][own][:, hidden],
            "w2_EHD": full["w2_EHD"][own][:, hidden], "b2_ED": full["b2_ED"][own] * (tp_rank == 0)}


def tensor_parallel_worker(rank, world):
    import deepspeed
    from deepspeed.utils import groups
    from helpers.deepspeed import setup_worker
    setup_worker(rank, world)
    tp = 2
    tp_rank, dp_rank = rank % tp, rank // tp
    settings = dict(num_experts=E, k=2, capacity_factor=1.0, min_capacity=0, use_rts=False,
                    top2_2nd_expert_sampling=False)
    torch.manual_seed(0)   # the same whole model on every rank
    whole = dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), **settings)
    with torch.no_grad():
        for param in whole.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    full = {name: p.detach().clone() for name, p in whole.deepspeed_moe.experts.named_parameters()}
    generator = torch.Generator().manual_seed(dp_rank)   # tensor-parallel ranks hold the same tokens
    x_TD, upstream_TD = torch.randn(T, D, generator=generator), torch.randn(T, D, generator=generator)
    mpu = TensorParallelUnit(tp)
    report = {}

    def build(ep_size, load=True):
        slice_module = nn.Sequential(nn.Linear(D, H // tp), nn.ReLU(), nn.Linear(H // tp, D))
        layer = dsi.MoE(D, slice_module, ep_size=ep_size, enable_expert_tensor_parallelism=True, **settings)
        copies = all(torch.equal(layer.deepspeed_moe.experts.w1_EDH[i], slice_module[0].weight.t())
                     for i in range(layer.num_local_experts))
        if load:
            load_whole(layer)
        return layer, copies

    def load_whole(layer):   # this rank's share of the whole experts (its experts known once its group is bound)
        with torch.no_grad():
            layer.deepspeed_moe.router.weight_ED.copy_(whole.deepspeed_moe.router.weight_ED)
            for name, tensor in sliced_state(full, layer, tp_rank, tp).items():
                getattr(layer.deepspeed_moe.experts, name).copy_(tensor)

    def compare(name, layer):
        want, got = run(whole, x_TD, upstream_TD, 3, stacked=True), run(layer, x_TD, upstream_TD, 3, stacked=True)
        for out in (want, got):   # expert gradients compared stacked, below
            for key in [key for key in out if ".experts." in key]:
                out.pop(key)
        stacked = {n: want.pop(f"stacked {n}") for n in full}
        if layer.deepspeed_moe.is_parallel:   # an expert's gradient: from the tokens of every rank of its ep group
            for grad in stacked.values():
                torch.distributed.all_reduce(grad, group=layer.deepspeed_moe.groups.ep_group)
        want_grads = sliced_state(stacked, layer, tp_rank, tp)
        want_grads["b2_ED"] = sliced_state(stacked, layer, 0, tp)["b2_ED"]   # each rank's part: b2's whole gradient
        got_grads = {n: got.pop(f"stacked {n}") for n in full}
        errors = {key: (want[key] - got[key]).abs().max().item() for key in want}
        errors.update({f"grad {n}": (want_grads[n] - g).abs().max().item() for n, g in got_grads.items()})
        report[name] = (max(errors.values()), max(errors, key=errors.get), len(got_grads))

    # ep_size 1, groups made as the engine makes them: the mpu known only at set_deepspeed_parallelism
    layer, copies = build(1)
    groups.mpu = mpu
    layer.set_deepspeed_parallelism()
    report["copies"] = copies
    report["expert tp size"] = groups._get_expert_model_parallel_world_size()
    compare("ep 1", layer)
    # ep_size 2, layers built before DeepSpeed knows the mpu (DeepSpeed's test_moe_tp): a forward says so; the
    # engine binds one (deepspeed.initialize(mpu=...) creates the groups), the other binds at its first forward
    groups.mpu = None
    (first, _), (later, _) = build(2, load=False), build(2, load=False)
    report["pending"] = first.deepspeed_moe.group_pending and later.deepspeed_moe.group_pending
    try:
        later(x_TD)
        report["error"] = None
    except ValueError as error:
        report["error"] = str(error)
    engine, _, _, _ = deepspeed.initialize(model=first, mpu=mpu, model_parameters=first.parameters(),
                                           config={"train_micro_batch_size_per_gpu": 1,
                                                   "optimizer": {"type": "SGD", "params": {"lr": 0.0}}})
    with torch.no_grad():
        later(x_TD)
    deepspeeds = torch.distributed.get_process_group_ranks(groups._get_expert_parallel_group("ep_size_2"))
    for name, layer in (("ep 2 mpu at initialize", first), ("ep 2 mpu at first forward", later)):
        report[f"{name} group"] = (torch.distributed.get_process_group_ranks(layer.deepspeed_moe.groups.ep_group),
                                   deepspeeds, layer.deepspeed_moe.experts.first_expert)
        load_whole(layer)
        compare(name, layer)
    # ep_size 2 with the mpu known when built: the expert-parallel group joins the ranks of one tensor-parallel rank
    layer, _ = build(2)
    report["ep 2 group"] = torch.distributed.get_process_group_ranks(layer.deepspeed_moe.groups.ep_group)
    compare("ep 2", layer)
    # through deepspeed.initialize with the mpu (DeepSpeed's test_moe_tp): the engine's forward
    groups.mpu = None
    layer, _ = build(1)
    engine, _, _, _ = deepspeed.initialize(model=layer, mpu=mpu, model_parameters=layer.parameters(),
                                           config={"train_micro_batch_size_per_gpu": 1,
                                                   "optimizer": {"type": "SGD", "params": {"lr": 0.0}}})
    with torch.no_grad():
        report["engine"] = (engine(x_TD)[0] - whole(x_TD)[0]).abs().max().item()
    return report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_expert_tensor_parallelism_equals_one_process():
    """4 gloo processes, tensor-parallel groups of 2 ([0, 1], [2, 3]): each rank holds the hidden slice of the
    experts it was given, and the layer equals one process holding the whole experts: outputs, l_aux,
    exp_counts, input, gate and expert gradients, at ep_size 1 and 2, and under deepspeed.initialize. At ep_size 2
    also in DeepSpeed's test_moe_tp order, the layer built before DeepSpeed knows the mpu: bound by the engine or at
    the first forward after, in DeepSpeed's expert-parallel group; a forward before that is a clear error."""
    for rank, report in enumerate(run_workers(tensor_parallel_worker, 4, timeout=500)):
        assert report.pop("copies") and report.pop("expert tp size") == 2
        assert report.pop("ep 2 group") == [rank % 2, rank % 2 + 2]
        assert report.pop("pending")
        assert "has no expert-parallel group yet" in report.pop("error")
        for name in ("ep 2 mpu at initialize", "ep 2 mpu at first forward"):
            ours, deepspeeds, first_expert = report.pop(f"{name} group")
            assert ours == deepspeeds == [rank % 2, rank % 2 + 2] and first_expert == 2 * (rank // 2), (name, ours)
        assert report.pop("engine") < TOLERANCE
        for name, (error, where, expert_grads) in report.items():
            assert error < TOLERANCE and expert_grads > 0, f"rank {rank} {name}: {where} differs by {error}"


def test_expert_tensor_parallelism_at_ep_size_2_builds_before_the_mpu_and_refuses_a_forward_without_it(monkeypatch):
    """Built before DeepSpeed knows the mpu (DeepSpeed's test_moe_tp builds the layer, then calls initialize): the
    group is bound later; a forward before any group is known is a clear error, not a run on the wrong ranks."""
    from deepspeed.utils import groups
    monkeypatch.setattr(groups, "mpu", None)
    monkeypatch.setattr(dsi.native, "check_ep_size_under_deepspeed", lambda *args: None)
    monkeypatch.setattr(dsi.native, "_ensure_distributed", lambda: None)
    assert "ep_size_2" not in groups._get_expert_parallel_group_dict()
    layer = dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), num_experts=E, ep_size=2,
                    use_rts=False, enable_expert_tensor_parallelism=True)
    assert layer.deepspeed_moe.group_pending and layer.deepspeed_moe.experts.w1_EDH.shape[0] == E // 2
    with pytest.raises(ValueError, match=r"enable_expert_tensor_parallelism=True with ep_size=2: the layer has no "
                                         r"expert-parallel group yet .* deepspeed.initialize\(..., mpu=mpu\)"):
        layer(torch.randn(T, D))


def test_expert_tensor_parallelism_ep_size_must_divide_the_data_parallel_processes(monkeypatch):
    """4 processes, tensor-parallel size 4: one data-parallel process, which ep_size 2 cannot split (DeepSpeed:
    a bare AssertionError "1 is not divisible by 2" inside its groups)."""
    from deepspeed.utils import groups

    class FourWayTensorParallel:
        def get_model_parallel_world_size(self):
            return 4

        def get_data_parallel_world_size(self):
            return 1

    monkeypatch.setattr(groups, "mpu", FourWayTensorParallel())
    monkeypatch.setattr(dsi.native, "check_ep_size_under_deepspeed", lambda *args: None)
    monkeypatch.setattr(dsi.native, "_ensure_distributed", lambda: None)
    with pytest.raises(ValueError, match=r"ep_size=2 with enable_expert_tensor_parallelism=True must divide the "
                                         r"data-parallel processes of DeepSpeed's mpu \(1, with tensor-parallel size 4\)"):
        dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), num_experts=E, ep_size=2,
                use_rts=False, enable_expert_tensor_parallelism=True)


def used_token_ep2_worker(rank, world):
    from helpers.deepspeed import setup_worker, stable_topk
    setup_worker(rank, world)
    stable_topk()
    worst = {}
    for drop in (True, False):
        torch.manual_seed(11)   # the gate the same on both ranks; each rank's experts its own
        native, ours = pair(k=1, capacity_factor=0.5, drop_tokens=drop, ep_size=2)
        native.set_deepspeed_parallelism()
        generator = torch.Generator().manual_seed(rank)
        x_TD, upstream_TD = torch.randn(T, D, generator=generator), torch.randn(T, D, generator=generator)
        used_T = (torch.rand(T, generator=generator) > 0.3).float()
        worst[drop] = largest_difference(run(native, x_TD, upstream_TD, 1, used_T), run(ours, x_TD, upstream_TD, 1,
                                                                                         used_T))
    return worst


@pytest.mark.slow
def test_used_token_at_ep_size_2():
    """Tokens masked on each rank of an expert-parallel pair, with drops and dropless: DeepSpeed's numbers."""
    for worst in run_workers(used_token_ep2_worker, 2, timeout=300):
        assert max(worst.values()) < TOLERANCE, worst


def test_tensor_parallelism_without_expert_tensor_parallelism_is_refused(monkeypatch):
    from deepspeed.utils import groups

    class TwoWayTensorParallel:
        def get_model_parallel_world_size(self):
            return 2

    monkeypatch.setattr(groups, "mpu", TwoWayTensorParallel())
    layer = dsi.MoE(D, nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), num_experts=E, use_rts=False)
    with pytest.raises(ValueError, match=r"tensor model parallelism \(an mpu with tensor parallel size > 1\) without "
                                         r"enable_expert_tensor_parallelism=True"):
        layer.set_deepspeed_parallelism()
    with pytest.raises(ValueError, match="used_token is not supported with aux_loss 'seq'"):
        dsi.MoE(D, nn.Linear(D, D), num_experts=E, k=1, use_rts=False, aux_loss="seq")(torch.randn(6, D), torch.ones(6))


class LossOf(nn.Module):
    """A DeepSpeed MoE layer as a model whose forward gives a loss."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x, upstream):
        y, l_aux, _ = self.moe(x)
        return (y * upstream).sum() + 0.1 * l_aux


def zero_reads_worker(rank, world):
    """Per ZeRO stage and ep_size: DeepSpeed's safe_get_full_grad and (after the step) safe_get_full_fp32_param on
    each expert's Linear weight and bias, read through experts.deepspeed_experts of DeepSpeed's layer and of ours
    (its views of the stacked parameters), one step from the same weights."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from helpers.deepspeed import setup_worker, stable_topk
    setup_worker(rank, world)
    stable_topk()

    def expert_tensors(layer):   # (name, tensor) of each local expert's Linears: DeepSpeed's modules or our views
        return [(f"{i}.{j}.{name}", getattr(expert[j], name))
                for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts)
                for j in (0, 2) for name in ("weight", "bias")]

    report = {}
    for stage in (0, 1, 2):
        for ep_size in (1, 2):
            torch.manual_seed(stage)   # the same weights on every rank, as the engine's broadcast leaves them
            native, ours = pair(k=2, capacity_factor=1.0, ep_size=ep_size)
            generator = torch.Generator().manual_seed(10 * stage + rank)
            x_TD, upstream_TD = torch.randn(T, D, generator=generator), torch.randn(T, D, generator=generator)
            reads = []
            for layer in (native, ours):
                config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                          "optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}}}
                engine, _, _, _ = deepspeed.initialize(model=LossOf(layer), config=config,
                                                       model_parameters=layer.parameters())
                engine.backward(engine(x_TD, upstream_TD))
                read = {f"grad {n}": safe_get_full_grad(v).clone() for n, v in expert_tensors(layer)}
                engine.step()
                views = expert_tensors(layer)
                if stage > 0:   # the optimizer's fp32 weights (its Adam states: see the test's doc)
                    read.update({f"fp32 {n}": safe_get_full_fp32_param(v).clone() for n, v in views})
                reads.append(read)
            report[(stage, ep_size)] = (largest_difference(*reads), len(reads[1]))
    return report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_full_reads_of_expert_views_under_zero():
    """DeepSpeed's TestExpertWeightGradWithZero reads safe_get_full_grad(experts.deepspeed_experts[i][0].weight); at
    ZeRO 1/2 the gradient lives in the optimizer. Through our views it reads the stacked parameter's slice: the
    values of DeepSpeed's own layer, with ZeRO partitions that split the stacked tensors (ep_size 1, 2 ranks).
    safe_get_full_optimizer_state is not compared: DeepSpeed 0.19.8 links the optimizer states of the first param
    group only (stage_1_and_2._optimizer_step steps one group, then links all), so for DeepSpeed's own expert
    parameters it raises "exp_avg not found in optimizer state fragment"."""
    for report in run_workers(zero_reads_worker, 2, timeout=500):
        for (stage, ep_size), (error, count) in report.items():
            assert count == (4 if stage == 0 else 8) * E // ep_size, (stage, ep_size, count)
            assert error < TOLERANCE, (stage, ep_size, error)
