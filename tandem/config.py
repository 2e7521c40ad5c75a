"""Config system: YAML recipes plus ``dotted.key=value`` overrides, validated against dataclasses.

Every component owns a small ``@dataclass(kw_only=True)`` config. A run's config is a tree of them;
`load_config` reads a recipe, applies overrides and builds the tree, checking every key and type.
Anything wrong raises one `ConfigError` whose message names the key and what would be valid; the CLI
prints it as one line and exits with code 2.

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``pathlib.Path``, ``Literal[...]``,
``enum.Enum`` subclasses, nested dataclasses, ``X | None``, ``list[X]``, ``tuple[X, ...]``,
``dict[str, X]`` and ``Any``. A dataclass may validate further in ``__post_init__`` by raising
``ValueError``; the message is reported with the key path of that dataclass. A dataclass whose keys
depend on its values (the engine sections: ``inference.<engine name>``) builds itself with a classmethod
``from_config_dict(data, path)`` and writes itself back with ``to_config_dict()``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "ConfigError", "apply_overrides", "convert", "from_dict", "load_config", "save_config", "to_dict", "unknown_key",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem, described in one line that names the key."""


def _key(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert/check ``value`` against type ``tp``; ``key`` names it in errors."""
    if tp is Any or tp is typing.Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: null is not allowed (expected {_type_name(tp)})")
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for a in non_none:
            try:
                return _convert(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(non_none) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}: {value!r} matches none of {' | '.join(_type_name(a) for a in non_none)}")
    if origin is typing.Literal:
        if value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args)):
            return value
        raise ConfigError(
            f"{key}: {value!r} is not a valid choice (choose one of: {', '.join(map(str, args))})"
        )
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{key}: expected a mapping for {tp.__name__}, got {type(value).__name__} {value!r}"
            )
        return from_dict(tp, value, path=key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in tp)
            raise ConfigError(f"{key}: {value!r} is not a valid choice (choose one of: {choices})") from None
    if origin in (list, Sequence, tuple):
        if value is None or isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _convert(v, a, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    if tp is Path:
        if isinstance(value, str | os.PathLike):
            return Path(value)
        raise ConfigError(f"{key}: expected a path, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {_type_name(tp)}")


def convert(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked and converted to the (resolved) type ``tp``; ``key`` names it in errors."""
    return _convert(value, tp, key)


def unknown_key(path: str, key: str, valid: Sequence[str]) -> ConfigError:
    """The error for ``key`` not among ``valid`` (with a did-you-mean hint)."""
    close = difflib.get_close_matches(str(key), list(valid), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{_key(path, str(key))}' (valid keys: {', '.join(sorted(valid))}){hint}")


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types recursively."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    custom = getattr(cls, "from_config_dict", None)
    if custom is not None:
        try:
            return custom(data, path=path)
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            raise ConfigError(_located(path, cls, e)) from None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in data:
        if k not in fields:
            raise unknown_key(path, str(k), list(fields))
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], _key(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{_key(path, name)}'")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(_located(path, cls, e)) from None


def _located(path: str, cls: type, error: Exception) -> str:
    """A component's own check, placed in the config: ``steps=0 must be >= 1`` raised by the ``run`` section
    reads ``run.steps=0 must be >= 1``, the key as an override or a recipe names it; any other message is
    prefixed with the section (``eval: ...``)."""
    message = str(error)
    field = message.split("=", 1)[0]
    if path and "=" in message and field.isidentifier() and dataclasses.is_dataclass(cls) and \
            field in {f.name for f in dataclasses.fields(cls)}:
        return f"{path}.{message}"
    return f"{path or cls.__name__}: {message}"


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like dotted.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = _load_yaml_strict(raw, f"override {item!r}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[: i + 1])}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def _check_duplicate_keys(node: yaml.Node, path: str, where: str, seen_nodes: set[int]) -> None:
    """Raise `ConfigError` for a mapping that names a key twice (YAML would keep the last one silently)."""
    if id(node) in seen_nodes:  # an alias of a node already checked (or a recursive one)
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges, it does not repeat
                _check_duplicate_keys(value_node, path, where, seen_nodes)
                continue
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            line = key_node.start_mark.line + 1
            if key in first:
                raise ConfigError(
                    f"{where}: duplicate key '{_key(path, key)}' at line {line} (first at line {first[key]}); "
                    "YAML would keep only the last one"
                )
            first[key] = line
            _check_duplicate_keys(value_node, _key(path, key), where, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, f"{path}[{i}]", where, seen_nodes)


def _load_yaml_strict(text: str, where: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate mapping keys."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, "", where, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The recipe at ``path`` as a dict; a missing file, invalid YAML, a duplicate key or a top level
    that is not a mapping raise `ConfigError` (with the line where YAML knows it)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe file not found: {p}")
    try:
        data = _load_yaml_strict(p.read_text(), str(p)) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{p}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a recipe must be a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(cls: type[T], recipe: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Read a YAML recipe (optional), apply overrides and build ``cls``; raises `ConfigError`."""
    data = read_yaml(recipe) if recipe is not None else {}
    apply_overrides(data, overrides)
    return from_dict(cls, data)


def to_dict(cfg: Any) -> Any:
    """A plain YAML-safe structure (enums by value, paths and tuples as str and lists)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        if hasattr(cfg, "to_config_dict"):
            return to_dict(cfg.to_config_dict())
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, Path):
        return str(cfg)
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {str(k): to_dict(v) for k, v in cfg.items()}
    return cfg


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML, atomically (temp file + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
