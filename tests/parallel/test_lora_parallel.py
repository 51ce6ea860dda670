"""LoRA on the experts under expert parallelism (2 gloo processes, each holding its own experts' adapters) against
one process holding every expert and adapter, fed every rank's tokens as micro-batches; full state dicts and sharded
checkpoints carry the adapters between 2 processes and 1."""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer
from moe_plugin.lora import add_lora

from helpers.compare import relative_error
from helpers.launch import run_workers

D, H, E = 6, 8, 4
FACTORS = ("up_a_EDQ", "up_b_EQF", "down_a_EHQ", "down_b_EQD")


def _adapted(config, seed):
    layer = MoELayer(config).double()
    (adapter,) = add_lora(layer, rank=2, alpha=3.0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in FACTORS:
            param = getattr(adapter, name)
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64))
    return layer, adapter


def compare_with_one_process(rank, world, specs):
    worst = {}
    for spec in specs:
        torch.manual_seed(spec["seed"])
        base = dict(model_dim=D, hidden_size=H, num_experts=E, top_k=2, capacity_factor=spec["cf"], min_capacity=0,
                    activation="swiglu", bias=spec["bias"])
        whole, whole_adapter = _adapted(MoEConfig(**base), spec["seed"])
        layer = MoELayer(MoEConfig(**base, ep_size=world, parallel=spec["r"], overlap_degree=spec["d"])).double()
        (adapter,) = add_lora(layer, rank=2, alpha=3.0)
        layer.load_full_state_dict(whole.state_dict())      # each rank keeps its experts' adapters
        first, count = layer.groups.layout.first_expert, layer.groups.layout.local_experts
        assert all(torch.equal(getattr(adapter, n), getattr(whole_adapter, n)[first:first + count]) for n in FACTORS)

        generator = torch.Generator().manual_seed(spec["seed"] + 1)
        xs = [torch.randn(n, D, generator=generator, dtype=torch.float64) for n in spec["tokens"]]
        ups = [torch.randn(n, D, generator=generator, dtype=torch.float64) for n in spec["tokens"]]
        total = {name: torch.zeros_like(getattr(whole_adapter, name)) for name in FACTORS}
        for i, (x, up) in enumerate(zip(xs, ups)):
            x = x.clone().requires_grad_()
            y = whole(x)
            grads = torch.autograd.grad((y * up).sum(), [x] + [getattr(whole_adapter, n) for n in FACTORS])
            for name, grad in zip(FACTORS, grads[1:]):
                total[name] += grad
            if i == rank:
                want_y, want_x = y.detach(), grads[0]

        x = xs[rank].clone().requires_grad_()
        y = layer(x)
        (y * ups[rank]).sum().backward()
        errors = {"y": relative_error(y.detach(), want_y), "x.grad": relative_error(x.grad, want_x)}
        for name in FACTORS:
            errors[name] = relative_error(getattr(adapter, name).grad, total[name][first:first + count])
        assert all(p.grad is None for n, p in layer.named_parameters() if n.startswith("experts.w"))
        worst[spec["name"]] = (max(errors.values()), max(errors, key=errors.get))
    return worst


@pytest.mark.slow
def test_lora_expert_parallel_equals_one_process():
    specs = [dict(name="dropless_r1", seed=11, cf=0.0, r=1, d=1, bias=False, tokens=[13, 7]),
             dict(name="dropping_r1_overlap2", seed=12, cf=0.5, r=1, d=2, bias=True, tokens=[9, 16]),
             dict(name="gathered_r0", seed=13, cf=0.0, r=0, d=1, bias=True, tokens=[10, 5]),
             dict(name="rank_without_tokens", seed=14, cf=0.0, r=1, d=1, bias=False, tokens=[12, 0])]
    for result in run_workers(compare_with_one_process, 2, specs, timeout=180):
        for name, (error, where) in result.items():
            assert error < 1e-10, f"{name}: {where} off by {error:.3g}"


