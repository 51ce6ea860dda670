"""`moe-plugin train` in this process at a tiny size, shared by the training tests."""
import json
from pathlib import Path

from moe_plugin import train

ROOT = Path(__file__).resolve().parents[2]     # the repository
TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.hidden_size=48", "moe.num_experts=4", "train.batch_size=4", "train.eval_batches=2",
        "train.warmup_steps=2", "log.progress=false"]


def run(tmp_path, *overrides, name="run", config=None):
    """`moe-plugin train [config] overrides` writing to tmp_path/name: (result, the metrics.jsonl records)."""
    return run_in(tmp_path / name, *overrides, config=config)


def run_in(out: Path, *overrides, config=None):
    """`moe-plugin train [config] overrides` writing to out: (result, the metrics.jsonl records)."""
    result = train.train(train.load_config(None if config is None else str(config), [f"log.out_dir={out}", *overrides]))
    return result, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
