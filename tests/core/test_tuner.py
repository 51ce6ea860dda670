"""The per-load tuner (parallel/tuner.py) on simulated ranks with a mocked clock: each rank's tuner gets
the same gathered counts and the same gathered times, as route_counts' all-gather gives them.

What this module tests (moved here from the README):

- `tests/core/test_tuner.py` simulates ranks on a mocked clock (single process, about 5 s). It checks:
  - different load buckets get their own best setting, and every rank agrees, even when one rank's
    times differ (max over ranks);
  - a slow warm-up call and an outlier trial do not change the winner;
  - a drift re-times the choice and switches it;
  - every N calls the choice is re-timed;
  - the cost model orders and prunes the search; its same-r pruning drops a setting far behind its own
    r but keeps one far behind another r; the model gets each key's rows per rank and all ranks' rows,
    and charges r = 0 for its own rows only;
  - a probe far behind the best is not timed again, close ones get every trial (call counts checked);
  - the time includes a weight-gradient branch that ends after x's gradient;
  - a new key starts from the nearest key's choice;
  - the dictionary survives a state_dict round trip, and a mismatched tag or dtype is ignored with
    a log line;
  - the timing marks add no host synchronization;
  - the config errors name their fields;
  - with replicas it chooses R per load among the counts the layer offers: 0 alone on a flat load, the fastest
    count on a skewed one, reported in its stats and kept through a state_dict round trip.
"""
import logging

import pytest
import torch

from moe_plugin import MoEConfig
from moe_plugin.parallel.tuner import Tuner, load_key, model_seconds

GATHERED = (0, 1, "flat")
EP = (1, 1, "flat")
EP_OVERLAP = (1, 2, "flat")
EP_2DH = (1, 2, "2dh")
CANDIDATES = [GATHERED, EP, EP_OVERLAP, EP_2DH]
SHAPE = dict(ep_size=4, node_size=2, model_dim=8, hidden_size=16, num_experts=4, matrices=2)
SMALL, LARGE = 6, 200          # rows of the largest expert in the two load phases


class Clock:
    """mark() returns the time and moves it on by `tick`: a call's four marks measure 2 * tick."""

    def __init__(self):
        self.now, self.tick, self.reads = 0.0, 0.0, 0

    def mark(self):
        self.reads += 1
        self.now += self.tick
        return self.now

    def seconds(self, start, end):
        return end - start


def counts_with_largest(rows, world=4, experts=4):
    counts_WE = torch.ones(world, experts, dtype=torch.long)
    counts_WE[0, 0] = rows - (world - 1)
    return counts_WE


def flat_cost(setting, rows, shape):
    """A cost model with no opinion: the given order, nothing pruned."""
    return 1.0


class Ranks:
    """W tuners stepping together; seconds(rank, rows, setting) says what a call costs."""

    def __init__(self, seconds, world=3, copies=None, **kwargs):
        """copies(rows): the replica counts offered at a load (a Tuner with replicas=True)."""
        self.clocks = [Clock() for _ in range(world)]
        self.copies, self.offered = copies, []
        self.tuners = [Tuner(CANDIDATES, SHAPE, clock=clock, **{"cost": flat_cost, **kwargs})
                       for clock in self.clocks]
        self.seconds, self.used = seconds, []

    def step(self, rows, train=True, backward=True):
        gathered_W = torch.tensor([tuner.outgoing() for tuner in self.tuners])
        counts_WE = counts_with_largest(rows)
        offer = None if self.copies is None else lambda: self.offered.append(rows) or self.copies(rows)
        chosen = [tuner.choose(counts_WE, gathered_W, torch.float64, measure=train, copies=offer)
                  for tuner in self.tuners]
        assert all(setting == chosen[0] for setting in chosen), chosen
        for rank, (tuner, clock) in enumerate(zip(self.tuners, self.clocks)):
            clock.tick = self.seconds(rank, rows, chosen[0]) / 2
            x = torch.randn(5, 3, requires_grad=True)
            x_in, gate_in = tuner.enter(x, x.sum(1, keepdim=True))
            y = tuner.leave(x_in * gate_in)
            if train and backward:
                y.sum().backward()
        self.used.append(chosen[0])
        return chosen[0]

    def tables(self):
        return [tuner.stats()["tuned_table"] for tuner in self.tuners]


def phase_costs(rank, rows, setting):
    """Small loads: EP_OVERLAP fastest on ranks 0, 1 but slow on rank 2, so EP wins on the max.
    Large loads: GATHERED wins."""
    if rows <= SMALL:
        table = {GATHERED: 5.0, EP: 2.0, EP_OVERLAP: 1.0 if rank < 2 else 4.0, EP_2DH: 3.0}
    else:
        table = {GATHERED: 10.0, EP: 30.0, EP_OVERLAP: 20.0, EP_2DH: 25.0}
    return table[setting]


