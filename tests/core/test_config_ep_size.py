"""The ep_size messages suggest only sizes that are then accepted: a refused MoEConfig.ep_size (it does not divide the
number of processes, or cannot hold num_experts) lists exactly the sizes for which building the layer's groups
succeeds at that world size, found by trying every size from 1 to the world size (build_groups on a stand-in
torch.distributed of W ranks, seen from rank 0)."""
import ast
import re

import pytest

from moe_plugin import MoEConfig
from moe_plugin.parallel import groups


class Dist:
    """torch.distributed as rank 0 of world processes sees it (groups are their rank lists)."""

    def __init__(self, world):
        self.world = world

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return self.world if group is None else len(group)

    def get_rank(self, group=None):
        return 0 if group is None else group.index(0)

    def new_group(self, ranks):
        return list(ranks)

    def get_process_group_ranks(self, group):
        return list(group)


def build(config: MoEConfig):
    """What MoELayer(config) runs first: the checks and the groups of its ep_size."""
    return groups.build_groups(config.num_experts, config.hidden_size, config.ep_size)


def accepted(world, E, H):
    """Every ep_size for which the groups build at this world size (brute force)."""
    out = []
    for ep_size in range(1, world + 1):
        try:
            build(MoEConfig(model_dim=8, hidden_size=H, num_experts=E, top_k=1, ep_size=ep_size))
        except ValueError:
            continue
        out.append(ep_size)
    return out


@pytest.mark.parametrize("world, E, H, ep_size", [
    (3, 4, 16, 2),    # the issue's: 2 does not divide 3 processes
    (3, 4, 16, 3),    # 3 divides the world, cannot hold 4 experts
    (6, 4, 16, 4), (6, 4, 16, 5),
    (8, 2, 8, 3), (8, 2, 6, 8),      # 8 ranks for 2 experts: slices of 4, but 6 hidden units do not split in 4
    (12, 6, 9, 4), (12, 6, 9, 12),
    (4, 3, 16, 2),
])
def test_every_suggested_ep_size_is_accepted(world, E, H, ep_size, monkeypatch):
    monkeypatch.setattr(groups, "dist", Dist(world))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = MoEConfig(model_dim=8, hidden_size=H, num_experts=E, top_k=1, ep_size=ep_size)
    with pytest.raises(ValueError) as caught:
        build(config)
    message = str(caught.value)
    assert f"ep_size={ep_size}" in message
    suggested = ast.literal_eval(re.findall(r"\[[0-9, ]*\]", message)[-1])
    assert suggested == accepted(world, E, H), message
    assert ep_size not in suggested


def test_suggestions_without_the_layer_stay_the_divisors():
    """check_ep_size without num_experts (a host's setting checked before any layer exists) lists the divisors."""
    with pytest.raises(ValueError, match=r"one of \[1, 2, 3, 6\]"):
        groups.check_ep_size(4, "x.ep_size", world_size=6)
    with pytest.raises(ValueError, match=r"one of \[1, 2\]"):
        groups.check_ep_size(4, "x.ep_size", world_size=6, num_experts=4, hidden_size=16)
    with pytest.raises(ValueError, match=r"sizes that work on 6 processes: \[1, 2\]"):
        groups.check_sizes(4, 16, 3, processes=6)
