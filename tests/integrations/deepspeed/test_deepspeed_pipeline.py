"""Pipeline parallelism: a deepspeed.pipe.PipelineModule whose stages hold MoE layers trains with "moe": {"backend":
"tutel"} on 4 gloo ranks (2 stages x 2 data-parallel ranks, ep_size 2 inside each stage's data-parallel group),
with the losses of the same layers without pipelining (one process), the aux loss included.

What this module tests (moved here from the README):

Tested (tests/integrations/deepspeed/test_deepspeed_pipeline.py): 4 gloo ranks = 2 stages x 2 data-parallel ranks,
ep_size 2 in each stage, ZeRO-1, 2 micro-batches per step, dropless top-2 of 4 experts: every rank reports the
losses of the same layers in an `nn.Sequential` trained in one process on both data-parallel ranks'
micro-batches (rtol 1e-5, aux loss included; without the aux term they differ). DeepSpeed refuses pipeline
parallelism with ZeRO-2/3 itself.
"""

import pytest
import torch

pytest.importorskip("deepspeed")
from helpers.launch import run_workers  # noqa: E402
from helpers.paths import load_script  # noqa: E402

SECTION = {"backend": "tutel", "num_experts": 4, "ep_size": 2, "top_k": 2, "drop_tokens": False}
MICRO, ACCUMULATION, STEPS, LR = 4, 2, 4, 1e-2
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
          "gradient_clipping": 0.0, "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True,
                                                                              "weight_decay": 0.0}},
          "zero_optimization": {"stage": 1}, "moe": SECTION}


def pipeline_worker(rank, world):
    from deepspeed.utils import groups
    from helpers.deepspeed import setup_worker

    example = load_script("examples/deepspeed/pipeline_moe.py")
    from moe_plugin.integrations.deepspeed import MoE, initialize
    setup_worker(rank, world)
    torch.manual_seed(0)
    model = example.pipeline(SECTION, stages=2)
    engine, _, _, _ = initialize(model=model, config=CONFIG, model_parameters=model.parameters())
    dp_rank = engine.grid.get_data_parallel_rank()
    generator = torch.Generator().manual_seed(100 + dp_rank)
    batches = [[example.batch(generator, MICRO) for _ in range(ACCUMULATION)] for _ in range(STEPS)]
    losses = [engine.train_batch(iter(step)).item() for step in batches]
    layers = [m for m in engine.module.modules() if isinstance(m, MoE)]
    # lists: tensors would travel through shared memory that dies with this process
    return {"losses": losses, "batches": [[[t.tolist() for t in micro] for micro in step] for step in batches],
            "dp_rank": dp_rank, "stage": engine.stage_id,
            "moe_layers": len(layers), "local_experts": sorted({m.num_local_experts for m in layers}),
            "ep_group": sorted(torch.distributed.get_process_group_ranks(layers[0].deepspeed_moe.groups.ep_group)),
            "expert_data_group": sorted(groups._get_expert_data_parallel_group_ranks("ep_size_2"))}


def one_process(batches_by_dp, aux_coef):
    """The same layers in an nn.Sequential (ep_size 1, moe_plugin's layer), torch Adam on every data-parallel
    rank's micro-batches: the mean of their losses (cross entropy + aux_coef x the balance losses), step by step."""
    example = load_script("examples/deepspeed/pipeline_moe.py")
    from moe_plugin.integrations.deepspeed import swap_moe_layers
    torch.manual_seed(0)
    section = {k: v for k, v in SECTION.items() if k != "ep_size"}
    model = torch.nn.Sequential(*[cls(*args) for cls, args in example.layers({**section, "ep_size": 1})])
    model, _ = swap_moe_layers(model, section)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in zip(*batches_by_dp):
        chunks = [chunk for micro in step for chunk in micro]
        total = 0.0
        for tokens, labels in map(lambda pair: map(torch.tensor, pair), chunks):
            logits, aux = model(tokens)
            loss = (example.lm_loss((logits, 0 * aux), labels) + aux_coef * aux.sum()) / len(chunks)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.slow
def test_a_pipeline_with_moe_stages_equals_the_layers_without_pipelining():
    """2 stages x 2 data-parallel ranks, ep_size 2 inside each stage, ZeRO-1, 2 micro-batches per step: every rank
    reports the one-process losses of the same layers on both data-parallel ranks' micro-batches, aux loss
    included (without it the losses differ); each stage's experts are exchanged and reduced inside the stage."""
    example = load_script("examples/deepspeed/pipeline_moe.py")
    results = run_workers(pipeline_worker, 4, timeout=600)
    for result in results:
        stage_ranks = [2 * result["stage"], 2 * result["stage"] + 1]
        assert result["moe_layers"] == 1 and result["local_experts"] == [2], result
        assert result["ep_group"] == stage_ranks, result
        assert result["expert_data_group"] == [stage_ranks[result["dp_rank"]]], result
    by_dp = {r["dp_rank"]: r["batches"] for r in results if r["stage"] == 0}
    batches = [by_dp[0], by_dp[1]]
    reference = torch.tensor(one_process(batches, example.AUX_COEF))
    without_aux = torch.tensor(one_process(batches, 0.0))
    assert not torch.allclose(reference, without_aux, rtol=1e-4)
    for result in results:
        assert torch.allclose(torch.tensor(result["losses"]), reference, rtol=1e-5), (result["losses"], reference)


class DenseBlock(torch.nn.Module):
    """x + Linear(x): a dense block, as the first layers of DeepSeek-V3."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, inputs):
        x_BSD, aux_1 = inputs
        return x_BSD + self.linear(x_BSD), aux_1


def dense_stage_worker(rank, world):
    """2 stages: the embedding and a dense block on stage 0 (no MoE layer), the MoE block and the head on stage 1."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from helpers.deepspeed import setup_worker

    example = load_script("examples/deepspeed/pipeline_moe.py")
    from moe_plugin.integrations.deepspeed import initialize
    setup_worker(rank, world)
    section = {**SECTION, "ep_size": 1}
    embed, block, head = example.layers(section, blocks=1)
    specs = [LayerSpec(embed[0], *embed[1]), LayerSpec(DenseBlock, 32), LayerSpec(block[0], *block[1]),
             LayerSpec(head[0], *head[1])]
    model = PipelineModule(specs, num_stages=2, loss_fn=example.lm_loss, partition_method="uniform")
    try:
        initialize(model=model, config={**CONFIG, "moe": section}, model_parameters=model.parameters())
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_a_pipeline_stage_without_an_moe_layer_is_refused_on_every_stage():
    """Each MoE layer makes process groups that every process joins, so a stage without one would leave the others
    waiting forever (measured: the step hangs at ZeRO-1's grad norm, and at ZeRO 0 at the next group made): every
    stage stops at initialize with the same ValueError naming the stage and what to do."""
    errors = run_workers(dense_stage_worker, 2, timeout=300)
    assert errors[0] == errors[1] and errors[0] is not None, errors
    assert errors[0].startswith("pipeline stage(s) [0] of the PipelineModule hold no MoE layer"), errors[0]
    assert "partition_method=\"type:" in errors[0], errors[0]
