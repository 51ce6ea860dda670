"""aux_loss_scope="global" (issue 55 item 3) on 2 and 4 gloo processes, with and without expert parallelism, against
one process on all processes' tokens together (aux_loss_scope "local" there: one process's batch is the whole):
with the router's gradients averaged over the processes (as data parallelism does), the router's gradient equals
the one process's (fp64 1e-12; fp32 1e-5, where the fused routing would run), the processes' mean aux loss equals
its aux loss, and each process's input gradient is P times the one process's on its rows. The gshard, switch and
seq losses; unequal token counts and a process without tokens. Single-process checks at the end."""
import pytest
import torch
import torch.distributed as dist

from helpers.balance_steps import (D, H, build, micro_batches, one_f_one_b_run, spanning_reference,
                                   spanning_run)
from helpers.compare import relative_error
from helpers.launch import run_workers
from moe_plugin import MoEConfig, MoELayer
from moe_plugin.one_process import fused_route
from moe_plugin.router import counts_globally


def compare_global(rank, world, specs):
    errors = {}
    for spec in specs:
        dtype = spec.get("dtype", torch.float64)
        torch.manual_seed(spec["seed"])
        reference = build(spec, dtype)                       # one process: aux_loss_scope "local"
        layer = build(spec, dtype, aux_loss_scope="global", ep_size=spec.get("ep", 1))
        layer.load_full_state_dict(reference.state_dict())
        generator = torch.Generator().manual_seed(spec["seed"] + 1)
        S = spec.get("seq", 1)
        xs = [torch.randn(n, S, D, generator=generator, dtype=dtype) for n in spec["tokens"]]
        ups = [torch.randn(x.shape, generator=generator, dtype=dtype) for x in xs]
        # a random router, skewed a little, so that the global counts differ from each process's
        with torch.no_grad():
            layer.router.weight_ED.mul_(3.0)
            reference.router.weight_ED.mul_(3.0)

        x_all = torch.cat(xs).requires_grad_()
        y_all = reference(x_all)
        # the one process's loss: each process's task term averaged, plus the balance loss on all tokens
        ((y_all * torch.cat(ups)).sum() / world + reference.aux_loss).backward()

        x = xs[rank].clone().requires_grad_()
        if dtype == torch.float32 and spec.get("ep", 1) == 1:
            # where the fused routing (and the one-node path) would run, the global count takes the reference path
            assert counts_globally(layer.router) and not fused_route.routed_as_configured(layer, x.reshape(-1, D))
        y = layer(x)
        ((y * ups[rank]).sum() + layer.aux_loss).backward()
        grad_ED = layer.router.weight_ED.grad.clone()
        dist.all_reduce(grad_ED)
        grad_ED /= world                          # data parallelism averages the router's gradient
        aux = layer.aux_loss.detach().clone()
        dist.all_reduce(aux)
        start = sum(spec["tokens"][:rank])
        rows = slice(start, start + spec["tokens"][rank])
        errors[spec["name"]] = {
            "router grad": relative_error(grad_ED, reference.router.weight_ED.grad, floor=1e-12),
            "aux": relative_error(aux / world, reference.aux_loss.detach(), floor=1e-12),
            "x.grad": relative_error(x.grad, world * x_all.grad[rows], floor=1e-12),
            "local differs": relative_error(_local_aux(spec, dtype, layer, x), layer.aux_loss.detach()),
        }
    return errors


def _local_aux(spec, dtype, layer, x):
    """This process's aux loss counted locally: the global one must differ from it (the check means something)."""
    local = build(spec, dtype, ep_size=spec.get("ep", 1))
    local.load_state_dict(layer.state_dict())
    local(x.detach())
    return local.aux_loss.detach()


def _check(results, specs):
    for spec in specs:
        for rank, errors in enumerate(results):
            got = errors[spec["name"]]
            tol = 1e-5 if spec.get("dtype") == torch.float32 else 1e-12
            for what in ("router grad", "aux", "x.grad"):
                assert got[what] <= tol, f"{spec['name']}: rank {rank} {what} relative error {got[what]:.3g}"
        assert max(errors[spec["name"]]["local differs"] for errors in results) > 1e-3, spec["name"]