def test_load_buckets_get_their_own_best_setting_and_every_rank_agrees():
    ranks = Ranks(phase_costs, trials=3)
    for _ in range(30):
        ranks.step(SMALL)
    small, large = load_key(counts_with_largest(SMALL)), load_key(counts_with_largest(LARGE))
    assert ranks.tables()[0] == {small: {"parallel": 1, "overlap_degree": 1, "a2a": "flat"}}
    for _ in range(30):
        ranks.step(LARGE)
    tables = ranks.tables()
    assert all(table == tables[0] for table in tables)
    assert tables[0][large] == {"parallel": 0, "overlap_degree": 1, "a2a": "flat"}
    assert ranks.used[-5:] == [GATHERED] * 5 and ranks.step(SMALL) == EP      # the dictionary, no re-search
    assert ranks.tuners[0].stats()["tuned"] == {"key": small, "choice": {"parallel": 1, "overlap_degree": 1,
                                                                          "a2a": "flat"}}


@pytest.mark.parametrize("trials, slow_call", [(1, 1), (3, 4)], ids=["warm-up dropped", "median kept"])
def test_the_best_setting_wins_despite_its_warm_up_and_an_outlier(trials, slow_call):
    """EP is the fastest, but its first call (a new communicator) or one of its trials is slow."""
    calls = {}

    def costs(rank, rows, setting):
        calls[rank, setting] = calls.get((rank, setting), 0) + 1
        base = {GATHERED: 3.0, EP: 1.0, EP_OVERLAP: 2.0, EP_2DH: 4.0}[setting]
        return base + (50.0 if setting == EP and calls[rank, setting] == slow_call else 0.0)

    ranks = Ranks(costs, world=2, trials=trials)
    for _ in range(30):
        ranks.step(SMALL)
    assert ranks.tuners[0].table == {load_key(counts_with_largest(SMALL)): EP}


def test_calls_without_backward_do_not_stall_the_search():
    ranks = Ranks(lambda rank, rows, setting: {GATHERED: 3.0, EP: 2.0, EP_OVERLAP: 1.0, EP_2DH: 4.0}[setting],
                  world=2, trials=2)
    for step in range(60):
        ranks.step(SMALL, backward=step % 3 != 1)       # a forward whose backward never comes is not measured
    assert ranks.tuners[0].table == {load_key(counts_with_largest(SMALL)): EP_OVERLAP}


def test_a_drift_re_times_the_choice_and_switches():
    slow_ep = []

    def costs(rank, rows, setting):
        if setting == EP and slow_ep:
            return 9.0
        return {GATHERED: 5.0, EP: 1.0, EP_OVERLAP: 2.0, EP_2DH: 3.0}[setting]

    ranks = Ranks(costs, world=2, trials=3, drift=0.5, retune_every=10_000)
    key = load_key(counts_with_largest(SMALL))
    for _ in range(30):
        ranks.step(SMALL)
    assert ranks.tuners[0].table[key] == EP
    slow_ep.append(True)
    for _ in range(30):
        ranks.step(SMALL)
    assert ranks.tuners[1].table[key] == EP_OVERLAP and ranks.used[-1] == EP_OVERLAP


def test_every_n_calls_the_choice_is_re_timed():
    ranks = Ranks(lambda rank, rows, setting: {GATHERED: 5.0, EP: 1.0, EP_OVERLAP: 2.0, EP_2DH: 3.0}[setting],
                  world=2, trials=2, retune_every=6)
    for _ in range(60):
        ranks.step(SMALL)
    explored = [i for i in range(1, len(ranks.used)) if ranks.used[i] != EP and ranks.used[i - 1] == EP]
    assert len(explored) >= 3 and ranks.tuners[0].table == {load_key(counts_with_largest(SMALL)): EP}


def test_a_new_key_starts_from_the_nearest_known_choice_and_the_cost_model_prunes():
    def model(setting, rows, shape):          # says 2DH is hopeless: it is never timed
        return 100.0 if setting == EP_2DH else {GATHERED: 3.0, EP: 1.0, EP_OVERLAP: 2.0}[setting]

    ranks = Ranks(lambda rank, rows, setting: {GATHERED: 1.0, EP: 2.0, EP_OVERLAP: 3.0, EP_2DH: 0.1}[setting],
                  world=2, trials=2, cost=model, prune=4.0)
    for _ in range(20):
        ranks.step(SMALL)
    assert EP_2DH not in ranks.used and ranks.used[:3] == [EP, EP, EP]     # the model's order
    assert ranks.tuners[0].table == {load_key(counts_with_largest(SMALL)): GATHERED}
    assert ranks.step(SMALL + 3) == GATHERED                                # next key: nearest choice first


