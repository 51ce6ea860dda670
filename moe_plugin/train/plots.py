"""What a finished `moe-plugin train` run leaves for people: loss.png, expert_load.png, expert_load_heatmap.png
(and for an image classifier accuracy.png) and the summary text.

Records are the metrics.jsonl objects: {"step", "loss", "aux_loss", "dropped_fraction",
"tokens_per_s", "tokens_per_expert": [[per expert] per MoE layer], "val_loss" (at eval steps)}; an
image classifier's have "images_per_s" instead of "tokens_per_s", and "accuracy", "val_accuracy".
Routing maps each topic of the synthetic corpus (each class of an image data set) to its tokens per
expert in each MoE layer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

MAX_LABELLED_EXPERTS = 12


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def run_records(path: Optional[str]) -> List[dict]:
    """The metrics.jsonl records of the run a checkpoint path belongs to (its out_dir, a checkpoint folder in
    it, or its hf_model/ folder); [] when there is none."""
    if not path:
        return []
    folder = Path(path).resolve()
    for candidate in (folder, folder.parent, folder.parent.parent):
        metrics = candidate / "metrics.jsonl"
        if metrics.is_file():
            return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return []


def save_plots(records: List[dict], out_dir: Path, routing: Dict[str, List[List[int]]], task: str = "lm",
               before: Optional[List[dict]] = None) -> None:
    """loss.png: train and validation loss, dropped tokens. expert_load.png: per MoE layer, the share of
    tokens per expert over the steps, and (synthetic corpus, image classes) the share of each topic's
    tokens per expert. accuracy.png (an image classifier): train and validation accuracy.
    before: the records of the run this one continues (a dense run before upcycling), drawn in grey at
    steps <= 0 so the loss is seen continuing from it."""
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    image = task == "image"
    topic = "class" if image else "topic"

    figure = _figure(10, 3.6)
    loss_ax, drop_ax = figure.subplots(1, 2)
    if before:
        last = max(r["step"] for r in before)
        earlier = [r for r in before if "loss" in r]
        loss_ax.plot([r["step"] - last for r in earlier], [r["loss"] for r in earlier], color="0.6",
                     label="the run it continues (train)")
        loss_ax.axvline(0, color="0.6", linestyle=":")
    loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    loss_ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    loss_ax.set(title="cross-entropy loss (nats per image)" if image else "LM loss (nats per byte)", xlabel="step")
    loss_ax.legend()
    drop_ax.plot([r["step"] for r in train], [100 * r["dropped_fraction"] for r in train])
    drop_ax.set(title="dropped tokens (% of routed choices)", xlabel="step", ylim=(0, None))
    figure.savefig(out_dir / "loss.png")
    if image:
        figure = _figure(5, 3.6)
        ax = figure.subplots()
        ax.plot([r["step"] for r in train], [100 * r["accuracy"] for r in train], label="train")
        ax.plot([r["step"] for r in val], [100 * r["val_accuracy"] for r in val], "o-", label="validation")
        ax.set(title="accuracy (%)", xlabel="step", ylim=(0, 100))
        ax.legend()
        figure.savefig(out_dir / "accuracy.png")

    num_layers = len(train[0]["tokens_per_expert"]) if train else 0
    if not num_layers:
        return
    rows = 2 if routing else 1
    figure = _figure(5 * num_layers, 3.6 * rows)
    axes = figure.subplots(rows, num_layers, squeeze=False)
    steps = [r["step"] for r in train]
    for layer, ax in enumerate(axes[0]):
        loads = [r["tokens_per_expert"][layer] for r in train]
        shares_ES = [[_percent(load[e], load) for load in loads] for e in range(len(loads[0]))]
        ax.stackplot(steps, shares_ES, labels=[f"expert {e}" for e in range(len(shares_ES))])
        ax.set(title=f"MoE layer {layer + 1}: share of tokens per expert (%)", xlabel="step", ylim=(0, 100))
        ax.margins(x=0)
    many = len(train[0]["tokens_per_expert"][0]) > MAX_LABELLED_EXPERTS   # no legend or numbers: the colors say it
    if not many:
        axes[0][-1].legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize="small")
    for layer, ax in enumerate(axes[1] if routing else []):
        shares_TE = [[_percent(n, loads[layer]) for n in loads[layer]] for loads in routing.values()]
        darkest = max(max(shares_E) for shares_E in shares_TE)
        ax.imshow(shares_TE, cmap="Blues", vmin=0, vmax=darkest, aspect="auto")
        for t, shares_E in enumerate([] if many else shares_TE):
            for e, share in enumerate(shares_E):
                color = "white" if share > 0.6 * darkest else "black"
                ax.text(e, t, f"{share:.0f}", ha="center", va="center", color=color)
        ax.set(title=f"MoE layer {layer + 1}: each {topic}'s tokens per expert (%)", xlabel="expert",
               xticks=range(0, len(shares_TE[0]), 4 if many else 1), yticks=range(len(routing)),
               yticklabels=list(routing))
    figure.savefig(out_dir / "expert_load.png")
    save_heatmap(train, out_dir)


def load_shares(records: List[dict]) -> List[List[List[float]]]:
    """Per MoE layer, per expert, its share of the layer's tokens (%) at each record."""
    loads = [r["tokens_per_expert"] for r in records]
    return [[[_percent(load[layer][e], load[layer]) for load in loads] for e in range(len(loads[0][layer]))]
            for layer in range(len(loads[0]))]