SPECS_2 = [
    dict(name="gshard data parallel", E=4, k=2, aux="gshard", tokens=[7, 4], seed=1),
    dict(name="switch ep2", E=4, k=2, aux="switch", ep=2, tokens=[5, 9], seed=2),
    dict(name="seq ep2", E=8, k=3, aux="seq", ep=2, tokens=[3, 2], seq=5, seed=3),
    dict(name="gshard fp32 fused path skipped", E=8, k=2, aux="gshard", tokens=[16, 24], seed=4,
         dtype=torch.float32),
]
SPECS_4 = [
    dict(name="switch data parallel empty rank", E=4, k=2, aux="switch", tokens=[6, 0, 9, 3], seed=11),
    dict(name="gshard ep4", E=8, k=2, aux="gshard", ep=4, tokens=[5, 8, 2, 7], seed=12),
    dict(name="switch ep2 x dp2", E=4, k=3, aux="switch", ep=2, tokens=[4, 6, 5, 3], seed=13),
    dict(name="seq data parallel", E=4, k=2, aux="seq", tokens=[2, 3, 1, 2], seq=4, seed=14),
]


@pytest.mark.timeout(900)
def test_global_balance_loss_two_processes_match_one_process():
    _check(run_workers(compare_global, 2, SPECS_2, timeout=800), SPECS_2)


@pytest.mark.timeout(900)
def test_global_balance_loss_four_processes_match_one_process():
    _check(run_workers(compare_global, 4, SPECS_4, timeout=800), SPECS_4)


def test_global_scope_on_one_process_is_the_local_loss():
    torch.manual_seed(0)
    spec = dict(E=4, k=2, aux="switch")
    local, glob = build(spec, torch.float64), build(spec, torch.float64, aux_loss_scope="global")
    glob.load_state_dict(local.state_dict())
    x = torch.randn(10, D, dtype=torch.float64)
    local(x)
    glob(x)
    assert not counts_globally(glob.router)
    assert torch.equal(local.aux_loss, glob.aux_loss)


def test_aux_loss_scope_is_checked():
    with pytest.raises(ValueError, match="aux_loss_scope='world'.*'local', 'global'"):
        MoEConfig(model_dim=D, hidden_size=H, aux_loss_scope="world")
    with pytest.raises(ValueError, match="aux_loss_scope='global' is invalid with aux_loss='load_importance'"):
        MoEConfig(model_dim=D, hidden_size=H, aux_loss="load_importance", gate_noise=1.0, gate_noise_kind="tutel",
                  aux_loss_scope="global")


def test_every_host_key_reaches_the_layer():
    from moe_plugin.train.config import moe_config, parse_config
    assert moe_config(parse_config(None, ["moe.aux_loss_scope=global"])).aux_loss_scope == "global"
    with pytest.raises(ValueError, match="aux_loss_scope='both'"):
        moe_config(parse_config(None, ["moe.aux_loss_scope=both"]))

    from moe_plugin.integrations.deepspeed.native import MoE
    from moe_plugin.integrations.deepspeed.section import read_moe_section
    section = read_moe_section({"moe": {"backend": "tutel", "aux_loss_scope": "global"}})
    assert section["aux_loss_scope"] == "global"
    expert = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, D))
    layer = MoE(D, expert, num_experts=4, k=2, use_rts=False, top2_2nd_expert_sampling=False, aux_loss_scope="global")
    assert layer.deepspeed_moe.config.aux_loss_scope == "global"
    with pytest.raises(ValueError, match='"moe.aux_loss_scope"=\'all\' is invalid'):
        read_moe_section({"moe": {"backend": "tutel", "aux_loss_scope": "all"}})
    with pytest.raises(ValueError, match='"moe.aux_loss_scope"=\'global\' needs "moe.backend": "tutel"'):
        read_moe_section({"moe": {"backend": "deepspeed", "aux_loss_scope": "global"}})


