"""RoutingAlarm (moe_plugin/routing_monitor/alarm.py): fires once per layer after `windows` unhealthy windows in a row (the
same expert starved in each, or too many drops in each), names the layer, experts and numbers, re-arms when the layer recovers; a run of
healthy windows, or an interrupted run of unhealthy ones, never fires; bad settings are one-line errors."""
import pytest

from moe_plugin.routing_monitor.alarm import RoutingAlarm


def window(load, dropped=0.0):
    mean = sum(load) / len(load)
    return {"tokens_per_expert": load, "max_load": max(load) / mean, "dropped_fraction": dropped}


def test_a_starved_expert_fires_once_after_the_set_windows():
    alarm = RoutingAlarm(min_share=0.25, max_dropped=0.5, windows=3)
    starved = window([40, 39, 1, 0])            # mean 20: experts 2 (5%) and 3 (0%)
    assert alarm.check({"a": starved, "b": window([20, 20, 20, 20])}) == []
    assert alarm.check({"a": starved, "b": window([20, 20, 20, 20])}) == []
    messages = alarm.check({"a": starved, "b": window([20, 20, 20, 20])})
    assert messages == ["moe_plugin routing alarm: MoE layer a: experts 2 (5.0%), 3 (0.0%) got under 25% of the mean "
                        "load (busiest expert 2.00x the mean), in each of the last 3 logging windows"]
    assert alarm.check({"a": starved}) == []     # still unhealthy: not repeated
    assert alarm.check({"a": window([20, 20, 20, 20])}) == []
    for _ in range(2):
        assert alarm.check({"a": starved}) == []
    assert len(alarm.check({"a": starved})) == 1    # re-armed after the recovery


def test_drops_fire_and_an_interrupted_run_does_not():
    alarm = RoutingAlarm(min_share=0.0, max_dropped=0.1, windows=2)
    assert alarm.check({"x": window([5, 5], dropped=0.3)}) == []
    assert alarm.check({"x": window([5, 5], dropped=0.05)}) == []
    assert alarm.check({"x": window([5, 5], dropped=0.3)}) == []
    assert alarm.check({"x": window([5, 5], dropped=0.3)}) == [
        "moe_plugin routing alarm: MoE layer x: dropped fraction 30.0% over 10%, in each of the last 2 logging windows"]


def test_it_takes_the_same_expert_starved_in_every_window():
    """Expert 0 starved, then expert 1, then 0 again: no expert was starved in 2 windows in a row, so no alarm; the
    experts that were are named, and only they."""
    alarm = RoutingAlarm(min_share=0.2, max_dropped=0.5, windows=2)
    assert alarm.check({"a": window([0, 30, 30, 30])}) == []
    assert alarm.check({"a": window([30, 0, 30, 30])}) == []
    assert alarm.check({"a": window([0, 30, 30, 30])}) == []
    assert alarm.check({"a": window([0, 1, 40, 40])}) == [
        "moe_plugin routing alarm: MoE layer a: experts 0 (0.0%) got under 20% of the mean load (busiest expert "
        "1.98x the mean), in each of the last 2 logging windows"]     # expert 1 (4.9%) starved once only
    assert alarm.layers_in_alarm() == 1
    assert alarm.check({"a": window([30, 30, 30, 30])}) == [] and alarm.layers_in_alarm() == 0


@pytest.mark.parametrize("kwargs, words", [(dict(min_share=1.0), "min_share must be in [0, 1)"),
                                           (dict(min_share="0.1"), "min_share must be in [0, 1) (a share of the "
                                                                   "mean load), got '0.1'"),
                                           (dict(max_dropped=-0.1), "max_dropped must be in [0, 1)"),
                                           (dict(max_dropped=True), "max_dropped must be in [0, 1) (a fraction), "
                                                                    "got True"),
                                           (dict(windows=0), "windows must be an integer >= 1, got 0"),
                                           (dict(windows=2.5), "windows must be an integer >= 1, got 2.5")])
def test_bad_settings_are_one_line_errors(kwargs, words):
    with pytest.raises(ValueError, match=".*") as error:
        RoutingAlarm(**kwargs)
    assert words in str(error.value) and "\n" not in str(error.value)