def save_heatmap(train: List[dict], out_dir: Path):
    """expert_load_heatmap.png: per MoE layer, each expert's share of the tokens (a row) over the records (columns,
    each centred on its step where the records are evenly spaced); a starved expert is a pale row, a collapse one
    dark row. Returns the matplotlib Figure drawn (an image per layer's axes, in layer order)."""
    shares = load_shares(train)
    steps = [r["step"] for r in train]
    half = (steps[-1] - steps[0]) / (2 * (len(steps) - 1)) if len(steps) > 1 else 0.5   # half a column
    figure = _figure(5 * len(shares), 3.6)
    for layer, (ax, shares_ES) in enumerate(zip(figure.subplots(1, len(shares), squeeze=False)[0], shares)):
        image = ax.imshow(shares_ES, cmap="viridis", vmin=0, aspect="auto", interpolation="nearest",
                          extent=(steps[0] - half, steps[-1] + half, len(shares_ES) - 0.5, -0.5))
        ax.set(title=f"MoE layer {layer + 1}: share of tokens per expert (%)", xlabel="step", ylabel="expert")
        figure.colorbar(image, ax=ax)
    figure.savefig(out_dir / "expert_load_heatmap.png")
    return figure


def _percent(n: int, load: List[int]) -> float:
    return 100 * n / max(1, sum(load))


UNTIMED = " (and the segments before, whose checkpoint kept no time)"


def _segments(result: dict) -> str:
    """' in N segments' when the run was resumed (its figures are summed over them)."""
    count = len(result.get("segments", []))
    return f" in {count} segments (resumed {count - 1} time{'s' if count > 2 else ''})" if count > 1 else ""


def _processes(result: dict) -> str:
    """The processes of each segment where they changed: '2', or '2 then 1'."""
    changes = [p for i, p in enumerate(result.get("processes", [])) if i == 0 or p != result["processes"][i - 1]]
    return " then ".join(map(str, changes)) if changes else str(result["world_size"])


def summary(name: str, result: dict, records: List[dict], routing: Dict[str, List[List[int]]]) -> str:
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    last = train[-1]
    image = result.get("task") == "image"
    unit = "images" if image else "tokens"
    seconds = f"{result['seconds']:.0f} s" + ("" if result.get("seconds_complete", True) else UNTIMED)
    lines = [
        f"run {name}: {result['steps']} steps{_segments(result)}, {_processes(result)} process(es), "
        f"{result[unit]:,} {unit}, {seconds} "
        f"({last[unit + '_per_s']:,.0f} {unit}/s at the end)",
        f"validation loss {val[0]['val_loss']:.3f} (step {val[0]['step']}) -> {val[-1]['val_loss']:.3f} "
        f"(step {val[-1]['step']}); train loss {train[0]['loss']:.3f} -> {last['loss']:.3f}",
    ]
    if image:
        lines.append(f"validation accuracy {100 * val[0]['val_accuracy']:.1f}% -> "
                     f"{100 * val[-1]['val_accuracy']:.1f}%; "
                     f"train accuracy {100 * train[0]['accuracy']:.1f}% -> {100 * last['accuracy']:.1f}%")
    lines.append(f"dropped tokens {100 * last['dropped_fraction']:.1f}%, aux loss {last['aux_loss']:.4f} (last record)")
    for layer, load in enumerate(last["tokens_per_expert"]):
        shares = " ".join(f"{_percent(n, load):.0f}" for n in load)
        lines.append(f"MoE layer {layer + 1}: share of tokens per expert (%, last record): {shares}")
    if routing:
        lines.append("share of each class's tokens (patches) per expert (%, validation images):" if image else
                     "share of each topic's tokens per expert (%, validation text):")
        num_experts = len(next(iter(routing.values()))[0])
        width = max(len(topic) for topic in routing)
        for layer in range(len(next(iter(routing.values())))):
            lines.append(f"  {'MoE layer ' + str(layer + 1):<{width}} " +
                         " ".join(f"{'e' + str(e):>3}" for e in range(num_experts)))
            for topic, loads in routing.items():
                load = loads[layer]
                lines.append(f"  {topic:<{width}} " + " ".join(f"{_percent(n, load):3.0f}" for n in load))
    pictures = ("loss.png, accuracy.png, " if image else "loss.png, ") + \
        ("expert_load.png, expert_load_heatmap.png, " if last["tokens_per_expert"] else "")
    pictures = pictures if result.get("plots", True) else ""
    loader = ("upcycle_export.load_upcycled" if last["tokens_per_expert"] else
              "AutoModelForImageClassification.from_pretrained") if image else "AutoModelForCausalLM.from_pretrained"
    hf = f", hf_model/ ({loader} loads it)" if result.get("hf_model") else ""
    lines.append(f"outputs in {result['out_dir']}: metrics.jsonl, {pictures}checkpoints/{hf}")
    return "\n".join(lines) + "\n"
