"""The cost of the routing metrics (issue 44): a training step with them on against off, in one run.

train: `moe-plugin train`'s own step (moe_plugin/train/loop.py's _step) on its default experiment (D 128, 4 layers
  of which 2 MoE, 8 experts, top-2, 16 x 128 tokens), a record every log.every steps as the loop makes it; "on"
  adds the RoutingMonitor's hooks and, at each record, its read, the tags and the alarm's check, as the loop does.
hf: a Hugging Face Trainer step of a small Mixtral (2 layers, D 128, 8 experts of 256, top-2, 8 x 128 tokens, its
  blocks swapped), logging every 10 steps (report_to none); "on" adds the RoutingMetrics callback. Each step is
  timed from one on_step_begin to the next, so that the log's read counts.

Variants alternate (round robin, the order flipped every round) so that the machine's load hits them alike. A
figure is the CPU seconds of this process (one thread: less sensitive to other jobs than wall time) per step over
one logging window (log-every steps, one read among them), the median over every window of a variant; on / off
is printed (the issue's target: within 1.02).

    OMP_NUM_THREADS=1 python benchmarks/bench_routing_metrics.py [--case train|hf|all] [--rounds 10] [--windows 2]
"""
import argparse
import statistics
import tempfile
import time

import torch

from moe_plugin.routing_monitor.alarm import RoutingAlarm
from moe_plugin.routing_monitor.metrics import RoutingMonitor, scalars

LOG_EVERY = 10


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("train", "hf", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=10, help="rounds; each runs every variant once")
    parser.add_argument("--windows", type=int, default=2, help="timed logging windows per variant and round")
    args = parser.parse_args(argv)
    args.steps, args.warmup = args.windows * LOG_EVERY, LOG_EVERY      # one untimed window first
    return args


def train_case(rounds: int, steps: int, warmup: int) -> dict:
    from moe_plugin import train
    from moe_plugin.train.faults import Signals
    from moe_plugin.train.loop import _step
    from moe_plugin.train.metrics import Window
    from moe_plugin.train.parts import build, data_parallel
    from moe_plugin.train.processes import start_processes

    cfg = train.load_config(None, [f"log.out_dir={tempfile.mkdtemp()}", "log.progress=false",
                                   f"train.steps={10 ** 6}", f"log.every={LOG_EVERY}"])
    procs = start_processes(cfg.train.device)
    parts = build(cfg, procs)
    wrapped = data_parallel(parts.model, procs)
    items = cfg.train.batch_size * cfg.model.seq_len
    step = 0

    def run(on: bool) -> list:
        nonlocal step
        monitor = RoutingMonitor(parts.model) if on else None
        alarm = RoutingAlarm() if on else None
        window, seconds = Window(), []
        with Signals() as signals:
            for i in range(warmup + steps):
                start = time.process_time()
                step += 1
                window, _ = _step(cfg, procs, parts, wrapped, window, step, signals, items)
                if step % LOG_EVERY == 0:
                    record = window.record(procs, step, parts.optimizer.param_groups[0]["lr"])
                    window = Window()
                    if monitor is not None:
                        routing = monitor.read()
                        record.update(scalars(routing))
                        alarm.check(routing)
                if i >= warmup:
                    seconds.append(time.process_time() - start)
        if monitor is not None:
            monitor.close()
        return seconds

    print(f"train: moe-plugin train's default experiment (D {cfg.model.dim}, {cfg.model.layers} layers, MoE every "
          f"{cfg.model.moe_every}, {cfg.moe['num_experts']} experts, top-{cfg.moe['top_k']}, "
          f"{cfg.train.batch_size} x {cfg.model.seq_len} tokens), a record every {LOG_EVERY} steps")
    return alternate({"off": lambda: run(False), "on": lambda: run(True)}, rounds)


def hf_case(rounds: int, steps: int, warmup: int) -> dict:
    from moe_plugin.integrations.transformers import RoutingMetrics, swap_moe_blocks
    from transformers import MixtralConfig, MixtralForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=128)
    torch.manual_seed(0)
    model = swap_moe_blocks(MixtralForCausalLM(config))
    rows = torch.randint(0, 256, (4096, 128))
    data = [{"input_ids": row, "labels": row} for row in rows]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.starts = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts.append(time.process_time())

        def on_train_end(self, args, state, control, **kwargs):
            self.starts.append(time.process_time())

    def run(on: bool) -> list:
        timer = StepTimes()
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=8,
                                 max_steps=warmup + steps, learning_rate=1e-4, save_strategy="no", report_to=[],
                                 logging_steps=LOG_EVERY, disable_tqdm=True, log_level="error")
        callbacks = [timer, RoutingMetrics()] if on else [timer]
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)       # no console lines (the logs are made all the same)
        trainer.train()
        return [b - a for a, b in zip(timer.starts[warmup:], timer.starts[warmup + 1:])]

    print(f"hf: Trainer step, Mixtral swapped (D {config.hidden_size}, {config.num_hidden_layers} layers, "
          f"{config.num_local_experts} experts of {config.intermediate_size}, top-{config.num_experts_per_tok}, "
          f"8 x 128 tokens), a log every {LOG_EVERY} steps")
    return alternate({"off": lambda: run(False), "on": lambda: run(True)}, rounds)


def alternate(variants: dict, rounds: int) -> dict:
    """Each variant once per round, the order flipped every round; {name: every step's seconds}."""
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name] += variants[name]()
    return times


def report(times: dict) -> None:
    """Per variant: the median over its windows of the mean step."""
    windows = {name: [sum(seconds[i:i + LOG_EVERY]) / LOG_EVERY for i in range(0, len(seconds), LOG_EVERY)]
               for name, seconds in times.items()}
    base = statistics.median(windows["off"])
    for name, means in windows.items():
        median = statistics.median(means)
        print(f"  {name}: {median * 1e3:.2f} ms CPU per step (median of {len(means)} windows), "
              f"{median / base:.4f} of off")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds x {args.windows} windows of {LOG_EVERY} steps "
          f"per variant (one untimed window first)")
    if args.case in ("train", "all"):
        report(train_case(args.rounds, args.steps, args.warmup))
    if args.case in ("hf", "all"):
        report(hf_case(args.rounds, args.steps, args.warmup))


if __name__ == "__main__":
    main()
