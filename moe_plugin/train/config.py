"""The experiment config: its sections, parsing (defaults, YAML file, key=value overrides) and each section's checks.
checks.py checks the whole (the model's MoE layers); this file imports no model code."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..config import MoEConfig, field_names
from ..lora import TARGETS
from ..ops.native import shipped
from .data import DataConfig
from .data import check_config as check_data_config
from .models import ModelConfig

MOE_KEYS_SET_ELSEWHERE = {"model_dim": "model.dim", "ep_size": "parallel.ep_size"}
DEFAULT_MOE = {"hidden_size": 256, "num_experts": 8, "top_k": 2, "capacity_factor": 1.25,
               "eval_capacity_factor": 2.0, "activation": "gelu", "aux_loss_coef": 0.01}


@dataclass
class TrainConfig:
    steps: int = 600                 # optimizer steps; the LR schedule spans them
    stop_at: Optional[int] = None    # end the run after this step as if interrupted (resume it later)
    batch_size: int = 16             # rows per rank and step
    lr: float = 3e-3                 # peak LR: linear warmup, then cosine decay to lr * min_lr_ratio
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1        # on matrices only
    grad_clip: float = 1.0           # max global gradient norm; 0: off
    seed: int = 0                    # model init and router noise
    eval_every: int = 100            # validation loss every n steps, and at step 0 and the last step
    eval_batches: int = 4
    checkpoint_every: int = 200      # 0: only at the end of the run
    keep_checkpoints: int = 2        # keep the newest n; 0: all
    resume: Optional[str] = None     # a checkpoint folder; "auto": the newest whole one in log.out_dir if any, else
                                     # start fresh (the command torchrun --max-restarts re-runs); "latest": the
                                     # newest whole one, none is an error
    nonfinite: str = "skip"          # a step whose loss, aux loss or gradient norm is NaN/inf: skip (not applied,
                                     # counted) or stop (an error naming it)
    max_skipped: int = 10            # with nonfinite=skip: stop after this many skipped steps in a row
    device: str = "auto"             # auto (cuda when available), cpu or cuda
    compile: Optional[str] = None    # torch.compile the model in this mode: default, reduce-overhead (CUDA graphs on
                                     # CUDA), max-autotune; null: eager


@dataclass
class ParallelConfig:
    ep_size: int = 1                 # expert-parallel group size
    fsdp: bool = False               # FSDP2 (fully_shard_moe) instead of DDP: parameters, gradients and optimizer
                                     # state sharded (experts over the ranks holding them); needs >= 2 processes


@dataclass
class LogConfig:
    name: str = "default"
    out_dir: Optional[str] = None    # null: runs/<name>
    overwrite: bool = False          # a fresh run into an out_dir that holds another run's checkpoints or metrics
                                     # replaces them (deletes its checkpoints); false: it refuses (train.resume=auto
                                     # continues that run instead)
    every: int = 10                  # a metrics record every n steps
    progress: bool = True            # a progress bar on rank 0
    plots: bool = True               # loss.png, expert_load.png and expert_load_heatmap.png at the end
    routing_alarm: bool = True       # a warning when, in alarm_windows records in a row, an expert gets under
    alarm_min_share: float = 0.1     # this share of the mean load, or a layer drops more than
    alarm_max_dropped: float = 0.2   # this fraction of its choices
    alarm_windows: int = 3
    alarm_max_rank_load: Optional[float] = None  # or its busiest ep rank computes over this many times the mean
                                                 # rank's routed rows (>= 1; null: not watched)


@dataclass
class UpcycleConfig:
    """upcycle()'s options (moe_plugin.integrations.transformers): the HF model's dense MLPs in the chosen layers
    become MoE blocks of moe.num_experts experts (top moe.top_k; the moe section's other keys apply)."""
    every: int = 1                       # layers every-1, 2*every-1, ... of those in `layers` (1: all of them)
    layers: Optional[List[int]] = None   # the layer numbers considered (mlp_sites order); null: all
    noise: float = 0.0                   # each expert's weights get normal noise, std noise x the dense weight's std
    reinit_fraction: float = 0.0         # the share of each expert's hidden units drawn afresh; 1.0: independent
    checkpoint: Optional[str] = None     # the dense run to start from (its out_dir: newest checkpoint;
                                         # a checkpoints/step_N folder; or an HF folder such as its hf_model/)


@dataclass
class LoRASectionConfig:
    """LoRA fine-tuning (moe_plugin.lora.add_lora) of the hf section's MoE model (or the upcycled one): every weight
    frozen but the experts' adapters."""
    rank: int = 8
    alpha: Optional[float] = None        # scale alpha / rank; null: alpha = rank
    dropout: float = 0.0                 # on the adapters' input; only 0.0 (none) is implemented
    targets: List[str] = field(default_factory=lambda: ["up", "down"])   # the experts' projections: up, down
    checkpoint: Optional[str] = None     # the run to fine-tune: an MoE run of the same hf section (its out_dir:
                                         # newest checkpoint; a checkpoints/step_N folder; or its hf_model/); with
                                         # an upcycle section, a dense run (as upcycle.checkpoint)


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: Dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MOE))  # MoEConfig fields but those above
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # an HF config (model_type and its fields): train that Hugging Face MoE architecture (hf_model.py)
    hf: Optional[Dict[str, Any]] = None
    # the HF model's dense MLPs become MoE blocks (hf_image.py; null: the model as the hf section builds it)
    upcycle: Optional[UpcycleConfig] = None
    # LoRA on the experts, everything else frozen (hf_model.py; null: train every weight)
    lora: Optional[LoRASectionConfig] = None


