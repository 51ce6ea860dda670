"""`moe-plugin checkpoint routing CKPT [--data FILE ...] [--ep-size N]` (issues 44, 55): run a checkpoint (a `moe-plugin train` run's
out_dir or checkpoint folder, or a Hugging Face folder of an MoE model) over sample data and write, per MoE layer,
what its router does: load.png (each expert's share of the choices), coselection.png (how often two experts are
chosen by the same token), topics.png (each topic's share per expert), summary.txt, routing.json (the numbers) and
report.html (all of them on one page).

Topics: each --data file is one (its name; its bytes are the tokens of a byte-level model, or the folder's tokenizer
reads its text); without --data, the synthetic corpus's topics of a run trained on it. Routing is the model's in
evaluation mode (no router noise): each token's top-k choice, recomputed from the router's input.

Per layer it also gives the load per expert-parallel rank at --ep-size N (default: the run's parallel.ep_size, 1 for
a Hugging Face folder): rows_per_rank and max_rank_load, the busiest rank's routed rows over the mean rank's
(metrics.rank_rows: experts held in consecutive blocks, or sliced over ranks).
"""
from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

from .. import checkpoint as sharded
from ..layer import MoELayer
from .metrics import max_rank_load, rank_rows, rank_shares
from ..parallel.groups import ExpertLayout
from ..train import plots
from ..train.checkpoint import checkpoints, read_meta, verify
from ..train.config import ExperimentConfig
from ..train.data import make_text_data
from ..train.hf_model import hf_adapter
from ..train.parts import build_model

MAX_TOKENS_PER_TOPIC = 4096
HF_ROW = 256              # tokens per row through a Hugging Face model


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a run's out_dir (its newest checkpoint), a checkpoint folder, or a "
                        "Hugging Face folder (config.json) of an MoE model")
    parser.add_argument("--data", nargs="+", default=None, metavar="FILE",
                        help="text files, one topic each (default: the synthetic corpus's topics of the run)")
    parser.add_argument("--out", default=None, help="the report's folder (default: routing_report/ in the "
                        "checkpoint's folder)")
    parser.add_argument("--ep-size", type=int, default=None, metavar="N",
                        help="the expert-parallel size whose per-rank load to report (default: the run's "
                        "parallel.ep_size; 1 for a Hugging Face folder)")


def main(args) -> int:
    try:
        where = Path(args.checkpoint)
        if not where.exists():
            raise ValueError(f"{str(where)!r} does not exist")
        out = Path(args.out) if args.out else (where if where.is_dir() else where.parent) / "routing_report"
        model, topics = load(where, args.data)
        routing = route(model, topics)
        add_rank_load(routing, args.ep_size if args.ep_size is not None else run_ep_size(where))
        write_report(routing, out)
    except ValueError as error:
        print(f"moe-plugin checkpoint routing: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}: report.html, load.png, coselection.png, topics.png, summary.txt, routing.json")
    return 0


def load(where: Path, data) -> tuple:
    """(model in eval mode, {topic: token ids [1, N]})."""
    if (where / "config.json").is_file():
        return _load_hf(where, data)
    return _load_run(where, data)


def _load_run(where: Path, data) -> tuple:
    from omegaconf import OmegaConf
    path = where
    if (where / "checkpoints").is_dir() and checkpoints(where):
        path = checkpoints(where)[-1]
    meta = read_meta(path)
    problem = verify(path)
    if problem is not None:
        raise ValueError(f"{str(path)!r} is damaged: {problem}")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ExperimentConfig), meta["config"]))
    if cfg.data.task != "lm":
        raise ValueError(f"{str(where)!r} is a run of data.task={cfg.data.task!r}: the routing report reads "
                         f"language models (data.task 'lm')")
    cfg.parallel.ep_size, cfg.parallel.fsdp = 1, False    # one process holding every expert
    model = build_model(cfg)
    state = sharded.full_state(path)
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    if data:
        topics = _read_topics(data, lambda text: list(text))
    elif cfg.data.path is None:
        synthetic = make_text_data(cfg.data, 1, cfg.model.seq_len, 1).topics
        topics = {name: x_BS.reshape(1, -1) for name, x_BS in synthetic.items()}
    else:
        raise ValueError(f"{str(where)!r} was trained on {cfg.data.path!r}, which has no topics: give --data FILE ...")
    return model.eval(), {name: _rows(ids, cfg.model.seq_len) for name, ids in topics.items()}