def test_a_probe_far_behind_the_best_is_not_timed_again_and_close_ones_get_every_trial():
    """Once EP has its median, each other setting gets one probe call (plus its warm-up): past reject x the
    best it is dropped, within it gets all its trials. The slow ones cost 2 calls each instead of 4."""
    costs = {GATHERED: 3.0, EP: 1.0, EP_OVERLAP: 1.2, EP_2DH: 2.5}
    ranks = Ranks(lambda rank, rows, setting: costs[setting], world=2, trials=3, reject=1.5,
                  cost=lambda setting, rows, shape: {EP: 1.0, EP_OVERLAP: 1.1, GATHERED: 1.15, EP_2DH: 1.2}[setting])
    for _ in range(30):
        ranks.step(SMALL)
    search = ranks.tuners[0].searches[load_key(counts_with_largest(SMALL))]
    assert ranks.tuners[0].table == {load_key(counts_with_largest(SMALL)): EP}
    assert {s: len(t) for s, t in search.samples.items()} == {EP: 3, EP_OVERLAP: 3, GATHERED: 1, EP_2DH: 1}
    used = {s: ranks.used.count(s) for s in CANDIDATES}
    assert used[GATHERED] == used[EP_2DH] == 2 and used[EP_OVERLAP] == 4     # warm-up + probe; warm-up + 3


def test_the_model_drops_settings_far_behind_their_own_r_and_sees_each_ranks_own_rows():
    """prune_same_r compares settings of one r only (same rows and weights moved): EP_2DH, 3x EP in the model,
    is never timed, while GATHERED, 3x EP too but another r, is. The model gets the most rows one rank routes
    and all ranks' rows."""
    seen = []

    def model(setting, rows, shape):
        seen.append((shape["local_rows"], shape["total_rows"]))
        return {GATHERED: 3.0, EP: 1.0, EP_OVERLAP: 1.2, EP_2DH: 3.0}[setting]

    ranks = Ranks(lambda rank, rows, setting: {GATHERED: 1.0, EP: 2.0, EP_OVERLAP: 2.1, EP_2DH: 0.1}[setting],
                  world=2, trials=2, cost=model, prune=100.0, prune_same_r=2.0)
    for _ in range(20):
        ranks.step(LARGE)
    assert EP_2DH not in ranks.used and GATHERED in ranks.used
    assert ranks.tuners[0].table == {load_key(counts_with_largest(LARGE)): GATHERED}
    assert set(seen) == {(int(counts_with_largest(LARGE).sum(1).max()), int(counts_with_largest(LARGE).sum()))}


def test_the_cost_model_charges_r0_for_its_own_rows_only():
    shape = {**SHAPE, "model_dim": 64, "hidden_size": 64}
    skewed = model_seconds(GATHERED, 4000, {**shape, "local_rows": 1000})
    assert skewed < model_seconds(GATHERED, 4000, shape)
    assert skewed == pytest.approx(model_seconds(GATHERED, 1000, shape))
    def ep(**rows):
        return model_seconds(EP, 4000, {**shape, **rows})
    assert ep(local_rows=1000, total_rows=4000) == ep(local_rows=500, total_rows=4000)    # computes what it gets
    assert ep(local_rows=1000, total_rows=16000) > ep(local_rows=1000, total_rows=4000)   # GLOO_HERE: 2 cores


def test_the_time_includes_the_weights_gradient_reduction_that_ends_after_x_gets_its_gradient():
    """r = 0 and gathered slices sum the weights' gradients over ranks (an all-reduce) on a branch of the
    backward that can end after x's gradient: the end mark waits for the weights' gradients."""
    clock = Clock()
    tuner = Tuner(CANDIDATES, SHAPE, clock=clock)
    weight = torch.randn(3, requires_grad=True)

    class SlowReduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, grad):
            clock.now += 10.0                   # the all-reduce of the gathered gradients
            return grad

    gathered = SlowReduce.apply(weight)        # made before the path's entry: it runs after x's gradient
    tuner.choose(counts_with_largest(SMALL), None, torch.float64, measure=True)
    x = torch.randn(4, 3, requires_grad=True)
    x_in, gate_in = tuner.enter(x, x.sum(1, keepdim=True), [weight])
    tuner.leave(x_in * gate_in * gathered).sum().backward()
    assert tuner._done.seconds() >= 10.0 and weight.grad is not None