def parse_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The defaults, then the YAML file, then the key=value overrides; ValueError on a bad key or a value of the
    wrong type (checks.load_config then checks the values)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    layers = [] if path is None else [_load_yaml(config_file(path))]
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is invalid: must be key=value, e.g. train.steps=100")
    layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), *layers)
        cfg = OmegaConf.to_object(merged)
    except ConfigKeyError as error:
        raise ValueError(_unknown_key_message(error.full_key)) from None
    except OmegaConfBaseException as error:
        raise ValueError(f"{error.full_key}: {str(error).splitlines()[0]}") from None
    return cfg


def experiments() -> Path:
    """The example experiment configs: `moe-plugin train NAME` runs experiments()/NAME.yaml."""
    return shipped("configs") / "experiments"


def config_file(path: str) -> str:
    """path, or the shipped experiment that a bare name stands for (`moe-plugin train fine_grained`: no folder, no
    .yaml); ValueError naming the shipped ones when it is neither."""
    shipped = experiments() / f"{path}.yaml"
    if os.path.isfile(path):
        return path
    if os.sep not in path and not path.endswith((".yaml", ".yml")) and shipped.is_file():
        return str(shipped)
    names = ", ".join(sorted(file.stem for file in experiments().glob("*.yaml")))
    problem = "is a folder, not a file" if os.path.isdir(path) else "does not exist"
    raise ValueError(f"config file {path!r} {problem}; give a YAML file or a shipped experiment's name: {names}")


MAPPING = "must be a mapping of sections (model:, moe:, train:, ...)"


def _load_yaml(path: str):
    """The file's mapping of sections; ValueError naming the file (and line and column) when it is not one."""
    import yaml
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else path
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"config file {where}: not valid YAML: {problem}") from None
    except UnicodeDecodeError:
        raise ValueError(f"config file {path}: not a UTF-8 text file") from None
    except OmegaConfBaseException as error:
        raise ValueError(f"config file {path}: {str(error).splitlines()[0]}") from None
    except OSError as error:   # unreadable, or a lone value (omegaconf: "Invalid loaded object type: int")
        raise ValueError(f"config file {path}: {error.strerror or f'{MAPPING}, not a lone value ({error})'}") from None
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"config file {path}: {MAPPING}, not a "
                         f"{'list' if isinstance(loaded, ListConfig) else type(loaded).__name__}")
    return loaded


def _valid_keys(section: Optional[str]) -> List[str]:
    if section is None:
        return [f.name for f in dataclasses.fields(ExperimentConfig)]
    if section == "moe":
        return [name for name in field_names() if name not in MOE_KEYS_SET_ELSEWHERE]
    if section == "upcycle":
        return [f.name for f in dataclasses.fields(UpcycleConfig)]
    if section == "lora":
        return [f.name for f in dataclasses.fields(LoRASectionConfig)]
    return [f.name for f in dataclasses.fields(getattr(ExperimentConfig(), section))]


