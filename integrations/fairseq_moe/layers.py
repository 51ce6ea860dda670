"""fairseq transformer layers whose FFN is an MoE layer.

A fairseq layer computes its FFN as fc2(activation_dropout(activation_fn(fc1(x)))) between its own
norms, dropout and residual. The MoE layers here keep all of that and make fc1 the whole MoE FFN
(fc2, the activation and the activation dropout become identities; the experts apply
--activation-fn themselves, and --activation-dropout applies to the dense layers only). Padding
tokens skip the MoE layer: they take no expert capacity and count in no statistic or aux loss.

Legend: T time steps, B batch, D model dim, N non-padding tokens.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from fairseq.models.transformer import TransformerConfig
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.distributed import fsdp_wrap

from moe_plugin import MoEConfig, MoELayer

from .config import moe_config_from_args, moe_layer_indices, single_process_error

logger = logging.getLogger(__name__)


class MoEFFN(nn.Module):
    """x[T, B, D] -> MoE(x) of the same shape; rows marked in padding_mask_BT come back as zeros."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.moe = MoELayer(config)
        self.padding_mask_BT: Optional[torch.Tensor] = None   # set by the layer around each forward

    def forward(self, x_TBD: torch.Tensor) -> torch.Tensor:
        mask_BT = self.padding_mask_BT
        # aux_loss seq: a sequence is a batch column (time-major input), padding left out
        sequence_TB = None
        if self.moe.config.aux_loss == "seq":
            sequence_TB = torch.arange(x_TBD.shape[1], device=x_TBD.device).expand(x_TBD.shape[:2])
        if mask_BT is None or not mask_BT.any():
            return self.moe(x_TBD, sequence_T=None if sequence_TB is None else sequence_TB.reshape(-1))
        if mask_BT.shape != x_TBD.shape[1::-1]:
            raise ValueError(f"padding mask of shape {tuple(mask_BT.shape)} does not fit input {tuple(x_TBD.shape)}")
        keep_TB = ~mask_BT.t()
        y_TBD = x_TBD.new_zeros(x_TBD.shape)
        y_TBD[keep_TB] = self.moe(x_TBD[keep_TB], sequence_T=None if sequence_TB is None else sequence_TB[keep_TB])
        return y_TBD


class _PaddingMask:
    """with _PaddingMask(ffn, mask): the MoE FFN skips the padding tokens of this forward."""

    def __init__(self, ffn: MoEFFN, mask_BT: Optional[torch.Tensor]):
        self.ffn, self.mask_BT = ffn, mask_BT

    def __enter__(self):
        self.ffn.padding_mask_BT = self.mask_BT

    def __exit__(self, *exc):
        self.ffn.padding_mask_BT = None


def _identity(x):
    return x


class _MoEFFNLayer:
    """fc1 becomes the whole MoE FFN; fc2 and the activation between them become identities."""

    def _no_activation(self):
        self.activation_fn = _identity
        self.activation_dropout_module = nn.Identity()

    def build_fc1(self, input_dim, output_dim, q_noise, qn_block_size):
        return MoEFFN(self.moe_config)

    def build_fc2(self, input_dim, output_dim, q_noise, qn_block_size):
        return nn.Identity()


class MoEEncoderLayer(_MoEFFNLayer, TransformerEncoderLayerBase):
    def __init__(self, cfg, moe_config: MoEConfig, return_fc: bool = False):
        self.moe_config = moe_config   # read by build_fc1, which the base __init__ calls
        super().__init__(cfg, return_fc=return_fc)
        self._no_activation()

    def forward(self, x, encoder_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor] = None):
        with _PaddingMask(self.fc1, encoder_padding_mask):
            return super().forward(x, encoder_padding_mask, attn_mask)


class MoEDecoderLayer(_MoEFFNLayer, TransformerDecoderLayerBase):
    def __init__(self, cfg, moe_config: MoEConfig, no_encoder_attn: bool = False):
        self.moe_config = moe_config   # read by build_fc1, which the base __init__ calls
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        self._no_activation()

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask=None,
                self_attn_padding_mask=None, need_attn=False, need_head_weights=False):
        with _PaddingMask(self.fc1, self_attn_padding_mask):
            return super().forward(x, encoder_out, encoder_padding_mask, incremental_state, prev_self_attn_state,
                                   prev_attn_state, self_attn_mask, self_attn_padding_mask, need_attn,
                                   need_head_weights)


def use_moe_layers(stack: nn.Module, args, where: str, no_encoder_attn: bool = False) -> None:
    """Replace every --moe-freq-th layer of a fairseq encoder or decoder (where) by its MoE twin."""
    cfg = TransformerConfig.from_namespace(args)
    part = cfg.encoder if where == "encoder" else cfg.decoder
    _check_supported(cfg, args)
    moe_config = moe_config_from_args(args, part.embed_dim, part.ffn_embed_dim)
    for i in moe_layer_indices(args, len(stack.layers), where):
        if where == "encoder":
            layer = MoEEncoderLayer(cfg, moe_config, return_fc=stack.return_fc)
        else:
            layer = MoEDecoderLayer(cfg, moe_config, no_encoder_attn=no_encoder_attn)
        stack.layers[i] = _wrap(layer, cfg)
    if (cfg.activation_dropout or cfg.relu_dropout or 0) > 0:
        logger.warning("--activation-dropout applies to the dense FFN layers only, not inside the experts")


def _wrap(layer: nn.Module, cfg) -> nn.Module:
    """As fairseq wraps its own layers: activation checkpointing, FSDP."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=0 if cfg.checkpoint_activations else cfg.min_params_to_wrap)


def _check_supported(cfg, args) -> None:
    if args.moe_ep_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(single_process_error(args.moe_ep_size))
    if cfg.quant_noise.pq > 0:
        raise ValueError(f"--quant-noise-pq {cfg.quant_noise.pq} is not supported with MoE layers; use 0")
    if getattr(args, "scale_fc", False):
        raise ValueError("--scale-fc is not supported with MoE layers (it normalizes the dense FFN's hidden units)")
    layerdrop = max(cfg.encoder.layerdrop, cfg.decoder.layerdrop)
    if layerdrop > 0 and args.moe_ep_size > 1:
        raise ValueError(f"--encoder/decoder-layerdrop {layerdrop} cannot be used with --moe-ep-size "
                         f"{args.moe_ep_size}: every rank of an expert-parallel group must run every MoE layer")
