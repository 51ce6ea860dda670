"""One rank of a world that does not exist: torch.distributed's fake process group (every collective returns at
once, moving nothing), so that the real model code builds its groups, expert shards and FSDP2 shards for rank
`rank` of `world_size` in this one process."""
from __future__ import annotations

import contextlib
import os

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, node_size: int):
    """torch.distributed initialized as rank `rank` of `world_size` (node_size ranks per node, as LOCAL_WORLD_SIZE
    tells the layers) for the duration of the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers the "fake" backend
    if dist.is_initialized():
        raise ValueError("moe-plugin plan runs in a process without torch.distributed (it starts a fake world of "
                         "its own); run it outside torchrun")
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(node_size)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
