"""The drop-in under DeepSpeed on 2 gloo processes: with every expert on every process (Tutel's `group` a group of
one rank) it trains under ZeRO-1 and ZeRO-3 with the losses of one process taking SGD steps on both ranks' batches;
expert parallel (Tutel's default: count_per_node experts on each process) it is refused by name, as DeepSpeed would
take its experts for replicated weights."""
import pytest
import torch

pytest.importorskip("deepspeed")
from helpers.launch import run_workers  # noqa: E402

D, T, STEPS, LR = 8, 12, 3, 0.2


def model(group=None):
    from moe_plugin import tutel as tutel_moe
    torch.manual_seed(0)
    layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=D,
                                experts={"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 16,
                                         "activation_fn": torch.relu}, group=group)
    return torch.nn.Sequential(torch.nn.Linear(D, D), layer, torch.nn.Linear(D, D))


def batch(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, T // 2, D, generator=generator), torch.randn(2, T // 2, D, generator=generator)


def loss_of(net, x, y):
    """MSE plus the drop-in's balance loss (Tutel's layer.l_aux); net: the model, or DeepSpeed's engine holding it."""
    model = getattr(net, "module", net)
    return torch.nn.functional.mse_loss(net(x), y) + model[1].l_aux


def worker(rank, world):
    from helpers.deepspeed import setup_worker
    setup_worker(rank, world)
    import torch.distributed as dist

    import moe_plugin.integrations.deepspeed as dsi
    alone = [dist.new_group([r]) for r in range(world)][rank]       # every rank takes part in making each group
    report = {}
    for stage in (1, 3):
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True}
        if stage == 3:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0    # every parameter partitioned
        engine = dsi.initialize(model=model(alone), config=config)[0]
        losses = []
        for step in range(STEPS):
            loss = loss_of(engine, *batch(step, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        report[stage] = losses
    try:
        dsi.initialize(model=model(), config={"train_micro_batch_size_per_gpu": 2,
                                                      "optimizer": {"type": "SGD", "params": {"lr": LR}}})
        report["expert parallel"] = "engine"
    except ValueError as error:
        report["expert parallel"] = str(error)
    return report


@pytest.mark.timeout(600)
def test_drop_in_under_zero_1_and_3_trains_as_one_process():
    net = model()
    want = {rank: [] for rank in range(2)}
    for step in range(STEPS):
        losses = [loss_of(net, *batch(step, rank)) for rank in range(2)]
        for rank, loss in enumerate(losses):
            want[rank].append(loss.item())
        net.zero_grad()
        (sum(losses) / 2).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= LR * p.grad
    assert want[0][0] != want[0][-1]     # the steps move the losses: the comparison could fail
    for rank, report in enumerate(run_workers(worker, 2, timeout=500)):
        for stage in (1, 3):
            assert report[stage] == pytest.approx(want[rank], rel=1e-5, abs=1e-6), (stage, report[stage], want[rank])
        assert "ep_size=2" in report["expert parallel"] and "MoELayer" in report["expert parallel"], report
