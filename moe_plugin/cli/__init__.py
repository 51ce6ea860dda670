"""The `moe-plugin` command (main.py: train, checkpoint, plan, bench, info; bench.py: `moe-plugin bench`, with
deepspeed_moe.py: DeepSpeed's MoE layer built as the peer it times)."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
