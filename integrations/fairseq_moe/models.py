"""MoE models and archs: transformer_lm_moe (decoder-only LM) and transformer_moe (translation).

Each is fairseq's own model, built as usual, then every --moe-freq-th layer is replaced by its MoE
twin (layers.py: the same attention, norms and residuals; the FFN is an MoE layer). An arch function applies fairseq's arch defaults, then the --moe-*
defaults, and checks the flags, so a bad value fails before any data is read.

With --moe-ep-size > 1 each rank holds different experts, so each rank must save and load its
own checkpoint. fairseq-fixed does exactly that for models with cfg.model.base_layers > 0 (its own
expert-parallel BASE layers): checkpoint_last-rank-<R>.pt per rank, loaded on every rank. The
archs set base_layers to 1 with --moe-ep-size > 1 (0 otherwise) as that switch, and the models
build no BASE layer. consolidate.py merges such per-rank checkpoints into one for single-process
evaluation.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models.transformer import TransformerModel, base_architecture, transformer_iwslt_de_en
from fairseq.models.transformer_lm import (TransformerLanguageModel, TransformerLanguageModelConfig,
                                           base_lm_architecture, transformer_lm_gpt)
from fairseq.utils import safe_getattr

from moe_plugin import begin_step, update_expert_bias

from .config import (add_moe_args, flag_errors, moe_config_from_args, moe_layer_indices, set_moe_defaults,
                     single_process_error)
from .criterions import check_gate_loss_flags
from .distributed import prepare_expert_parameters
from .layers import use_moe_layers
from .registration import architecture, model


class _UpdatesExpertBias:
    """fairseq's task calls model.set_num_updates(n) before every micro-batch's forward; when n moves
    on, the previous update (all its micro-batches) is done: the balancing bias is updated once, and a balance
    loss counted globally counts over the next update's micro-batches (moe_plugin.begin_step)."""

    _bias_updates_seen = None

    def set_num_updates(self, num_updates):
        if num_updates != self._bias_updates_seen:
            if self._bias_updates_seen is not None:
                update_expert_bias(self)
            begin_step(self)
        self._bias_updates_seen = num_updates
        super().set_num_updates(num_updates)


@model("transformer_lm_moe")
class TransformerLanguageModelMoE(_UpdatesExpertBias, TransformerLanguageModel):
    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, TransformerLanguageModelConfig(), delete_default=True)
        add_moe_args(parser)

    @classmethod
    def build_model(cls, args, task):
        set_moe_defaults(args)
        with _without_base_layers(args):
            lm = super().build_model(args, task)
        with flag_errors():
            use_moe_layers(lm.decoder, args, "decoder", no_encoder_attn=True)
            prepare_expert_parameters(lm, args)
        return lm


@model("transformer_moe")
class TransformerModelMoE(_UpdatesExpertBias, TransformerModel):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_moe_args(parser)

    @classmethod
    def build_model(cls, args, task):
        set_moe_defaults(args)
        with _without_base_layers(args):
            seq2seq = super().build_model(args, task)
        with flag_errors():
            use_moe_layers(seq2seq.encoder, args, "encoder")
            use_moe_layers(seq2seq.decoder, args, "decoder")
            prepare_expert_parameters(seq2seq, args)
        return seq2seq


@contextlib.contextmanager
def _without_base_layers(args):
    """fairseq's builders read base_layers as a count of BASE layers to insert: none here."""
    per_rank_checkpoints = safe_getattr(args, "base_layers", 0)
    args.base_layers = 0
    try:
        yield
    finally:
        args.base_layers = per_rank_checkpoints


def _moe_defaults_and_checks(args, parts) -> None:
    """parts: "encoder" and/or "decoder", the stacks whose layers get MoE FFNs. fairseq-train runs this as it
    parses the flags: a bad value ends it there, in one line (config.flag_errors)."""
    with flag_errors():
        _check_flags(args, parts)


def _check_flags(args, parts) -> None:
    set_moe_defaults(args)
    per_rank_checkpoints = 1 if args.moe_ep_size > 1 else 0   # see the module docstring
    if (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and safe_getattr(args, "base_layers", 0) != per_rank_checkpoints):
        # fairseq-train runs this when it parses the flags; fairseq-hydra-train only when it builds the
        # model, after its distributed init has read base_layers to name the checkpoints
        raise ValueError(f"moe_ep_size={args.moe_ep_size} with fairseq-hydra-train needs "
                         f"model.base_layers={per_rank_checkpoints} in the config (fairseq's switch for "
                         f"per-rank checkpoints, read before the model is built): add "
                         f"+model.base_layers={per_rank_checkpoints}")
    args.base_layers = per_rank_checkpoints
    for part in parts:
        moe_config_from_args(args, getattr(args, f"{part}_embed_dim"), getattr(args, f"{part}_ffn_embed_dim"))
        moe_layer_indices(args, getattr(args, f"{part}_layers"), part)
    if args.moe_ep_size > 1 and _one_process(args):
        raise ValueError(single_process_error(args.moe_ep_size))
    if safe_getattr(args, "moe_gate_loss_wt", None) is not None:   # fairseq-train with an MoE criterion
        check_gate_loss_flags(args)


def _one_process(args) -> bool:
    """Whether fairseq will run these flags on one process: --distributed-world-size 1 and no init method (fairseq's
    infer_init_method then starts no distributed run, whatever the environment). Unknown (None) under
    fairseq-hydra-train, whose model config lacks these; layers.py checks again once the world is up."""
    return (safe_getattr(args, "distributed_world_size", None) == 1 and not safe_getattr(args, "tpu", False)
            and safe_getattr(args, "distributed_init_method", None) is None)


@architecture("transformer_lm_moe", "transformer_lm_moe")
def transformer_lm_moe(args):
    """fairseq's transformer_lm sizes: 512 wide, FFN 2048, 6 layers, 8 heads."""
    base_lm_architecture(args)
    _moe_defaults_and_checks(args, ["decoder"])


@architecture("transformer_lm_moe", "transformer_lm_moe_small")
def transformer_lm_moe_small(args):
    """256 wide, FFN 1024, 4 layers, 4 heads."""
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 256)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", 1024)
    args.decoder_layers = safe_getattr(args, "decoder_layers", 4)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", 4)
    transformer_lm_moe(args)


@architecture("transformer_lm_moe", "transformer_lm_moe_base")
def transformer_lm_moe_base(args):
    """GPT base sizes (fairseq's transformer_lm_gpt): 768 wide, FFN 3072, 12 layers, 12 heads, gelu."""
    transformer_lm_gpt(args)
    _moe_defaults_and_checks(args, ["decoder"])


@architecture("transformer_moe", "transformer_moe")
def transformer_moe(args):
    """fairseq's transformer (base) sizes: 512 wide, FFN 2048, 6 + 6 layers, 8 heads."""
    base_architecture(args)
    _moe_defaults_and_checks(args, ["encoder", "decoder"])


@architecture("transformer_moe", "transformer_iwslt_de_en_moe")
def transformer_iwslt_de_en_moe(args):
    """fairseq's transformer_iwslt_de_en sizes: 512 wide, FFN 1024, 6 + 6 layers, 4 heads."""
    transformer_iwslt_de_en(args)
    _moe_defaults_and_checks(args, ["encoder", "decoder"])
