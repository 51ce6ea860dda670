"""The layer is compile-ready and sync-free: torch.compile(fullgraph=True) equals eager in training for
every capacity mode, the eager training forward+backward runs on meta tensors (which hold no data, so
any read back to the host fails), and the trainer's model compiles with no graph break in the layer."""
import pytest
import torch

from moe_plugin import MoEConfig, MoELayer, aux_loss
from helpers.compare import relative_error
from helpers.reference import outputs_and_grads

CAPACITY_MODES = {"fixed": 1.25, "fixed_dropping": 0.5, "dropless": 0.0, "capped": -0.5}
# the DeepSeek-style routing: sigmoid, groups, balancing bias, route scale, seq loss, gated shared expert
DEEPSEEK = dict(router="sigmoid", num_experts=8, top_k=2, num_groups=4, topk_groups=2, expert_bias_update_rate=1e-3,
                route_scale=2.5, aux_loss="seq", shared_hidden_size=24, shared_gate=True)
CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.mark.parametrize("mode", sorted(CAPACITY_MODES))
@pytest.mark.parametrize("options", [dict(activation="gelu"), dict(activation="swiglu", bias=False, top_k=3,
                                                                   batch_prioritized_routing=True), DEEPSEEK])
def test_training_forward_and_backward_read_nothing_back(mode, options):
    config = MoEConfig(model_dim=16, hidden_size=24, capacity_factor=CAPACITY_MODES[mode], z_loss_coef=0.01,
                       **{"top_k": 2, "num_experts": 5, **options})
    with torch.device("meta"):
        layer = MoELayer(config)
    x = torch.empty(3, 37, 16, device="meta", requires_grad=True)
    y = layer(x)
    (y.sum() + layer.aux_loss).backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert all(p.grad is not None and p.grad.shape == p.shape for p in layer.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", sorted(CAPACITY_MODES) + ["deepseek_routing"])
def test_fullgraph_compile_equals_eager_in_training(mode, device):
    torch._dynamo.reset()
    if mode == "deepseek_routing":
        config = MoEConfig(model_dim=16, hidden_size=20, capacity_factor=0.0, activation="swiglu", **DEEPSEEK)
    else:
        activation = {"fixed": "relu", "fixed_dropping": "gelu", "dropless": "swiglu", "capped": "silu"}[mode]
        config = MoEConfig(model_dim=16, hidden_size=20, num_experts=6, top_k=2, activation=activation,
                           capacity_factor=CAPACITY_MODES[mode], z_loss_coef=0.01, bias=mode != "dropless")
    layer = MoELayer(config).to(device)
    compiled = torch.compile(layer, fullgraph=True)
    for T in (41, 41):      # the second call runs the cached graph
        x = torch.randn(T, 16, device=device)
        y, aux, grads = outputs_and_grads(lambda x: (compiled(x), layer.aux_loss), layer, x)
        stats = layer.stats
        y_ref, aux_ref, grads_ref = outputs_and_grads(lambda x: (layer(x), layer.aux_loss), layer, x)
        assert stats == layer.stats, "compiled and eager route differently"
        assert relative_error(y, y_ref) <= 1e-5 and relative_error(aux, aux_ref) <= 1e-5
        for name in grads_ref:
            assert relative_error(grads[name], grads_ref[name]) <= 1e-5, name
    if mode == "fixed_dropping":
        assert stats["dropped_fraction"] > 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.set_sync_debug_mode)")
@pytest.mark.parametrize("mode", sorted(CAPACITY_MODES))
def test_cuda_training_step_never_synchronizes(mode):
    """Under bf16 autocast, as GPUs train (torch's own fp32 grouped_mm on CUDA reads its offsets back)."""
    layer = MoELayer(MoEConfig(model_dim=64, hidden_size=96, num_experts=8, top_k=2, activation="swiglu",
                               capacity_factor=CAPACITY_MODES[mode])).cuda()
    x = torch.randn(4, 50, 64, device="cuda", requires_grad=True)
    for check in (False, True):     # the first step builds the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            (y.float().sum() + layer.aux_loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum(layer.stats["tokens_per_expert"]) == 400      # read after the step


def test_trainer_model_compiles_with_no_graph_break_in_the_moe_layer():
    from moe_plugin.train.models import TransformerLM
    from moe_plugin.train import ExperimentConfig, moe_config

    torch._dynamo.reset()
    cfg = ExperimentConfig()
    model = TransformerLM(cfg.model, moe_config(cfg), 256)
    tokens = torch.randint(0, 256, (2, 32))

    def step(tokens):
        return model(tokens).float().logsumexp(-1).mean() + aux_loss(model)
    explanation = torch._dynamo.explain(step)(tokens)
    in_layer = [str(reason) for reason in explanation.break_reasons
                if any("moe_plugin/" in str(frame.filename) and "models/transformer.py" not in str(frame.filename)
                       for frame in reason.user_stack)]
    assert not in_layer, in_layer
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
