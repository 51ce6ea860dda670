"""`moe-plugin train [CONFIG.yaml] [key=value ...]`: train a small MoE transformer LM (or an HF
architecture: an MoE family, a dense LM optionally upcycled, or a Swinv2 image classifier).

Legend: B batch rows per rank, S sequence length, V vocabulary.

A config has the sections model, moe, data, train, parallel and log, and optionally hf (an HF
architecture as the model: hf_model.py; with data.task image, hf_image.py on data/images.py) and
upcycle (dense MLPs made MoE blocks). The defaults in config.py are the
default experiment (configs/experiments/default.yaml spells them out; a test keeps them equal).
A run writes to log.out_dir: metrics.jsonl, summary.txt, result.json, loss.png, expert_load.png
and checkpoints/step_NNNNNN. Under torchrun every rank trains on its own data shard
(DistributedDataParallel, gloo on CPU, nccl on GPU); rank 0 writes the outputs. With
parallel.ep_size > 1 the experts are spread over each block of ep_size ranks: DDP leaves them out
and parallel/expert_grads.py finishes their gradients; each process writes its own experts into a
sharded checkpoint (torch.distributed.checkpoint) that resumes on any number of processes and ep_size.

One file per job: config.py (sections, parsing, each section's checks), checks.py (load_config, check_config:
the whole, with the model's MoE layers), processes.py (one process or torchrun ranks),
metrics.py (the metrics window and log), parts.py (model, optimizer, LR schedule, data, DDP),
checkpoint.py (save, verify and restore), faults.py (preemption signals, non-finite steps), loop.py (the
training loop), command.py (the command line; with
--nproc-per-node it starts torchrun itself, --max-restarts and --numa-binding passed through).
"""
from .checkpoint import (checkpoint_path, checkpoints, full_state_dict, load_full_state_dict, rank_state, read_meta,
                         remove_checkpoints, resolve_resume, restore, save, verify)
from .command import add_arguments, main, split_arguments
from .checks import check_config, load_config
from .config import (AT_LEAST, DEFAULT_MOE, MOE_KEYS_SET_ELSEWHERE, ExperimentConfig, LogConfig, ParallelConfig,
                     TrainConfig, moe_config, to_yaml)
from .faults import NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, NonFiniteStep, Preempted
from .loop import clip_gradients, evaluate, gradient_norm, parameter_hash, topic_routing, train
from .metrics import MetricsLog, Window, tensorboard_writer
from .parts import Parts, build, data_parallel, lr_factor, param_groups
from .processes import Processes, gather, start_processes

__all__ = ["checkpoint_path", "checkpoints", "full_state_dict", "load_full_state_dict",
           "rank_state", "resolve_resume", "restore", "save", "verify", "read_meta", "remove_checkpoints", "add_arguments", "main",
           "split_arguments", "AT_LEAST", "DEFAULT_MOE", "MOE_KEYS_SET_ELSEWHERE", "ExperimentConfig", "LogConfig",
           "ParallelConfig", "TrainConfig", "check_config", "load_config", "moe_config", "to_yaml", "NONFINITE_EXIT_CODE",
           "PREEMPTED_EXIT_CODE", "NonFiniteStep", "Preempted", "clip_gradients", "gradient_norm",
           "evaluate", "parameter_hash", "topic_routing", "train", "MetricsLog", "Window", "tensorboard_writer",
           "Parts", "build", "data_parallel", "lr_factor", "param_groups", "Processes", "gather", "start_processes"]