def test_the_fairseq_flag_reaches_the_layer():
    pytest.importorskip("fairseq")
    import argparse

    from moe_plugin.integrations.fairseq_moe.config import add_moe_args, moe_config_from_args, set_moe_defaults
    parser = argparse.ArgumentParser()
    add_moe_args(parser)
    for flags, scope in (([], "local"), (["--moe-aux-loss-scope", "global"], "global")):
        args = parser.parse_args(flags)
        set_moe_defaults(args)
        args.activation_fn = "relu"
        assert moe_config_from_args(args, D, H).aux_loss_scope == scope


def test_the_hf_swap_keyword_reaches_the_layer():
    pytest.importorskip("transformers")
    from helpers.hf import build_model
    from moe_plugin.integrations.transformers import swap_moe_blocks
    model = swap_moe_blocks(build_model("mixtral", seed=0), aux_loss="switch", aux_loss_scope="global")
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert layers and all(m.config.aux_loss_scope == "global" for m in layers)


# Counts over an optimizer step's micro-batches (moe_plugin.begin_step, which the hosts call at each step's start)


@pytest.mark.parametrize("aux, k, sizes", [("gshard", 2, (7, 3, 12)), ("switch", 3, (5, 1, 9, 4)),
                                           ("switch", 1, (11, 0, 6))])
def test_after_begin_step_the_counts_span_the_step_s_micro_batches(aux, k, sizes):
    """One process, fp64: micro-batch i weighs its probabilities by the choices of micro-batches 1..i (the last by
    the whole step's, as one process on the step's tokens); an empty micro-batch among them."""
    spec = dict(E=5, k=k, aux=aux)
    reference, layer = build(spec, torch.float64), build(spec, torch.float64, aux_loss_scope="global")
    with torch.no_grad():
        reference.router.weight_ED.mul_(3.0)
    layer.load_state_dict(reference.state_dict())
    xs, ups = micro_batches(sizes)
    grad_ED, x_grads, losses = spanning_run(layer, xs, ups)
    grad_ref_ED, x_grads_ref, losses_ref = spanning_reference(reference, xs, ups)
    assert relative_error(losses, losses_ref, floor=1e-12) <= 1e-12
    assert relative_error(grad_ED, grad_ref_ED, floor=1e-12) <= 1e-12
    assert all(relative_error(g, g_ref, floor=1e-12) <= 1e-12 for g, g_ref in zip(x_grads, x_grads_ref))
    assert layer.router.step_counts_E1[-1] == sum(sizes)
    local = build(spec, torch.float64)                 # without begin_step: each micro-batch its own counts
    local.load_state_dict(reference.state_dict())
    # (fp64: any difference past rounding is real; 2.5e-4 was drawn once in 300 seeds)
    assert relative_error(spanning_run_without_mark(local, xs, ups), losses) > 1e-9


def spanning_run_without_mark(layer, xs, ups):
    losses = []
    for x in xs:
        layer(x)
        losses.append(layer.aux_loss.detach().clone())
    return torch.stack(losses)


