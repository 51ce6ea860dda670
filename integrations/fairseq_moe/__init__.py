"""fairseq --user-dir package: MoE transformer models, archs and criterions.

    fairseq-train --user-dir $(moe-plugin fairseq-user-dir) --arch transformer_lm_moe \
        --criterion moe_cross_entropy --moe-expert-count 8 ...

Models: transformer_lm_moe (archs transformer_lm_moe, _small, _base) and transformer_moe (archs
transformer_moe, transformer_iwslt_de_en_moe). Criterions: moe_cross_entropy,
moe_label_smoothed_cross_entropy. See README.md in this folder.
"""
import argparse

import torch

from . import criterions, models  # noqa: F401  (registers with fairseq, once: see registration.py)

# fairseq-fixed 0.12.3.1 reads checkpoints with torch.load's default, weights_only=True since torch 2.6,
# and its checkpoints hold one non-tensor class, argparse.Namespace: allow that plain class.
torch.serialization.add_safe_globals([argparse.Namespace])
