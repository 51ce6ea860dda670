"""What the drop-in's tests share: finding real Tutel, and a layer's gradients in Tutel's layout."""
import importlib
import importlib.util

from moe_plugin.tutel import names
from moe_plugin.tutel.experts import CustomExperts

# Tutel itself is a regular package (its spec has an origin), not a folder of that name on the path without one
_SPEC = importlib.util.find_spec("tutel")
HAVE_TUTEL = _SPEC is not None and _SPEC.origin is not None
NO_TUTEL = "real Tutel is not installed (it is not on PyPI; CI has none): these tests compare against it where it is"


def real_tutel_moe():
    """Tutel's tutel.moe module (the caller has skipped without HAVE_TUTEL)."""
    return importlib.import_module("tutel.moe")


def grads_in_tutel_layout(layer) -> dict:
    """The drop-in's parameter gradients under Tutel's keys and layouts (None where a parameter got none)."""
    grads = {name: param.grad for name, param in layer.named_parameters()}
    out = {}
    for i in range(len(layer.gates)):
        gate = {"router." + key[len(f"gates.{i}."):]: grad for key, grad in grads.items()
                if key.startswith(f"gates.{i}.")}
        if any(grad is None for grad in gate.values()):
            weights = {"router." + name: param.detach() for name, param in layer.gates[i].named_parameters()}
            out.update(dict.fromkeys(names.gate_to_tutel(weights, i)))
            continue
        out.update(names.gate_to_tutel(gate, i))
    experts = {key: grad for key, grad in grads.items() if key.startswith("experts.")}
    if isinstance(layer.experts, CustomExperts):
        out.update({"experts." + key[len("experts.module."):]: grad for key, grad in experts.items()})
    else:
        out.update(names.experts_to_tutel(experts, layer.expert_spec.kind == "llama_ffn"))
    return out

