"""fairseq per-layer routing metrics (issue 44; integrations/fairseq_moe/criterions.py): moe_cross_entropy's logging
outputs, summed by fairseq's own aggregation (two ranks' outputs joined as fairseq gathers them, 2 updates of 2
micro-batches), give moe/<layer>/<metric> and moe/all equal to numbers recomputed from each layer's routing as each
forward ran (tests/helpers/routing_reference.py); a fairseq-train run logs them per layer in its log lines, the
summary's dropped fraction equal to the whole-model moe_dropped computed from the layers' stats."""
import copy
import json
import re
import types

import pytest
import torch

from helpers.fairseq import CPU, TINY_LM, fairseq, needs_fairseq, user_dir
from helpers.routing_reference import add, expected, record_forwards

pytestmark = needs_fairseq
VOCAB, D = 13, 16


def tiny_model():
    from fairseq.models import BaseFairseqModel

    from moe_plugin import MoELayer

    class Model(BaseFairseqModel):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, D)
            self.blocks = torch.nn.ModuleList([
                MoELayer(model_dim=D, hidden_size=24, num_experts=4, top_k=2, capacity_factor=1.0, z_loss_coef=0.01),
                MoELayer(model_dim=D, hidden_size=24, num_experts=4, top_k=1, capacity_factor=0.0, router="sigmoid",
                         expert_bias_update_rate=0.05)])
            self.out = torch.nn.Linear(D, VOCAB)

        def forward(self, src_tokens):
            h = self.embed(src_tokens)
            for block in self.blocks:
                h = h + block(h)
            return self.out(h), None

        def get_targets(self, sample, net_output):
            return sample["target"]

        def get_normalized_probs(self, net_output, log_probs, sample=None):
            return torch.log_softmax(net_output[0], -1) if log_probs else torch.softmax(net_output[0], -1)
    return Model()


def test_fairseq_aggregation_gives_each_layers_routing():
    from fairseq.logging import metrics

    from moe_plugin import MoELayer
    from moe_plugin.integrations.fairseq_moe.criterions import MoECrossEntropyCriterion
    torch.manual_seed(torch.randint(1 << 30, ()).item())
    ranks = [tiny_model()]
    ranks[0].blocks[1].router.expert_bias_E.copy_(torch.randn(4))      # a spread to read
    ranks.append(copy.deepcopy(ranks[0]))        # data parallel: the same weights, other data
    task = types.SimpleNamespace(target_dictionary=types.SimpleNamespace(pad=lambda: -100))   # no padding
    criteria = [MoECrossEntropyCriterion(task, False) for _ in ranks]
    forwards = {}          # both ranks' forwards: fairseq sums their logging outputs
    for model in ranks:
        record_forwards(model, forwards)
    with metrics.aggregate(new_root=True) as aggregate:
        for update in range(2):
            logs = []
            for model, criterion in zip(ranks, criteria):
                for micro in range(2):
                    tokens = torch.randint(VOCAB, (3, 5 + micro))
                    sample = {"net_input": {"src_tokens": tokens}, "target": tokens.roll(1, 1),
                              "ntokens": tokens.numel()}
                    loss, _, log = criterion(model, sample)
                    loss.backward()
                    logs.append(log)
            MoECrossEntropyCriterion.reduce_metrics(logs)
        values = aggregate.get_smoothed_values()
    want = {}
    for name, layer in ranks[0].named_modules():
        if isinstance(layer, MoELayer):
            sums = {}
            for one in forwards[name]:
                sums = add(sums, one)
            want[name] = expected(layer, sums)
            want[name].pop("tokens_per_expert")
            for key, value in want[name].items():
                assert values[f"moe/{name}/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key)
    assert set(want["blocks.0"]) == {"max_load", "experts_without_tokens", "dropped_fraction", "capacity_used",
                                     "router_entropy", "balance_loss", "z_loss"}
    assert "expert_bias_spread" in want["blocks.1"] and want["blocks.1"]["expert_bias_spread"] > 0
    assert values["moe/all/max_load"] == max(w["max_load"] for w in want.values())
    assert not any(key.startswith("_moe") for key in values)       # the sums stay hidden


@pytest.mark.timeout(600)
def test_fairseq_train_logs_each_layer(tmp_path, corpus):
    args = [corpus["lm"], "--user-dir", user_dir(), "--task", "language_modeling", *TINY_LM, "--criterion",
            "moe_cross_entropy", "--optimizer", "adam", "--lr", "0.005", "--dropout", "0", "--tokens-per-sample",
            "64", "--sample-break-mode", "complete", "--batch-size", "4", "--max-update", "4", "--update-freq", "2",
            "--save-dir", str(tmp_path / "ckpt"), "--no-save", *CPU, "--log-format", "json", "--log-interval", "2"]
    log = fairseq("train", args, cwd=str(tmp_path), timeout=500).stdout
    lines = [json.loads(line[line.index("{"):]) for line in log.splitlines() if "train_inner" in line and "{" in line]
    assert len(lines) == 2, log[-3000:]
    for line in lines:
        layers = sorted({m.group(1) for key in line for m in [re.match(r"moe/(.+)/max_load$", key)] if m})
        assert len(layers) == 3 and "all" in layers, layers          # 2 MoE layers and the summary
        assert float(line["moe/all/dropped_fraction"]) == pytest.approx(float(line["moe_dropped"]), abs=2e-4)
        for name in layers:
            assert 1.0 <= float(line[f"moe/{name}/max_load"]) <= 4.0
