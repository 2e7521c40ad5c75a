"""Import-path plugins: ``module.path:function`` strings resolved and checked at start-up.

Security note: resolving a plugin imports and runs the named module, i.e. user code with the
permissions of the Tandem process. Only put import paths you trust in a recipe.

Registries hold the built-ins of one extension point (``advantage: grpo``, ``reward: math``); a
config value is either a registered name or an import path, and `resolve` handles both.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PluginError", "Registry", "load_callable"]

F = TypeVar("F", bound=Callable[..., Any])


class PluginError(ValueError):
    """A plugin path that cannot be imported or does not fit its extension point."""


def load_callable(
    spec: str, *, what: str = "plugin", required_params: int | None = None
) -> Callable[..., Any]:
    """Import ``module.path:attr`` (attr may be dotted) and check it is callable.

    ``required_params``, when given, is the number of positional arguments the extension point will
    pass; a callable that cannot accept exactly that many is rejected now, not at first use.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise PluginError(f"{what}: {spec!r} is not an import path of the form 'module.path:function'")
    mod_name, attr_path = spec.split(":")
    if not mod_name or not attr_path:
        raise PluginError(f"{what}: {spec!r} is not an import path of the form 'module.path:function'")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is reported the same way
        raise PluginError(
            f"{what}: cannot import module '{mod_name}' of {spec!r}: {type(e).__name__}: {e}"
        ) from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what}: module '{mod_name}' has no attribute '{attr_path}' ({spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{what}: {spec!r} is a {type(obj).__name__}, not a callable")
    if required_params is not None:
        check_arity(obj, required_params, name=f"{what} {spec!r}")
    return obj


def check_arity(fn: Callable[..., Any], n: int, *, name: str) -> None:
    """Raise `PluginError` unless ``fn`` accepts exactly ``n`` positional arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    try:
        sig.bind(*([None] * n))
    except TypeError as e:
        raise PluginError(f"{name}: must accept {n} positional argument(s) {sig}: {e}") from None


class Registry(Generic[F]):
    """Named built-ins of one extension point, plus import paths for user code."""

    def __init__(self, kind: str, *, required_params: int | None = None) -> None:
        self.kind = kind
        self.required_params = required_params
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def resolve(self, name_or_path: str) -> F:
        """A registered name, or a ``module:function`` import path (imported and checked now)."""
        if name_or_path in self._items:
            return self._items[name_or_path]
        if ":" in name_or_path:
            return load_callable(name_or_path, what=self.kind, required_params=self.required_params)  # type: ignore[return-value]
        raise PluginError(
            f"unknown {self.kind} {name_or_path!r} (choose one of: {', '.join(self.names())}, "
            "or give an import path 'module:function')"
        )
