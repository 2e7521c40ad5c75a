"""Registries of extension points: built-ins by name, user code by import path ``module.path:NAME``.

Security note: resolving an import path imports and runs the named module, i.e. user code with the
permissions of the Tandem process. Only put import paths you trust in a recipe.

`Registry` holds plain callables (``reward: math``, a generate function). `SpecRegistry` holds *specs*:
a frozen record of a function plus what its caller must know about it (its settings class, flags such
as ``uses_groups``), which is how the advantage estimators and policy losses of `tandem.core` are
registered. `build_options` turns a plug-in's ``options:`` mapping from a recipe into its settings
dataclass. Standard library only: `tandem.core` uses it, and `tandem.plugins` re-exports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, Protocol, TypeVar

__all__ = [
    "PluginError",
    "Registry",
    "SpecRegistry",
    "build_options",
    "check_arity",
    "load_callable",
    "load_object",
]

F = TypeVar("F", bound=Callable[..., Any])


class PluginError(ValueError):
    """A plugin path that cannot be imported or does not fit its extension point."""


def _bad_path(what: str, spec: Any) -> PluginError:
    return PluginError(f"{what}: {spec!r} is not an import path of the form 'module.path:function'")


def load_object(spec: str, *, what: str = "plugin") -> Any:
    """Import ``module.path:attr`` (attr may be dotted) and return the attribute, unchecked."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise _bad_path(what, spec)
    mod_name, attr_path = spec.split(":")
    if not mod_name or not attr_path:
        raise _bad_path(what, spec)
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
    return obj


def load_callable(
    spec: str, *, what: str = "plugin", required_params: int | None = None
) -> Callable[..., Any]:
    """Import ``module.path:attr`` (attr may be dotted) and check it is callable.

    ``required_params``, when given, is the number of positional arguments the extension point will
    pass; a callable that cannot accept exactly that many is rejected now, not at first use.
    """
    obj = load_object(spec, what=what)
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


class _Spec(Protocol):
    fn: Callable[..., Any]
    config: type | None


S = TypeVar("S", bound=_Spec)


class SpecRegistry(Generic[S]):
    """Specs of one extension point by name; an import path ``module.path:NAME`` names a user's spec.

    A spec is a record of type ``spec_type`` with at least ``fn`` (called with ``required_params``
    positional arguments) and ``config`` (its settings dataclass, or None). Both are checked when a
    spec is registered or loaded, so a wrong one fails at start-up, naming the value.
    """

    def __init__(self, kind: str, spec_type: type[S], *, required_params: int) -> None:
        self.kind = kind
        self.spec_type = spec_type
        self.required_params = required_params
        self._items: dict[str, S] = {}

    def add(self, name: str, spec: S) -> S:
        """Register ``spec`` under ``name`` (a name has no ``:``, so it never reads as a path)."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        if not name or ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must be non-empty and contain no ':'")
        self._items[name] = self._check(spec, repr(name))
        return spec

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def resolve(self, name_or_path: str) -> S:
        """A registered name, or a ``module.path:NAME`` import path (imported and checked now)."""
        if name_or_path in self._items:
            return self._items[name_or_path]
        if isinstance(name_or_path, str) and ":" in name_or_path:
            return self._check(load_object(name_or_path, what=self.kind), repr(name_or_path))
        raise PluginError(
            f"unknown {self.kind} {name_or_path!r} (choose one of: {', '.join(self.names())}; "
            f"or an import path 'module.path:NAME' naming a spec, {self.spec_type.__name__})"
        )

    def _check(self, spec: Any, label: str) -> S:
        kind, want = self.kind, self.spec_type.__name__
        if not isinstance(spec, self.spec_type):
            raise PluginError(
                f"{kind} {label} is of type {type(spec).__name__}; expected {want}(fn=..., ...)"
            )
        if not callable(spec.fn):
            raise PluginError(f"{kind} {label}: fn is a {type(spec.fn).__name__}, not a callable")
        check_arity(spec.fn, self.required_params, name=f"{kind} {label}: fn")
        if spec.config is not None and not (
            isinstance(spec.config, type) and dataclasses.is_dataclass(spec.config)
        ):
            raise PluginError(f"{kind} {label}: config must be a dataclass type or None, got {spec.config!r}")
        return spec


# -- a plug-in's own settings ---------------------------------------------------------------------


def build_options(cls: type | None, value: Any, *, owner: str) -> Any:
    """The settings of a plug-in from its ``options:`` recipe value, as an instance of ``cls``.

    ``value`` is a mapping from the recipe, an instance of ``cls`` already, or None (``cls``'s
    defaults). Keys and simple field types (bool, int, float, str, Literal, ``X | None``) are checked
    here; ``cls.__post_init__`` may check more by raising ``ValueError``. ``cls`` None means the
    plug-in takes no settings: any option is an error. Errors name ``options.<key>`` and ``owner``.
    """
    if cls is None:
        if value:
            raise ValueError(f"{owner} takes no options, got {value!r}")
        return None
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(f"options of {owner} must be a mapping, got {type(value).__name__} {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in value:
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            valid = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"unknown key 'options.{k}' of {owner} (valid keys: {valid}){hint}")
    for name, f in fields.items():
        if (
            name not in value
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ValueError(f"missing required key 'options.{name}' of {owner}")
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: leave the values unchecked
        hints = {}
    kwargs = {k: _check_option(v, hints.get(k, Any), f"options.{k}", owner) for k, v in value.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"options of {owner}: {e}") from None


def _check_option(value: Any, tp: Any, key: str, owner: str) -> Any:
    """``value`` checked against a simple field type (ints widen to float); other types pass as given."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _check_option(value, a, key, owner)
            except ValueError:
                pass
        raise ValueError(f"{key} of {owner}: {value!r} does not match {tp}")
    if origin is Literal:
        if value in args:
            return value
        raise ValueError(f"{key} of {owner}: {value!r} is not a valid choice (choose one of: "
                         f"{', '.join(map(str, args))})")  # fmt: skip
    checks: dict[Any, tuple[Callable[[Any], bool], str]] = {
        bool: (lambda v: isinstance(v, bool), "true or false"),
        int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
        float: (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
        str: (lambda v: isinstance(v, str), "a string"),
    }
    if tp not in checks:
        return value
    ok, expected = checks[tp]
    if not ok(value):
        raise ValueError(f"{key} of {owner}: expected {expected}, got {value!r}")
    return float(value) if tp is float else value
