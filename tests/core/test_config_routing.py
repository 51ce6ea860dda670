"""MoEConfig fields of the modern routers: bias balancing, group-limited routing, route scale,
shared expert, sequence aux loss."""
import math

import pytest

from moe_plugin import MoEConfig

BASE = dict(model_dim=16, hidden_size=32, num_experts=8, top_k=2)


def test_defaults_leave_the_layer_as_before():
    config = MoEConfig(**BASE)
    assert (config.expert_bias_update_rate, config.num_groups, config.topk_groups, config.route_scale,
            config.shared_hidden_size, config.shared_gate) == (0.0, 1, 1, 1.0, 0, False)


def test_deepseek_style_config_is_accepted_and_round_trips(tmp_path):
    values = dict(model_dim=16, hidden_size=8, num_experts=64, top_k=8, router="sigmoid", num_groups=8,
                  topk_groups=4, route_scale=2.5, expert_bias_update_rate=0.001, shared_hidden_size=16,
                  shared_gate=True, aux_loss="seq", capacity_factor=0.0)
    path = tmp_path / "moe.yaml"
    path.write_text("".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in values.items()))
    assert MoEConfig(**values) == MoEConfig.from_yaml(str(path)) == MoEConfig.from_dict(MoEConfig(**values).to_dict())


@pytest.mark.parametrize("changes, field, value, allowed", [
    (dict(expert_bias_update_rate=-0.1), "expert_bias_update_rate", -0.1, ">= 0.0"),
    (dict(expert_bias_update_rate=math.nan), "expert_bias_update_rate", math.nan, "finite"),
    (dict(expert_bias_update_rate="0.1"), "expert_bias_update_rate", "0.1", "finite number"),
    (dict(num_groups=0), "num_groups", 0, ">= 1"),
    (dict(num_groups=3), "num_groups", 3, "must divide num_experts=8"),
    (dict(num_groups=2.0), "num_groups", 2.0, "integer"),
    (dict(topk_groups=0), "topk_groups", 0, ">= 1"),
    (dict(num_groups=4, topk_groups=5), "topk_groups", 5, "between 1 and num_groups=4"),
    (dict(num_groups=4, topk_groups=1, top_k=3), "top_k", 3, "at most topk_groups * num_experts / num_groups = 2"),
    (dict(route_scale=0.0), "route_scale", 0.0, "finite number > 0"),
    (dict(route_scale=-1.0), "route_scale", -1.0, "finite number > 0"),
    (dict(route_scale=math.inf), "route_scale", math.inf, "finite number > 0"),
    (dict(route_scale=True), "route_scale", True, "finite number > 0"),
    (dict(shared_hidden_size=-1), "shared_hidden_size", -1, ">= 0"),
    (dict(shared_hidden_size=16, shared_gate="yes"), "shared_gate", "yes", "true or false"),
    (dict(shared_gate=True), "shared_gate", True, "shared_hidden_size > 0"),
    (dict(aux_loss="sequence"), "aux_loss", "sequence", "'gshard', 'switch', 'none', 'seq'"),
])
def test_invalid_values_name_field_value_and_allowed(changes, field, value, allowed):
    with pytest.raises(ValueError) as error:
        MoEConfig(**{**BASE, **changes})
    message = str(error.value)
    assert f"{field}={value!r}" in message and allowed in message


def test_top_k_may_fill_the_chosen_groups_exactly():
    assert MoEConfig(**{**BASE, "num_groups": 4, "topk_groups": 2, "top_k": 4}).top_k == 4
    assert MoEConfig(**{**BASE, "num_groups": 8, "topk_groups": 8, "top_k": 8}).top_k == 8
