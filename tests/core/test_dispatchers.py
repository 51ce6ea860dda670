"""How a layer picks its dispatcher: every module of moe_plugin/dispatchers/ is imported, and the dispatcher of
highest priority that applies to the layer is built (so a new dispatcher is one new file)."""
import importlib
import inspect
import pkgutil

import pytest
import torch

import moe_plugin.dispatchers as package
from moe_plugin.dispatchers import Dispatcher, LocalDispatcher
from helpers.reference import assert_matches_reference, make_layer


def test_registry_holds_every_dispatcher_of_the_package():
    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found |= {c for _, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, Dispatcher) and c is not Dispatcher and c.__module__ == module.__name__}
    assert found and found == set(Dispatcher.registry)


def fake_dispatcher(name, priority, applies):
    """A dispatcher class as a new file of the package would define it (it registers itself); it runs the
    local dispatcher's path, so the layer must still match the reference when it is chosen."""
    return type(name, (LocalDispatcher,), dict(
        __module__=f"{package.__name__}.{name.lower()}", priority=priority,
        applies=classmethod(lambda cls, layer: applies)))


@pytest.fixture
def registry():
    before = list(Dispatcher.registry)
    yield Dispatcher.registry
    Dispatcher.registry[:] = before


def test_a_single_process_layer_gets_the_local_dispatcher():
    layer = make_layer(torch.float64)
    assert type(layer.make_dispatcher()) is LocalDispatcher


def test_a_new_dispatcher_of_higher_priority_that_applies_is_chosen(registry):
    higher = fake_dispatcher("Higher", 20, True)
    fake_dispatcher("Excluded", 30, False)
    layer = make_layer(torch.float64, capacity_factor=0.5)
    assert type(layer.make_dispatcher()) is higher
    layer._dispatcher = layer.make_dispatcher()
    assert_matches_reference(layer, torch.randn(37, 12, dtype=torch.float64), 1e-10)


def test_two_dispatchers_that_apply_at_one_priority_are_an_error(registry):
    fake_dispatcher("TieA", 20, True)
    fake_dispatcher("TieB", 20, True)
    with pytest.raises(ValueError, match="TieA.*TieB.*priority 20"):
        make_layer(torch.float64)


def test_a_class_outside_the_package_is_not_registered(registry):
    class Elsewhere(LocalDispatcher):
        priority = 99
    assert Elsewhere not in Dispatcher.registry
    assert type(make_layer(torch.float64).make_dispatcher()) is LocalDispatcher
