"""`moe-plugin train` in this process at a tiny size, shared by the training tests."""
import json
from pathlib import Path

from moe_plugin import train

ROOT = Path(__file__).resolve().parents[2]     # the repository
TINY = ["model.dim=32", "model.layers=2", "model.heads=2", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.hidden_size=48", "moe.num_experts=4", "train.batch_size=4", "train.eval_batches=2",
        "train.warmup_steps=2", "log.progress=false"]


def run(tmp_path, *overrides, name="run"):
    cfg = train.load_config(None, [f"log.out_dir={tmp_path / name}", *overrides])
    result = train.train(cfg)
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, records
