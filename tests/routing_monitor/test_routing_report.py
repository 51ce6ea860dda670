"""`moe-plugin checkpoint routing` (issue 44; moe_plugin/routing_monitor/report.py): on a run's checkpoint its topics'
tokens per expert equal what the run itself counted at its end (result.json's topic_routing, the layers' own stats),
and its whole co-selection matrix equals pairs counted by a plain loop over each token's top-k choice of the
checkpoint's routers on the same topics (tests/helpers/routing_reference.py); on a Hugging Face folder the load,
each topic's load and the co-selection matrix equal those counted from HF's own routers (router_logits of the
unswapped model); pictures, text and the HTML page are written; bad inputs are one-line errors with exit status 2."""
import json

import pytest
import torch

from helpers.routing_reference import coselection, layer_choices
from helpers.train import TINY, run
from moe_plugin.cli import main
from moe_plugin.routing_monitor import report as routing_report


def report(*argv):
    return main(["checkpoint", "routing", *map(str, argv)])


def test_report_of_a_run_equals_the_runs_own_routing(tmp_path, fresh_seed, capsys):
    result, _ = run(tmp_path, *TINY, "train.steps=3", "model.moe_every=1", "log.plots=false", "moe.top_k=2",
                    f"train.seed={fresh_seed}", f"data.seed={fresh_seed}")
    assert report(tmp_path / "run") == 0
    out = tmp_path / "run" / "routing_report"
    for name in ("report.html", "load.png", "coselection.png", "topics.png", "summary.txt", "routing.json"):
        assert (out / name).stat().st_size > 0, name
    page = (out / "report.html").read_text()
    assert all(f"src='{png}'" in page for png in ("load.png", "coselection.png", "topics.png"))
    routing = json.loads((out / "routing.json").read_text())["layers"]
    assert list(routing) == ["blocks.0.ffn", "blocks.1.ffn"]
    for index, layer in enumerate(routing.values()):
        assert {topic: loads[index] for topic, loads in result["topic_routing"].items()} == layer["topics"]
        assert layer["load"] == [sum(t[e] for t in layer["topics"].values()) for e in range(4)]
        both = layer["coselection"]
        for e in range(4):
            assert both[e][e] == layer["load"][e]
            assert sum(both[e]) - both[e][e] == (layer["top_k"] - 1) * layer["load"][e]
    # the checkpoint's routers on the run's topics (the report's loader: the topics' loads above equal the run's own)
    model, topics = routing_report.load(tmp_path / "run", None)
    choices = layer_choices(model, topics.values())
    assert list(choices) == list(routing)
    for name, layer in routing.items():
        load, both = coselection(torch.cat(choices[name]), 4)
        assert layer["load"] == load and layer["coselection"] == both, name
        assert any(both[e][f] for e in range(4) for f in range(4) if e != f)      # top-2: pairs to count
    assert "MoE layer blocks.1.ffn: 512 tokens, top-2 of 4 experts" in (out / "summary.txt").read_text()

    text = tmp_path / "notes.txt"
    text.write_text("routing report " * 40)
    assert report(tmp_path / "run", "--data", text, "--out", tmp_path / "rep") == 0
    layer = json.loads((tmp_path / "rep" / "routing.json").read_text())["layers"]["blocks.0.ffn"]
    assert list(layer["topics"]) == ["notes"] and sum(layer["load"]) == 2 * (600 // 32 * 32)


def test_report_of_a_hugging_face_folder_follows_hfs_routers(tmp_path):
    from helpers.hf import build_model
    model = build_model("mixtral", seed=torch.randint(1 << 30, ()).item(), vocab_size=256)
    model.save_pretrained(tmp_path / "hf")
    sizes = {"sample": 300, "other": 600}          # topics of one and two rows of 256 tokens
    for topic, size in sizes.items():
        (tmp_path / f"{topic}.txt").write_bytes(bytes(torch.randint(256, (size,)).tolist()))
    assert report(tmp_path / "hf", "--data", *(tmp_path / f"{topic}.txt" for topic in sizes)) == 0
    routing = json.loads((tmp_path / "hf" / "routing_report" / "routing.json").read_text())["layers"]
    k = model.config.num_experts_per_tok
    logits = {}                  # per topic: each layer's router logits [T, E] from HF's own (unswapped) model
    for topic, size in sizes.items():
        data = list((tmp_path / f"{topic}.txt").read_bytes())
        ids = torch.tensor(data[:size // 256 * 256]).reshape(-1, 256)
        with torch.no_grad():
            logits[topic] = model.eval()(input_ids=ids, output_router_logits=True).router_logits
    assert len(routing) == model.config.num_hidden_layers
    for index, (name, layer) in enumerate(routing.items()):
        E = layer["experts"]
        assert (layer["top_k"], list(layer["topics"])) == (k, list(sizes))
        load, both, ties = [0] * E, [[0] * E for _ in range(E)], 0
        for topic in sizes:
            logits_TE = logits[topic][index]
            topic_load, topic_both = coselection(logits_TE.topk(k, dim=-1).indices, E)
            topic_ties = near_ties(logits_TE, k)
            assert_counts(layer["topics"][topic], topic_load, topic_ties, (name, topic))
            load = [a + b for a, b in zip(load, topic_load)]
            both = [[a + b for a, b in zip(row, topic_row)] for row, topic_row in zip(both, topic_both)]
            ties += topic_ties
        assert_counts(layer["load"], load, ties, name)
        assert_counts(sum(layer["coselection"], []), sum(both, []), ties, name)


def near_ties(logits_TE, k, margin=1e-6):
    """The tokens whose k-th and (k+1)-th best logits are within margin: past the first layer the report's (swapped)
    model computes the router's input in another order than HF's, so such a token's choice may go either way (the
    second layer's logits differ by up to 6e-8 at this size; the logits' spread is about 0.12)."""
    if k >= logits_TE.shape[-1]:
        return 0
    top_TK = logits_TE.topk(k + 1, dim=-1).values
    return int((top_TK[:, k - 1] - top_TK[:, k] < margin).sum())


def assert_counts(got, want, ties, where):
    """Equal, but for at most one count per near-tied token in each entry (a token changing its choice moves each
    load and co-selection count by at most one); exactly equal where no token is near a tie."""
    assert len(got) == len(want) and all(abs(a - b) <= ties for a, b in zip(got, want)), (where, got, want, ties)
    assert sum(got) == sum(want), (where, got, want)


@pytest.mark.parametrize("argv, words", [
    (["{tmp}/missing"], "'{tmp}/missing' does not exist"),
    (["{tmp}"], "'{tmp}' is not a checkpoint of `moe-plugin train`: it has no meta.json"),
    (["{tmp}/hf"], "is a Hugging Face folder: give its sample data with --data FILE"),
])
def test_bad_inputs_are_one_line(tmp_path, capsys, argv, words):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert report(*[a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert words.format(tmp=tmp_path) in err and err.count("\n") == 1, err
