"""The layers, micro-batches and one-process reference of the global balance loss's tests (aux_loss_scope
"global", counts over an optimizer step's micro-batches after moe_plugin.begin_step): on CPU
(tests/parallel/test_global_balance_loss.py) and on CUDA (test_global_balance_loss_cuda.py)."""
import torch

from moe_plugin import MoEConfig, MoELayer

D, H = 6, 8


def build(spec, dtype, **more):
    config = dict(model_dim=D, hidden_size=H, num_experts=spec["E"], top_k=spec["k"], capacity_factor=0.0,
                  aux_loss=spec["aux"], aux_loss_coef=0.3, **more)
    return MoELayer(MoEConfig(**config)).to(dtype)


def spanning_reference(layer, xs, ups, world=1):
    """One process on every process's tokens, by hand: each micro-batch's output term from layer (aux_loss_scope
    "local", its own balance loss unused) and, as the balance loss of micro-batch i, E * sum_e(the mean router
    probability of e over micro-batch i's tokens * the fraction of the choices of micro-batches 1..i routed to
    e). Returns the router's gradient, each micro-batch's input gradient and balance loss (with its coefficient)."""
    cfg = layer.config
    weight_ED = layer.router.weight_ED
    chosen, losses, total, inputs = [], [], 0.0, []
    for x, up in zip(xs, ups):
        x = x.clone().requires_grad_()
        inputs.append(x)
        probs_TE = torch.softmax(x.reshape(-1, D) @ weight_ED.t(), dim=-1)
        counted_TX = probs_TE.topk(cfg.top_k).indices[:, :1 if cfg.aux_loss == "gshard" else cfg.top_k]
        chosen.append(counted_TX)
        choices_E = torch.nn.functional.one_hot(torch.cat(chosen).reshape(-1), cfg.num_experts).sum(0)
        fraction_E = choices_E.to(probs_TE.dtype) / choices_E.sum()
        mean_E = probs_TE.sum(0) / max(len(probs_TE), 1)       # an empty micro-batch adds no term
        losses.append(cfg.aux_loss_coef * cfg.num_experts * (mean_E * fraction_E).sum())
        total = total + (layer(x) * up).sum() / world + losses[-1]
    total.backward()
    return weight_ED.grad, [x.grad for x in inputs], torch.stack(losses).detach()


def spanning_run(layer, xs, ups, checkpointed=False):
    """begin_step, then each micro-batch's forward and backward (the gradients accumulate): the router's
    gradient, each micro-batch's input gradient and balance loss."""
    from torch.utils.checkpoint import checkpoint
    from moe_plugin import begin_step
    assert begin_step(layer) == 1
    grads, losses = [], []
    for x, up in zip(xs, ups):
        x = x.clone().requires_grad_()
        y = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        losses.append(layer.aux_loss.detach().clone())
        ((y * up).sum() + layer.aux_loss).backward()
        grads.append(x.grad)
    return layer.router.weight_ED.grad.clone(), grads, torch.stack(losses)


def micro_batches(sizes, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, D, generator=generator, dtype=dtype) for n in sizes]
    return xs, [torch.randn(x.shape, generator=generator, dtype=dtype) for x in xs]


def one_f_one_b_run(layer, xs, ups, checkpointing="non-reentrant"):
    """begin_step, then the micro-batches in a pipeline's 1F1B order under activation checkpointing (forward 1,
    forward 2, backward 1, forward 3, backward 2, ..., the last backward): each recompute runs after a later
    micro-batch's forward. checkpointing: torch's "non-reentrant" or "reentrant", or "deepspeed" (what a
    PipelineModule's activation_checkpoint_interval runs). The aux loss is an output of the checkpointed part
    (reentrant checkpointing runs its forward without grad). Returns what spanning_run does."""
    from moe_plugin import begin_step
    if checkpointing == "deepspeed":
        from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint
    else:
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        def checkpoint(function, x):
            return torch_checkpoint(function, x, use_reentrant=checkpointing == "reentrant")
    assert begin_step(layer) == 1
    inputs, pending, losses = [x.clone().requires_grad_() for x in xs], [], []

    def forward(i):
        y, aux = checkpoint(lambda x: (layer(x), layer.aux_loss), inputs[i])
        losses.append(aux.detach().clone())
        pending.append((y * ups[i]).sum() + aux)

    forward(0)
    for i in range(1, len(xs)):
        forward(i)
        pending.pop(0).backward()
    pending.pop(0).backward()
    return layer.router.weight_ED.grad.clone(), [x.grad for x in inputs], torch.stack(losses)
