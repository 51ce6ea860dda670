"""Expert parallelism against one process: the part of a full expert tensor a rank owns, and one process's
gradients over every rank's tokens (shared by the expert-parallel tests and the spawned workers they run)."""
import torch

D, H = 6, 8     # model dim, hidden size


def expected_shard(full, name, layout, swiglu):
    """The part of a full-layer expert tensor a rank owns, written out independently of the layer."""
    first, count, S, s = layout.first_expert, layout.local_experts, layout.slices, layout.slice_index
    part = full[first:first + count]
    if S == 1 or name == "experts.b2_ED":
        return part if (S == 1 or s == 0) else torch.zeros_like(part)
    h = H // S
    if name == "experts.w2_EHD":
        return part[:, s * h:(s + 1) * h]
    if swiglu:
        return torch.cat([part[..., s * h:(s + 1) * h], part[..., H + s * h:H + (s + 1) * h]], dim=-1)
    return part[..., s * h:(s + 1) * h]


def single_process_grads(reference, xs, upstreams, rank):
    """One process on every rank's tokens as micro-batches: (parameter names, each parameter's gradient
    summed over the micro-batches, and rank's own micro-batch: y, x.grad, aux and parameter gradients)."""
    names = [n for n, _ in reference.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for i, (x, upstream) in enumerate(zip(xs, upstreams)):
        x = x.clone().requires_grad_()
        y = reference(x)
        grads = torch.autograd.grad((y * upstream).sum() + reference.aux_loss, [x] + list(reference.parameters()),
                                    allow_unused=True)
        for n, g in zip(names, grads[1:]):
            total[n] += 0 if g is None else g
        if i == rank:
            mine = {"y": y.detach(), "x.grad": grads[0], "aux": reference.aux_loss.detach(),
                    **dict(zip(names, grads[1:]))}
    return names, total, mine
