"""Records the ops that synchronize with the host (on a GPU) while a block of code runs."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read device memory on the host (or size their output by it): a host synchronization on a GPU
HOST_SYNCING_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                    torch.ops.aten.item.default, torch.ops.aten.masked_select.default,
                    torch.ops.aten.bincount.default, torch.ops.aten.repeat_interleave.Tensor,
                    torch.ops.aten._unique2.default)


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs() as record:` ... then record.seen names every host-syncing op that ran."""

    def __init__(self, ops=HOST_SYNCING_OPS):
        super().__init__()
        self.ops, self.seen = set(ops), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