def _load_hf(where: Path, data) -> tuple:
    import transformers
    hf_moe = hf_adapter()
    if not data:
        raise ValueError(f"{str(where)!r} is a Hugging Face folder: give its sample data with --data FILE ...")
    model = transformers.AutoModelForCausalLM.from_pretrained(where)
    hf_moe.swap_moe_blocks(model)
    if any((where / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(where)
        encode = lambda text: tokenizer(text.decode("utf-8", errors="replace"))["input_ids"]   # noqa: E731
    elif model.config.vocab_size >= 256:
        encode = list        # a byte-level model (moe-plugin train's hf_model/)
    else:
        raise ValueError(f"{str(where)!r} has no tokenizer and a vocabulary of {model.config.vocab_size} "
                         f"(< 256 bytes): add its tokenizer files to the folder")
    return _HFLogits(model).eval(), {name: _rows(ids, HF_ROW) for name, ids in _read_topics(data, encode).items()}


def _rows(ids: torch.Tensor, length: int) -> torch.Tensor:
    """A topic's token ids as rows of `length` (the tail that does not fill a row left out; one shorter row when
    there are fewer)."""
    ids_N = ids.reshape(-1)
    if ids_N.numel() < length:
        return ids_N.reshape(1, -1)
    return ids_N[:ids_N.numel() // length * length].reshape(-1, length)


class _HFLogits(nn.Module):
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, x_BS: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x_BS, use_cache=False).logits


def _read_topics(files: List[str], encode) -> Dict[str, torch.Tensor]:
    topics = {}
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"--data {file!r} is not a file")
        ids = encode(path.read_bytes())[:MAX_TOKENS_PER_TOPIC]
        if not ids:
            raise ValueError(f"--data {file!r} is empty")
        topics[path.stem] = torch.tensor(ids, dtype=torch.long).reshape(1, -1)
    return topics


@torch.no_grad()
def route(model: nn.Module, topics: Dict[str, torch.Tensor]) -> dict:
    """{"layers": {name: {"experts", "top_k", "load": [E], "coselection": [E][E], "topics": {topic: [E]}}}}: the
    choices of every token of every topic, from each MoE layer's router (eval mode) on the input it got."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    if not layers:
        raise ValueError("the model has no MoE layer (moe_plugin.MoELayer) to report on")
    result = {name: {"experts": m.config.num_experts, "top_k": m.config.top_k,
                     "load": [0] * m.config.num_experts,
                     "coselection": [[0] * m.config.num_experts for _ in range(m.config.num_experts)],
                     "topics": {}} for name, m in layers.items()}
    current = {}

    def hook(name):
        def record(layer, args, kwargs):
            x = args[0] if args else kwargs["x"]
            routed = kwargs.get("router_input")
            x_TD = (x if routed is None else routed).reshape(-1, layer.config.model_dim)
            expert_TK = layer.router(x_TD).expert_TK
            E = layer.config.num_experts
            load_E = torch.bincount(expert_TK.reshape(-1), minlength=E)
            chosen_TE = torch.zeros(x_TD.shape[0], E).scatter_(1, expert_TK, 1.0)
            current[name] = (load_E + current[name][0], chosen_TE.T @ chosen_TE + current[name][1]) \
                if name in current else (load_E, chosen_TE.T @ chosen_TE)
        return record
    handles = [layer.register_forward_pre_hook(hook(name), with_kwargs=True) for name, layer in layers.items()]
    try:
        for topic, ids_BS in topics.items():
            current.clear()
            model(ids_BS)
            for name, (load_E, both_EE) in current.items():
                entry = result[name]
                entry["topics"][topic] = load_E.tolist()
                entry["load"] = [a + b for a, b in zip(entry["load"], load_E.tolist())]
                entry["coselection"] = [[a + int(b) for a, b in zip(row, new)]
                                        for row, new in zip(entry["coselection"], both_EE.tolist())]
    finally:
        for handle in handles:
            handle.remove()
    return {"layers": result}


def run_ep_size(where: Path) -> int:
    """The ep_size the run at `where` trained with (1 for a Hugging Face folder)."""
    if (where / "config.json").is_file():
        return 1
    path = checkpoints(where)[-1] if (where / "checkpoints").is_dir() and checkpoints(where) else where
    return int(read_meta(path)["config"].get("parallel", {}).get("ep_size", 1))


def add_rank_load(routing: dict, ep_size: int) -> None:
    """Each layer's ep_size, rows_per_rank and max_rank_load at ep_size, into routing. ValueError naming --ep-size
    when it cannot hold a layer's experts."""
    for name, layer in routing["layers"].items():
        E = layer["experts"]
        if not isinstance(ep_size, int) or ep_size < 1 or (E % ep_size and ep_size % E):
            raise ValueError(f"--ep-size {ep_size} cannot hold MoE layer {name}'s {E} experts: it must divide "
                             f"{E} or be a multiple of it")
        rows = rank_rows(layer["load"], rank_shares(ExpertLayout(E, ep_size, ep_size, 0)))   # (any hidden it holds)
        layer.update(ep_size=ep_size, rows_per_rank=rows, max_rank_load=max_rank_load(rows))


def summary(routing: dict) -> str:
    lines = []
    for name, layer in routing["layers"].items():
        load, E = layer["load"], layer["experts"]
        mean = sum(load) / E
        empty = [e for e, n in enumerate(load) if n == 0]
        lines.append(f"MoE layer {name}: {sum(load) // layer['top_k']:,} tokens, top-{layer['top_k']} of {E} experts; "
                     f"busiest expert {max(range(E), key=load.__getitem__)} at {max(load) / mean:.2f}x the mean, "
                     f"quietest {min(range(E), key=load.__getitem__)} at {min(load) / mean:.2f}x; "
                     f"experts without tokens: {', '.join(map(str, empty)) or 'none'}")
        if "ep_size" in layer:
            rows = layer["rows_per_rank"]
            lines.append(f"  at ep_size {layer['ep_size']}: busiest rank {max(range(len(rows)), key=rows.__getitem__)} "
                         f"computes {layer['max_rank_load']:.2f}x the mean rank's routed rows")
        both = layer["coselection"]
        pairs = [(both[e][f], e, f) for e in range(E) for f in range(e + 1, E)]
        if pairs and max(pairs)[0] > 0:
            count, e, f = max(pairs)
            lines.append(f"  most often chosen together: experts {e} and {f} ({count:,} tokens)")
        for topic, topic_load in layer["topics"].items():
            shares = sorted(range(E), key=lambda e: -topic_load[e])[:3]
            total = max(1, sum(topic_load))
            lines.append(f"  {topic}: mostly experts " +
                         ", ".join(f"{e} ({100 * topic_load[e] / total:.0f}%)" for e in shares))
    return "\n".join(lines) + "\n"


def write_report(routing: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(routing, indent=1) + "\n")
    text = summary(routing)
    (out / "summary.txt").write_text(text)
    layers = routing["layers"]
    figure = plots._figure(5 * len(layers), 3.2)
    for ax, (name, layer) in zip(figure.subplots(1, len(layers), squeeze=False)[0], layers.items()):
        total = max(1, sum(layer["load"]))
        ax.bar(range(layer["experts"]), [100 * n / total for n in layer["load"]])
        ax.axhline(100 / layer["experts"], color="0.5", linestyle=":", label="balanced")
        ax.set(title=f"{name}: share of choices (%)", xlabel="expert")
        ax.legend()
    figure.savefig(out / "load.png")
    figure = plots._figure(5 * len(layers), 4.2)
    for ax, (name, layer) in zip(figure.subplots(1, len(layers), squeeze=False)[0], layers.items()):
        E = layer["experts"]
        pairs_EE = [[float("nan") if e == f else n for f, n in enumerate(row)] for e, row in enumerate(
            layer["coselection"])]          # the diagonal (each expert's own load) is load.png's
        image = ax.imshow(pairs_EE, cmap="magma", aspect="auto")
        ticks = range(0, E, max(1, E // 16))
        ax.set(title=f"{name}: tokens choosing both experts", xlabel="expert", ylabel="expert", xticks=ticks,
               yticks=ticks)
        figure.colorbar(image, ax=ax)
    figure.savefig(out / "coselection.png")
    figure = plots._figure(5 * len(layers), 1.2 + 0.4 * len(next(iter(layers.values()))["topics"]))
    for ax, (name, layer) in zip(figure.subplots(1, len(layers), squeeze=False)[0], layers.items()):
        topics = layer["topics"]
        shares = [[100 * n / max(1, sum(load)) for n in load] for load in topics.values()]
        image = ax.imshow(shares, cmap="Blues", vmin=0, aspect="auto")
        ax.set(title=f"{name}: each topic's share per expert (%)", xlabel="expert", yticks=range(len(topics)),
               yticklabels=list(topics))
        figure.colorbar(image, ax=ax)
    figure.savefig(out / "topics.png")
    (out / "report.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>moe_plugin routing report</title></head><body>\n"
        "<h1>Routing report</h1>\n<pre>" + html.escape(text) + "</pre>\n" +
        "".join(f"<h2>{title}</h2><img src='{file}' alt='{title}' style='max-width:100%'>\n" for title, file in
                (("Load per expert", "load.png"), ("Experts chosen together", "coselection.png"),
                 ("Topics per expert", "topics.png"))) + "</body></html>\n")