def _unknown_key_message(full_key: str) -> str:
    section, _, key = full_key.partition(".")
    where, bad, valid = ("the config", section, _valid_keys(None)) if not key else \
        (f"section {section}", key, _valid_keys(section))
    close = difflib.get_close_matches(bad, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {full_key!r}{hint}; valid keys of {where}: {', '.join(valid)}"


def moe_config(cfg: ExperimentConfig) -> MoEConfig:
    """The MoE layers' config: the moe section, with model_dim and ep_size from the model and parallel sections."""
    for key in cfg.moe:
        if key not in _valid_keys("moe"):
            message = _unknown_key_message(f"moe.{key}")
            if key in MOE_KEYS_SET_ELSEWHERE:
                message = f"moe.{key} is set by {MOE_KEYS_SET_ELSEWHERE[key]}; {message}"
            raise ValueError(message)
    try:
        return MoEConfig.from_dict({**cfg.moe, "model_dim": cfg.model.dim, "ep_size": cfg.parallel.ep_size})
    except (ValueError, TypeError) as error:
        raise ValueError(f"moe section: {error}") from None


AT_LEAST = {"model.dim": 1, "model.layers": 1, "model.heads": 1, "model.seq_len": 1, "model.ffn_hidden": 1,
            "model.moe_every": 1, "train.steps": 1, "train.batch_size": 1, "train.warmup_steps": 0,
            "train.eval_every": 1, "train.eval_batches": 1, "train.checkpoint_every": 0,
            "train.keep_checkpoints": 0, "train.max_skipped": 1, "parallel.ep_size": 1, "log.every": 1}


def check_sections(cfg: ExperimentConfig) -> None:
    """Each section's values on their own (checks.check_config adds the MoE layers of the model)."""
    def value(key):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    def require(key, ok, allowed):
        if not ok:
            raise ValueError(f"{key}={value(key)!r} is invalid: must be {allowed}")

    for key, minimum in AT_LEAST.items():
        require(key, value(key) >= minimum, f">= {minimum}")
    require("model.heads", cfg.model.dim % cfg.model.heads == 0, f"a divisor of model.dim={cfg.model.dim}")
    require("train.lr", math.isfinite(cfg.train.lr) and cfg.train.lr > 0, "a positive number")
    require("train.min_lr_ratio", 0 <= cfg.train.min_lr_ratio <= 1, "between 0 and 1")
    require("train.weight_decay", cfg.train.weight_decay >= 0, ">= 0")
    require("train.grad_clip", cfg.train.grad_clip >= 0, ">= 0 (0: off)")
    require("train.stop_at", cfg.train.stop_at is None or 1 <= cfg.train.stop_at <= cfg.train.steps,
            f"null or between 1 and train.steps={cfg.train.steps}")
    require("train.device", cfg.train.device in ("auto", "cpu", "cuda"), "one of 'auto', 'cpu', 'cuda'")
    require("train.nonfinite", cfg.train.nonfinite in ("skip", "stop"), "one of 'skip', 'stop'")
    require("train.compile", cfg.train.compile in (None, "default", "reduce-overhead", "max-autotune"),
            "null, 'default', 'reduce-overhead' or 'max-autotune'")
    require("log.alarm_min_share", 0 <= cfg.log.alarm_min_share < 1, "in [0, 1) (a share of the mean load)")
    require("log.alarm_max_dropped", 0 <= cfg.log.alarm_max_dropped < 1, "in [0, 1) (a fraction)")
    require("log.alarm_windows", cfg.log.alarm_windows >= 1, ">= 1")
    require("log.alarm_max_rank_load", cfg.log.alarm_max_rank_load is None or cfg.log.alarm_max_rank_load >= 1,
            "null or a number >= 1 (the busiest ep rank's rows over the mean rank's)")
    check_data_config(cfg.data)
    check_lora(cfg)


def check_lora(cfg: ExperimentConfig) -> None:
    lora = cfg.lora
    if lora is None:
        return
    if cfg.hf is None or cfg.data.task == "image":
        raise ValueError("lora is invalid without an hf section (a Hugging Face causal LM: an MoE model_type such "
                         "as mixtral, or a dense one with an upcycle section): it fine-tunes that model's experts")
    if isinstance(lora.rank, bool) or lora.rank < 1:
        raise ValueError(f"lora.rank={lora.rank!r} is invalid: must be >= 1")
    if lora.alpha is not None and not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise ValueError(f"lora.alpha={lora.alpha!r} is invalid: must be a positive number or null (= rank)")
    if lora.dropout != 0.0:
        raise ValueError(f"lora.dropout={lora.dropout!r} is invalid: moe_plugin's LoRA on the experts has no dropout; "
                         f"must be 0.0")
    if not lora.targets or any(t not in TARGETS for t in lora.targets):
        raise ValueError(f"lora.targets={list(lora.targets)!r} is invalid: must name one or both of {list(TARGETS)}")
    if lora.checkpoint is not None and cfg.upcycle is not None and cfg.upcycle.checkpoint is not None:
        raise ValueError("lora.checkpoint and upcycle.checkpoint are both set: give the dense run once (either)")


def to_yaml(cfg: ExperimentConfig) -> str:
    from omegaconf import OmegaConf
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
