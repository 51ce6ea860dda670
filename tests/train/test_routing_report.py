"""`moe-plugin checkpoint routing` (issue 44; moe_plugin/train/routing_report.py): on a run's checkpoint its topics'
tokens per expert equal what the run itself counted at its end (result.json's topic_routing, the layers' own stats);
co-selection holds each expert's load on its diagonal and (top_k - 1) times it off it; on a Hugging Face folder
the load equals the choices of HF's own routers (router_logits of the unswapped model); pictures, text and the
HTML page are written; bad inputs are one-line errors with exit status 2."""
import json

import pytest
import torch

from helpers.train import TINY, run
from moe_plugin.cli import main


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
    data = tmp_path / "sample.txt"
    data.write_bytes(bytes(torch.randint(256, (300,)).tolist()))
    assert report(tmp_path / "hf", "--data", data) == 0
    routing = json.loads((tmp_path / "hf" / "routing_report" / "routing.json").read_text())["layers"]
    ids = torch.tensor(list(data.read_bytes())[:256]).reshape(1, -1)      # one row of 256 tokens
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    for (name, layer), logits_TE in zip(routing.items(), logits):
        chosen = torch.bincount(logits_TE.topk(k, dim=-1).indices.reshape(-1), minlength=layer["experts"])
        assert layer["load"] == chosen.tolist(), name


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
