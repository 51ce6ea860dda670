"""Expert parallelism: groups, all-to-all, expert gradients under DDP, and FSDP2 sharding (fully_shard_moe)."""
from .fsdp import fully_shard_moe

__all__ = ["fully_shard_moe"]
