"""Import-path plugins are resolved and checked at start-up, with clear errors."""

from __future__ import annotations

import pytest

from tandem.plugins import PluginError, Registry, load_callable


def two_args(a, b):
    return a + b


def test_load_callable_and_arity():
    fn = load_callable("tests.test_plugins:two_args", required_params=2)
    assert fn(1, 2) == 3
    with pytest.raises(PluginError, match="must accept 3 positional argument"):
        load_callable("tests.test_plugins:two_args", required_params=3)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", "is not an import path of the form 'module.path:function'"),
        ("nosuchmod_xyz:f", "cannot import module 'nosuchmod_xyz'"),
        ("tests.test_plugins:missing", "has no attribute 'missing'"),
        ("tests.test_plugins:pytest", "is a module, not a callable"),
    ],
)
def test_load_callable_errors(spec, message):
    with pytest.raises(PluginError, match=message):
        load_callable(spec)


def test_registry_names_and_paths():
    reg: Registry = Registry("reward", required_params=2)

    @reg.register("sum")
    def _sum(a, b):
        return a + b

    assert reg.resolve("sum")(1, 2) == 3
    assert reg.resolve("tests.test_plugins:two_args") is two_args
    with pytest.raises(PluginError, match=r"unknown reward 'nope' \(choose one of: sum"):
        reg.resolve("nope")


def test_plugins_re_exports_the_core_registry():
    """`tandem.core` cannot import `tandem.plugins`; both must be one implementation, one error class."""
    from tandem import plugins
    from tandem.core import registry

    for name in ("PluginError", "Registry", "load_callable", "check_arity"):
        assert getattr(plugins, name) is getattr(registry, name)
