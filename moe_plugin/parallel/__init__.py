"""Expert parallelism: groups, all-to-all, expert gradients under DDP (ddp_moe), and FSDP2 sharding
(fully_shard_moe)."""
import importlib

# the wrappers import the layer, which imports this package's data-path modules (groups, all_to_all, tuner):
# they load on first use
_WRAPPERS = {"ddp_moe": ".ddp", "fully_shard_moe": ".fsdp"}
__all__ = list(_WRAPPERS)


def __getattr__(name: str):
    if name not in _WRAPPERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WRAPPERS[name], __name__), name)
