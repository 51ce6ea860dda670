"""Expert parallelism: groups, all-to-all, expert gradients under DDP (ddp_moe), and FSDP2 sharding
(fully_shard_moe)."""
from .ddp import ddp_moe
from .fsdp import fully_shard_moe

__all__ = ["ddp_moe", "fully_shard_moe"]
