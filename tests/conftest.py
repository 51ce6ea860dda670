"""The tests' shared code is the helpers package (tests/helpers/, on the path through pytest.ini's pythonpath);
its plugin holds the fixtures and hooks every test gets. Asserts inside helpers are rewritten like a test's."""
import pytest

pytest.register_assert_rewrite("helpers")
pytest_plugins = ["helpers.plugin"]