def test_the_dictionary_round_trips_through_state_dict(caplog):
    ranks = Ranks(phase_costs, world=2, trials=2)
    for rows in [SMALL] * 20 + [LARGE] * 20:
        ranks.step(rows)
    saved = ranks.tuners[0].state_dict()
    assert len(saved["_extra_state"]["table"]) == 2

    resumed = Tuner(CANDIDATES, SHAPE, clock=Clock())
    resumed.load_state_dict(saved)
    resumed.choose(counts_with_largest(LARGE), None, torch.float64, measure=False)
    assert resumed.stats()["tuned_table"] == ranks.tables()[0] and resumed.searches[load_key(
        counts_with_largest(LARGE))].queue == []                            # nothing to explore again

    for shape, dtype in [({**SHAPE, "ep_size": 8}, torch.float64), (SHAPE, torch.float32)]:
        other = Tuner(CANDIDATES, shape, clock=Clock())
        with caplog.at_level(logging.WARNING, logger="moe_plugin"):
            other.load_state_dict(saved)
            other.choose(counts_with_largest(LARGE), None, dtype, measure=False)
        assert other.stats()["tuned_table"] == {} and "ignoring the saved dictionary" in caplog.text
        caplog.clear()


def test_timing_marks_add_no_host_synchronization():
    from helpers.host_syncs import HostSyncs
    clock = Clock()
    tuner = Tuner(CANDIDATES, SHAPE, clock=clock)
    tuner.choose(counts_with_largest(SMALL), None, torch.float64, measure=True)
    x = torch.randn(4, 3, requires_grad=True)
    with HostSyncs() as record:
        x_in, gate_in = tuner.enter(x, x.sum(1, keepdim=True))
        tuner.leave(x_in * gate_in).sum().backward()
    assert record.seen == [] and clock.reads == 4


def test_config_values_name_their_field():
    MoEConfig(model_dim=4, hidden_size=4, parallel="auto_once", overlap_degree="auto_once", a2a="auto")
    with pytest.raises(ValueError, match="parallel='auto' and overlap_degree='auto_once' mix the tuners"):
        MoEConfig(model_dim=4, hidden_size=4, parallel="auto", overlap_degree="auto_once")
    with pytest.raises(ValueError, match="MoEConfig.overlap_degree='adaptive' is invalid: must be \"auto\""):
        MoEConfig(model_dim=4, hidden_size=4, overlap_degree="adaptive")
    with pytest.raises(ValueError, match="MoEConfig.a2a='hier' is invalid: must be one of 'flat', '2dh', 'auto'"):
        MoEConfig(model_dim=4, hidden_size=4, a2a="hier")


def test_with_replicas_it_chooses_r_per_load():
    """The layer offers 0 on the flat (small) load and 0, 2, 4 on the skew (large); 2 copies are fastest there.
    r = 0 (GATHERED) copies nothing: it is tried with R = 0 only."""
    def costs(rank, rows, setting):
        r, d, a2a, R = setting
        assert r >= 1 or R == 0, setting
        if rows <= SMALL:
            return {GATHERED: 5.0, EP: 1.0, EP_OVERLAP: 2.0, EP_2DH: 3.0}[(r, d, a2a)] + R
        return {GATHERED: 10.0, EP: 8.0, EP_OVERLAP: 9.0, EP_2DH: 9.5}[(r, d, a2a)] - {0: 0, 2: 5, 4: 3}[R]

    ranks = Ranks(costs, world=2, trials=2, replicas=True, copies=lambda rows: [0] if rows <= SMALL else [4, 2])
    for rows in [SMALL] * 30 + [LARGE] * 60:
        ranks.step(rows)
    small, large = load_key(counts_with_largest(SMALL)), load_key(counts_with_largest(LARGE))
    assert ranks.offered == [SMALL, SMALL, LARGE, LARGE]  # asked once per key, on each of the 2 ranks
    assert {s[3] for s in ranks.used[:30]} == {0}         # a flat load never copies
    assert {s[3] for s in ranks.used[30:]} >= {0, 2, 4}   # the skew's counts are all timed
    assert ranks.tuners[0].table == {small: EP + (0,), large: EP + (2,)}
    assert ranks.tables()[0][large] == {"parallel": 1, "overlap_degree": 1, "a2a": "flat", "redundant_experts": 2}
    assert ranks.tuners[0].stats()["tuned"]["choice"]["redundant_experts"] == 2

    saved = ranks.tuners[0].state_dict()
    resumed = Tuner(CANDIDATES, SHAPE, clock=Clock(), replicas=True)
    resumed.load_state_dict(saved)
    assert resumed.choose(counts_with_largest(LARGE), None, torch.float64, measure=False) == EP + (2,)
    plain = Tuner(CANDIDATES, SHAPE, clock=Clock())          # tuned without replicas: another tag
    plain.load_state_dict(saved)
    plain.choose(counts_with_largest(LARGE), None, torch.float64, measure=False)
    assert plain.table == {}
