"""Sharded checkpoints of `moe-plugin train` resume on another number of processes and/or ep_size.

A run in one layout trains a few steps and saves; its whole state (every expert gathered by the
expert-parallel gather path, and AdamW's moments gathered alike) is the reference. A run in another
layout restores the checkpoint; on every rank each tensor of the model and of the optimizer must
equal the share of the reference that this rank holds (Experts.take_slice, the layer's own rule),
bit for bit, and the LR schedule, the steps and the data position must be where the rule puts them.
"""
import pytest
import torch

from helpers.launch import run_workers
from helpers.reshard import restore_and_compare, train_and_save

MOVES = {
    "2 processes ep 2 -> 1 process": ((2, ["parallel.ep_size=2"]), (1, [])),
    "1 process -> 2 processes ep 2": ((1, []), (2, ["parallel.ep_size=2"])),
    "4 processes ep 2 -> 2 processes ep 2": ((4, ["parallel.ep_size=2"]), (2, ["parallel.ep_size=2"])),
    "4 processes ep 4 -> 4 processes ep 2": ((4, ["parallel.ep_size=4"]), (4, ["parallel.ep_size=2"])),
    # hidden-sliced swiglu experts with biases (2 experts on 4 ranks: 2 slices each) -> whole experts, and back
    "sliced swiglu ep 4 -> 2 processes ep 2": ((4, ["parallel.ep_size=4", "moe.num_experts=2", "moe.top_k=1",
                                                    "moe.activation=swiglu", "moe.bias=true"]),
                                               (2, ["parallel.ep_size=2", "moe.num_experts=2", "moe.top_k=1",
                                                    "moe.activation=swiglu", "moe.bias=true"])),
    # a shared expert (replicated) and the auxiliary-loss-free router bias (a buffer, the same on every rank)
    "shared expert and router bias, 2 processes ep 2 -> 1 process": (
        (2, ["parallel.ep_size=2", "moe.shared_hidden_size=16", "moe.expert_bias_update_rate=0.01"]),
        (1, ["moe.shared_hidden_size=16", "moe.expert_bias_update_rate=0.01"])),
    "1 process -> sliced swiglu ep 4": ((1, ["moe.num_experts=2", "moe.top_k=1", "moe.activation=swiglu"]),
                                        (4, ["parallel.ep_size=4", "moe.num_experts=2", "moe.top_k=1",
                                             "moe.activation=swiglu"])),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("move", list(MOVES))
def test_resume_in_another_layout_restores_every_tensor_exactly(tmp_path, fresh_seed, move):
    (src_world, src), (dst_world, dst) = MOVES[move]
    seed = [f"train.seed={fresh_seed}", f"data.seed={fresh_seed}"]
    run_workers(train_and_save, src_world, [*src, *seed], str(tmp_path), 3, timeout=200)
    path, reference = tmp_path / "checkpoints" / "step_000003", tmp_path / "reference.pt"
    results = run_workers(restore_and_compare, dst_world, [*dst, *seed], str(path), str(reference), timeout=200)
    full = torch.load(reference, weights_only=True)
    for rank, result in enumerate(results):
        assert result["errors"] == [], (rank, result["errors"])
        assert result["step"] == 3 and result["lr"] == full["lr"]
        assert result["data_ok"], rank
        assert result["window_steps"] == 0
        assert result["checked"] > 10
    if "router bias" in move:
        bias = [v for k, v in full["model"].items() if k.endswith("router.expert_bias_E")]
        assert bias and all(float(b.abs().max()) > 0 for b in bias)   # it moved, and came back exactly
    if dst_world > 1:
        assert results[0]["experts_here"] >= 1   # the MoE layer really is expert-parallel after the move
