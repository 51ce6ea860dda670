"""Random routes for the kernels' direct tests."""
import torch


def random_slots(T, E, K, capacity):
    """Routes for the slot kernels: distinct experts per token (as top-k gives), each expert's first
    row when the kept rows are packed by expert, and the number of kept rows."""
    expert_TK = torch.rand(T, E).topk(K, dim=1).indices
    kept_E = torch.bincount(expert_TK.reshape(-1), minlength=E).clamp(max=capacity)
    return expert_TK, kept_E.cumsum(0) - kept_E, int(kept_E.sum())
