"""Typed configuration: frozen dataclasses filled from TOML plus dotted overrides.

Each component owns a small frozen dataclass next to its code; a job config composes them.
This module only knows how to turn nested dicts into those dataclasses, strictly:

    >>> @dataclass(frozen=True)
    ... class Opt:
    ...     lr: float = 1e-3
    >>> @dataclass(frozen=True)
    ... class Job:
    ...     opt: Opt = Opt()
    >>> load_config(Job, overrides=["--opt.lr=3e-4"]).opt.lr
    0.0003

Unknown keys are errors that name the key and list the valid ones; values are checked
against the field types (ints are accepted for floats, nothing else is coerced).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import tomli_w

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it and says how to fix it."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, where)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} does not fit {_type_name(tp)} ({'; '.join(errors)})")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        _, vt = get_args(tp) or (str, Any)
        return {str(k): _coerce(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Builds dataclass ``cls`` from a nested dict; unknown keys are a ConfigError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(
            f"unknown config key '{key}'; valid keys{' under ' + where if where else ''}: "
            f"{', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # (ValueError: a __post_init__ check)
        raise ConfigError(f"{where or cls.__name__}: {e}") from e
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain nested dict (tuples become lists; None values are dropped)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = to_dict(getattr(obj, f.name))
            if v is not None:
                out[f.name] = v
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """'--train.lr=3e-4' -> (['train', 'lr'], 0.0003). Values parse as TOML, else as strings."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body:
        raise ConfigError(f"override '{text}' must look like --section.key=value")
    key, raw = body.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a table")
        node[path[-1]] = value
    return data


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep-merges ``top`` into a copy of ``base``."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = (),
    flags: dict[str, Any] | None = None,
) -> T:
    """Reads ``path`` (TOML, optional), merges ``flags`` (a nested dict: values of command-line
    flags that are aliases of keys, e.g. ``{"serve": {"port": 50052}}``) over it, applies
    ``--a.b=v`` overrides last, builds ``cls``. Unknown keys, the file's included, are errors."""
    data = read_toml(config_path(path)) if path is not None else {}
    if flags:
        data = merge(data, flags)
    return from_dict(cls, apply_overrides(data, overrides))


def read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's values; ``extends = "other.toml"`` (beside it, or shipped with genrec)
    starts from that file's values, which this file's then override."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: extends must be a file name")
    sibling = path.parent / base
    base_path = sibling if sibling.exists() else config_path(base)
    if base_path.resolve() in seen:
        raise ConfigError(f"{path}: extends {base} again (a cycle)")
    return merge(read_toml(base_path, (*seen, path.resolve())), data)


def config_path(path: str | Path) -> Path:
    """``path`` itself when it exists, else the config of that name shipped with genrec
    (``configs/`` of the repository, installed as ``genrec.configs``): ``demo``, ``hstu.toml``,
    ``configs/hstu.toml`` all find it from any directory."""
    path = Path(path)
    if path.exists():
        return path
    name = path.name if path.suffix == ".toml" else path.name + ".toml"
    bundled = Path(str(resources.files("genrec.configs") / name))
    if bundled.is_file():
        return bundled
    raise ConfigError(f"{path}: no such config file (nor a config named '{name}' shipped with genrec: "
                      f"{', '.join(sorted(p.name for p in Path(str(resources.files('genrec.configs'))).glob('*.toml')))})")


def replace(obj: T, overrides: Sequence[str]) -> T:
    """A copy of config ``obj`` with dotted overrides applied (validated like a load)."""
    return from_dict(type(obj), apply_overrides(to_dict(obj), overrides))


def dump_toml(obj: Any) -> str:
    return tomli_w.dumps(to_dict(obj))