def state_dicts_carry_adapters(rank, world, folder):
    """Loads one process's adapted layer at ep_size 2 (load_full_state_dict); full_state_dict and a sharded
    checkpoint of it must give that one process's adapters back (on rank 0; the gathers are collectives)."""
    from moe_plugin import checkpoint as sharded
    from moe_plugin.train.checkpoint import full_state_dict
    config = dict(model_dim=D, hidden_size=H, num_experts=E, top_k=2, activation="swiglu")
    whole, _ = _adapted(MoEConfig(**config), seed=21)
    layer = MoELayer(MoEConfig(**config, ep_size=world)).double()
    add_lora(layer, rank=2, alpha=3.0)
    layer.load_full_state_dict(whole.state_dict())
    full = full_state_dict(layer)
    sharded.save(sharded.sharded_state(layer), folder)
    torch.distributed.barrier()
    if rank:
        return None
    written = sharded.full_state(folder)
    expected = {k: v for k, v in whole.state_dict().items() if k.startswith("experts.lora.")}
    return {"full": all(torch.equal(full[k], v) for k, v in expected.items()),
            "sharded": all(torch.equal(written[f"model.{k}"], v) for k, v in expected.items()), "keys": len(expected)}


@pytest.mark.slow
def test_full_and_sharded_state_dicts_carry_lora_between_2_processes_and_1(tmp_path):
    result = run_workers(state_dicts_carry_adapters, 2, str(tmp_path), timeout=180)[0]
    assert result == {"full": True, "sharded": True, "keys": 4}, result


def test_loading_adapters_into_a_layer_without_one_is_an_error():
    whole, _ = _adapted(MoEConfig(model_dim=D, hidden_size=H, num_experts=E, top_k=2), seed=1)
    with pytest.raises(ValueError, match="call add_lora"):
        MoELayer(MoEConfig(model_dim=D, hidden_size=H, num_experts=E, top_k=2)).double().load_full_state_dict(
            whole.state_dict())


def _fsdp_lora_worker(rank, world, ep, steps=3, lr=0.3):
    """A TransformerLM with add_lora (everything else frozen) under fully_shard_moe at ep_size ep, trained with SGD on
    this rank's batches, against one process training the same adapters on the mean of every rank's loss: (worst
    relative loss error, worst adapter error after training, how far the adapters moved, the base experts' change)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from moe_plugin import aux_loss
    from moe_plugin.train.models import TransformerLM
    from moe_plugin.train.models.transformer import ModelConfig
    from moe_plugin.parallel import fully_shard_moe
    from moe_plugin.train.checkpoint import full_state_dict, load_full_state_dict
    V, B, S = 40, 3, 6

    def build(ep_size):
        torch.manual_seed(5)
        moe = MoEConfig(model_dim=8, hidden_size=10, num_experts=4, top_k=2, activation="swiglu", bias=True,
                        aux_loss_coef=0.01, ep_size=ep_size)
        model = TransformerLM(ModelConfig(dim=8, layers=2, heads=2, seq_len=S, ffn_hidden=12, moe_every=1), moe, V)
        model = model.double().requires_grad_(False)
        add_lora(model, rank=2, alpha=4.0)
        return model

    def loss_of(model, x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()) + aux_loss(model)

    reference = build(1)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    batches = [[(torch.randint(V, (B, S), generator=generator), torch.randint(V, (B, S), generator=generator))
                for _ in range(world)] for _ in range(steps)]

    model = build(ep)
    load_full_state_dict(model, initial)
    fully_shard_moe(model)
    ours = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    theirs = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=lr)
    errors = []
    for step in range(steps):
        want = [loss_of(reference, *batches[step][r]) for r in range(world)]
        theirs.zero_grad()
        (sum(want) / world).backward()
        theirs.step()
        loss = loss_of(model, *batches[step][rank])
        ours.zero_grad()
        loss.backward()
        ours.step()
        errors.append(abs(loss.item() - want[rank].item()) / abs(want[rank].item()))
    full = full_state_dict(model)
    final = reference.state_dict()
    adapters = [k for k in final if ".lora." in k]
    adapter_error = max(float((full[k] - final[k]).abs().max() / final[k].abs().max()) for k in adapters)
    moved = min(float((final[k] - initial[k]).abs().max()) for k in adapters)
    base_change = max(float((full[k] - initial[k]).abs().max()) for k in final if k not in adapters)
    dist.barrier()
    return max(errors), adapter_error, moved, base_change, len(adapters)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_lora_under_fully_shard_moe_equals_one_process(ep):
    for loss_error, adapter_error, moved, base_change, count in run_workers(_fsdp_lora_worker, 2, ep, timeout=240):
        assert count == 8 and moved > 1e-3, (count, moved)
        assert loss_error < 1e-10 and adapter_error < 1e-10, (loss_error, adapter_error)
        assert base_change == 0.0, base_change
