import math

import pytest

from moe_plugin import MoEConfig

BASE = dict(model_dim=16, hidden_size=32)


def test_kwargs_dict_and_yaml_agree(tmp_path):
    values = dict(BASE, num_experts=6, top_k=3, capacity_factor=-2.0, router="cosine", activation="swiglu",
                  normalize_gate="after_drop", bias=False, z_loss_coef=0.001)
    path = tmp_path / "moe.yaml"
    path.write_text("".join(f"{k}: {v if not isinstance(v, bool) else str(v).lower()}\n" for k, v in values.items()))
    nested = tmp_path / "experiment.yaml"
    nested.write_text("moe:\n" + "".join(f"  {line}\n" for line in path.read_text().splitlines()))
    assert MoEConfig(**values) == MoEConfig.from_dict(values) == MoEConfig.from_yaml(str(path)) \
        == MoEConfig.from_yaml(str(nested), section="moe")


def test_normalize_gate_accepts_booleans():
    assert MoEConfig(**BASE, normalize_gate=True).normalize_gate == "before_drop"
    assert MoEConfig(**BASE, normalize_gate=False).normalize_gate == "none"
    # top-1: True keeps the lone gate's probability (Switch, DeepSpeed); a string applies as written
    assert MoEConfig(**BASE, top_k=1, normalize_gate=True).normalize_gate == "none"
    assert MoEConfig(**BASE, top_k=1, normalize_gate="before_drop").normalize_gate == "before_drop"


@pytest.mark.parametrize("field, value, allowed", [
    ("top_k", 9, "between 1 and num_experts=8"),
    ("top_k", 0, ">= 1"),
    ("num_experts", 0, ">= 1"),
    ("num_experts", 2.5, "integer"),
    ("model_dim", True, "integer"),
    ("router", "argmax", "'softmax', 'sigmoid', 'cosine'"),
    ("activation", "tanh", "'relu', 'gelu', 'silu', 'swiglu'"),
    ("aux_loss", "balanced", "'gshard', 'switch', 'none'"),
    ("normalize_gate", "always", "'before_drop', 'after_drop', 'none'"),
    ("capacity_factor", math.nan, "finite"),
    ("capacity_factor", math.inf, "finite"),
    ("eval_capacity_factor", "1.0", "finite number"),
    ("min_capacity", -1, ">= 0"),
    ("gate_noise", -0.1, ">= 0"),
    ("fp32_router", "yes", "true or false"),
])
def test_invalid_values_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as error:
        MoEConfig(**{**BASE, "num_experts": 8, field: value})
    message = str(error.value)
    assert field in message and repr(value) in message and allowed in message


@pytest.mark.parametrize("build", [
    lambda: MoEConfig(**BASE, num_expert=4),
    lambda: MoEConfig.from_dict(dict(BASE, num_expert=4)),
    lambda: MoEConfig(**BASE).replace(num_expert=4),
])
def test_unknown_key_is_named_with_a_suggestion(build):
    with pytest.raises(ValueError, match=r"no field 'num_expert' \(did you mean 'num_experts'\?\); known fields: "):
        build()


def test_unknown_yaml_key(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text("model_dim: 8\nhidden_size: 8\ncapacity: 2\n")
    with pytest.raises(ValueError, match="no field 'capacity'"):
        MoEConfig.from_yaml(str(path))
    with pytest.raises(ValueError, match="no section 'moe'"):
        MoEConfig.from_yaml(str(path), section="moe")


def test_replace_revalidates():
    config = MoEConfig(**BASE, num_experts=4, top_k=2)
    assert config.replace(top_k=4).top_k == 4
    with pytest.raises(ValueError, match="top_k"):
        config.replace(top_k=5)
