"""DeepSpeed in a spawned gloo rank: its process setup, a few training steps of an engine, synthetic batches, a
topk that breaks ties by position, and a layer's gradients under DeepSpeed's names (shared by the DeepSpeed tests)."""
import os

import torch


def setup_worker(rank, world):
    """The environment DeepSpeed's engine asks for, quiet logs, and DeepSpeed's comm on the gloo group."""
    import logging

    import deepspeed
    from deepspeed.utils import logger
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")


def train(engine, batches):
    from moe_plugin.integrations.deepspeed.model import lm_loss
    losses = []
    for tokens in batches:
        loss = lm_loss(engine, tokens)
        engine.backward(loss + 0.01 * engine.module.l_aux())
        engine.step()
        losses.append(loss.item())
    return losses


def batches(seed, count, batch=8):
    from moe_plugin.integrations.deepspeed.model import synthetic_batch
    generator = torch.Generator().manual_seed(seed)
    return [synthetic_batch(generator, batch, 32, 64) for _ in range(count)]


class TorchWithStableTopk:
    """torch, with a topk that breaks ties by position (for deepspeed.moe.sharded_moe)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def topk(x, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return values.narrow(dim, 0, int(k)), indices.narrow(dim, 0, int(k))


def stable_topk():
    """Break ties in DeepSpeed's top-1 capacity selection by position.

    top1gating keeps `capacity` of an expert's tokens by torch.topk over a 0/1 mask, whose order among
    ties torch leaves unspecified; by position is one of DeepSpeed's allowed outcomes and is ours.
    """
    import deepspeed.moe.sharded_moe as sharded_moe
    sharded_moe.torch = TorchWithStableTopk()


def native_named_grads(layer):
    """Parameter gradients under the native layer's names (ours go through the layer's own renaming)."""
    import moe_plugin.integrations.deepspeed as dsi
    from moe_plugin.integrations.deepspeed.native import _to_native_names
    if not isinstance(layer, dsi.MoE):
        return {name: p.grad for name, p in layer.named_parameters()}
    grads = {name: p.grad for name, p in layer.deepspeed_moe.named_parameters()}
    _to_native_names(layer.deepspeed_moe, grads, "", None)
    return {f"deepspeed_moe.{name}": grad for name, grad in grads.items()}