def test_a_recomputed_forward_counts_its_micro_batch_once():
    """Activation checkpointing runs the layer's forward again in backward: the same gradients as without it."""
    spec = dict(E=4, k=2, aux="switch")
    layer = build(spec, torch.float64, aux_loss_scope="global")
    again = build(spec, torch.float64, aux_loss_scope="global")
    again.load_state_dict(layer.state_dict())
    xs, ups = micro_batches((6, 9, 4), seed=1)
    grad_ED, x_grads, losses = spanning_run(layer, xs, ups)
    grad_again_ED, x_grads_again, losses_again = spanning_run(again, xs, ups, checkpointed=True)
    assert torch.equal(losses, losses_again) and torch.equal(grad_ED, grad_again_ED)
    assert all(torch.equal(g, h) for g, h in zip(x_grads, x_grads_again))
    assert again.router.step_counts_E1[-1] == 19


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant", "deepspeed"])
def test_a_recompute_after_later_forwards_weighs_by_its_own_forward_s_counts(checkpointing):
    """A pipeline's 1F1B order (forward 1, forward 2, backward 1, forward 3, backward 2, backward 3) under
    activation checkpointing (torch's two kinds, DeepSpeed's): each recompute runs after a later micro-batch's
    forward, yet micro-batch i's gradient still weighs by the counts of micro-batches 1..i, as its forward's loss
    did (fp64 1e-12 against the reference); two micro-batches with the same counts among them."""
    if checkpointing == "deepspeed":
        pytest.importorskip("deepspeed")
    spec = dict(E=5, k=2, aux="switch")
    reference, layer = build(spec, torch.float64), build(spec, torch.float64, aux_loss_scope="global")
    with torch.no_grad():
        reference.router.weight_ED.mul_(3.0)
    layer.load_state_dict(reference.state_dict())
    xs, ups = micro_batches((8, 5, 11), seed=2)
    xs[2] = torch.cat([xs[0], xs[0][:3]])                 # micro-batch 3 holds micro-batch 1's tokens and more
    xs.insert(1, xs[0].clone())                           # micro-batch 2 repeats micro-batch 1: the same counts
    ups.insert(1, ups[0].flip(0))
    grad_ref_ED, x_grads_ref, losses_ref = spanning_reference(reference, xs, ups)

    grad_ED, x_grads, losses = one_f_one_b_run(layer, xs, ups, checkpointing)
    assert relative_error(losses, losses_ref, floor=1e-12) <= 1e-12
    assert relative_error(grad_ED, grad_ref_ED, floor=1e-12) <= 1e-12
    assert all(relative_error(g, g_ref, floor=1e-12) <= 1e-12 for g, g_ref in zip(x_grads, x_grads_ref))


def compare_spanning(rank, world, sizes):
    """sizes[rank][i]: this process's tokens in micro-batch i. Each micro-batch's forward then backward, and the
    1F1B order under activation checkpointing (tests/helpers/balance_steps.py)."""
    spec = dict(E=6, k=2, aux="switch")
    torch.manual_seed(0)
    reference = build(spec, torch.float64)
    with torch.no_grad():
        reference.router.weight_ED.mul_(3.0)
    per_rank = [micro_batches(rank_sizes, seed=r) for r, rank_sizes in enumerate(sizes)]
    xs_all = [torch.cat([xs[i] for xs, _ in per_rank]) for i in range(len(sizes[0]))]
    ups_all = [torch.cat([ups[i] for _, ups in per_rank]) for i in range(len(sizes[0]))]
    grad_ref_ED, x_grads_ref, _ = spanning_reference(reference, xs_all, ups_all, world)
    starts = [sum(rank_sizes[i] for rank_sizes in sizes[:rank]) for i in range(len(sizes[0]))]
    errors = {}
    for order, run in (("in turn", spanning_run), ("1f1b", one_f_one_b_run)):
        layer = build(spec, torch.float64, aux_loss_scope="global")
        layer.load_state_dict(reference.state_dict())
        grad_ED, x_grads, _ = run(layer, *per_rank[rank])
        dist.all_reduce(grad_ED)
        grad_ED /= world                          # data parallelism averages the router's gradient
        errors[f"{order} router grad"] = relative_error(grad_ED, grad_ref_ED, floor=1e-12)
        errors[f"{order} x.grad"] = max(relative_error(g, world * g_ref[start:start + len(g)], floor=1e-12)
                                        for g, g_ref, start in zip(x_grads, x_grads_ref, starts))
    return errors


@pytest.mark.timeout(300)
def test_spanning_counts_on_two_processes_match_one_process_on_the_step_s_tokens():
    """2 processes, 3 micro-batches each (one process without tokens in one of them), in turn and in 1F1B order
    under activation checkpointing: the averaged router gradient is the one process's on every process's
    micro-batch i together, counting micro-batches 1..i of every process."""
    results = run_workers(compare_spanning, 2, [[5, 8, 0], [3, 11, 7]], timeout=250)
    assert all(error <= 1e-12 for errors in results for error in errors.values()), results
