"""The `moe-plugin` command (main.py: train, checkpoint, plan, bench, info; bench.py: `moe-plugin bench`)."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
