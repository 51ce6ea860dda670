"""Register models, archs and criterions with fairseq once, whatever name this package is imported by.

fairseq's --user-dir imports this folder by its base name (fairseq_moe); the same files are also
the installed package moe_plugin.integrations.fairseq_moe. Importing both gives two copies of each
module, and fairseq refuses a second registration of a name: whichever copy comes first registers,
the other finds the name taken and leaves fairseq's registries as they are.
"""
from __future__ import annotations

from fairseq.criterions import CRITERION_REGISTRY, register_criterion
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY, register_model, register_model_architecture


def model(name: str):
    def register(cls):
        if name not in MODEL_REGISTRY:
            register_model(name)(cls)
        return cls
    return register


def architecture(model_name: str, arch_name: str):
    def register(fn):
        if arch_name not in ARCH_MODEL_REGISTRY:
            register_model_architecture(model_name, arch_name)(fn)
        return fn
    return register


def criterion(name: str, dataclass):
    def register(cls):
        if name not in CRITERION_REGISTRY:
            register_criterion(name, dataclass=dataclass)(cls)
        return cls
    return register
