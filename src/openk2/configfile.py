"""Config files: TOML with `base = "other.toml"` inheritance, strict typed sections, `--set section.key=value`.

Every TOML-driven command (pretrain, sft, rl, synth, pipeline, the corpus files) reads its file here:

    raw = read_toml(path)                          # `base` chain resolved, child keys over the base's
    apply_overrides(raw, ["train.steps=50"])       # values parse as TOML, else are taken as strings
    build_section(TrainSection, "train", raw["train"])   # unknown key / wrong type / bad value: ConfigError

and `load_config(path, overrides, build)` does all three with `config_errors` around them, so that a bad key
or value becomes one line naming the file (or the `--set`) it came from, the key, and the valid keys:

    configs/tiny.toml --set train.steps=abc: train.steps must be an integer, got 'abc'

Errors are `ConfigError`, a ValueError (the CLI prints a ValueError as `openk2 <cmd>: error: <message>`).
This is a foundation module: standard library only, nothing from openk2.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config key or value. `key` is the dotted path it concerns ("train.steps", or "train" for a whole
    table); `table` marks an error about a table as a whole (every source that wrote into it is named)."""

    def __init__(self, message: str, key: str | None = None, *, table: bool = False) -> None:
        super().__init__(message)
        self.key = key
        self.table = table
        self.located = False  # set once config_errors has named the source


# ----------------------------------------------------------------------------------------------- reading
def read_toml(path: str | Path, *, inherit: bool = True) -> dict[str, Any]:
    """Read a TOML file; with `inherit`, `base = "other.toml"` (relative to it) is read first and overridden key
    by key, recursively. A missing file, invalid TOML or an inheritance loop is a ConfigError naming the file."""
    if not inherit:
        return _parse_file(Path(path))
    raw: dict[str, Any] = {}
    for _, table in _chain(Path(path)):
        raw = merge_tables(raw, table)
    return raw


def _parse_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not valid UTF-8 (offset {err.start}: {err.reason})") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None


def _chain(path: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The files of an inheritance chain, base first, each with its own table (its `base` key removed)."""
    chain: list[tuple[Path, dict[str, Any]]] = []
    seen: list[Path] = []
    while True:
        resolved = path.resolve()
        if resolved in seen:
            raise ConfigError(f"config inheritance loops through {path}")
        if seen and not path.is_file():
            raise ConfigError(f"{chain[0][0]}: base file {path} not found")
        seen.append(resolved)
        raw = _parse_file(path)
        base = raw.pop("base", None)
        chain.insert(0, (path, raw))
        if base is None:
            return chain
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base must be the path of another TOML file, got {base!r}")
        path = path.parent / base


def merge_tables(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` on top, sub-tables merged key by key (a config file over the one it inherits)."""
    out = dict(base)
    for key, value in override.items():
        both_tables = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_tables(out[key], value) if both_tables else value
    return out


# --------------------------------------------------------------------------------------------- overrides
def parse_value(text: str) -> Any:
    """A `--set` value: TOML (`3`, `1e-3`, `true`, `"fp32"`, `[1, 2]`), else the bare text as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings to `raw` in place (and return it); nested paths (`a.b.c=v`) reach
    sub-tables. Whether the key exists is checked when the config is built (it names the `--set`)."""
    for item in overrides:
        dotted, value = _split_override(item)
        *path, key = dotted.split(".")
        node = raw
        for depth, part in enumerate(path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: {'.'.join(path[:depth + 1])} is a value, not a section")
        node[key] = parse_value(value.strip())
    return raw


def _split_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected SECTION.KEY=VALUE")
    dotted, value = item.split("=", 1)
    dotted = dotted.strip()
    if not dotted or any(not part.strip() for part in dotted.split(".")):
        raise ConfigError(f"--set {item}: expected SECTION.KEY=VALUE (a part of the key is empty)")
    return dotted, value


# ------------------------------------------------------------------------------------- strict sections
def check_keys(values: dict[str, Any], known: typing.Iterable[str], label: str, *, prefix: str = "") -> None:
    """ConfigError `<label>: a, b (valid keys: ...)` when `values` has keys outside `known`; `prefix` + the first
    unknown key is the error's key (where config_errors looks for its source)."""
    known = sorted(known)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{label}: {', '.join(unknown)} (valid keys: {', '.join(known)})", prefix + unknown[0])


def check_table(cls: type, section: str, values: Any, *, extra: dict[str, Any] | None = None) -> None:
    """Check a TOML table against a dataclass's fields: a table, no unknown key, each value of its field's
    type. `extra` adds keys that are not fields (name -> type), e.g. `{"preset": str}` for [model]."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table, got {_show(values)}", section, table=True)
    hints = _field_types(cls)
    known = {**hints, **(extra or {})}
    check_keys(values, known, f"unknown key(s) in [{section}]", prefix=f"{section}.")
    for name, value in values.items():
        check_type(value, known[name], f"{section}.{name}")


def build_section(cls: type[T], section: str, values: Any) -> T:
    """`cls(**values)` for the TOML table `[section]`, checked by `check_table`; a missing required key or a
    value the dataclass rejects (its `__post_init__` ValueError) is a ConfigError for the table."""
    check_table(cls, section, values)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"[{section}] needs {', '.join(missing)}", section, table=True)
    with table_errors(section):
        return cls(**values)


def build_named_tables(cls: type[T], key: str, values: Any) -> list[T]:
    """`[[key]]`: a list of `build_section(cls, ...)` tables whose `name` fields are unique."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError(f"{key} must be an array of tables ([[{key}]])", key)
    built = [build_section(cls, f"{key}[{i}]", v) for i, v in enumerate(values)]
    names = [b.name for b in built]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key} names must be unique, got {names}", key)
    return built


@contextmanager
def table_errors(section: str) -> Iterator[None]:
    """Turn a plain ValueError raised inside (a dataclass's own validation) into a ConfigError for `[section]`."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err), section, table=True) from err


def check_type(value: Any, annotation: Any, key: str) -> None:
    """ConfigError `<key> must be <type>, got <value>` unless `value` fits `annotation` (int, float, bool, str,
    X | None, list[X], dict[...], Literal[...], Any, or a dataclass: an instance or a table checked field by
    field). An int fits float; a bool fits neither int nor float; a path fits str."""
    if _fits(value, annotation, key):
        return
    raise ConfigError(f"{key} must be {_describe(annotation)}, got {_show(value)}", key)


def _fits(value: Any, tp: Any, key: str) -> bool:
    if tp is Any or tp is object:
        return True
    if tp is None or tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str | os.PathLike)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, dict):  # a table for a dataclass arm: its own errors are the useful ones
            for arm in args:
                if dataclasses.is_dataclass(arm):
                    return _fits(value, arm, key)
        return any(_fits(value, arm, key) for arm in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            return False
        element = args[0] if args else Any
        for i, item in enumerate(value):
            check_type(item, element, f"{key}[{i}]")
        return True
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            return False
        if len(args) == 2:
            for name, item in value.items():
                check_type(item, args[1], f"{key}.{name}")
        return True
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return True
        if isinstance(value, dict):
            check_table(tp, key, value)
            return True
        return False
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation this checker does not know: the dataclass validates it


_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("a string", "strings")}


def _describe(tp: Any, plural: bool = False) -> str:
    if tp in _NAMES:
        return _NAMES[tp][plural]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        text = " or ".join(_describe(a, plural) for a in arms)
        return f"{text} (or left out)" if len(arms) < len(args) else text
    if origin is typing.Literal:
        return f"one of {', '.join(repr(a) for a in args)}"
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return f"a list of {_describe(args[0], True)}" if args and args[0] is not Any else "a list"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "tables" if plural else "a table"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The dataclass's init fields and their resolved annotations (Any where an annotation cannot be resolved)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a forward reference we cannot resolve: the dataclass checks that field
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


# ------------------------------------------------------------------------------------- where errors came from
def load_config(path: str | Path | None, overrides: Sequence[str] | None, build: Callable[[dict[str, Any]], T]) -> T:
    """`build(raw)` for the TOML file at `path` (defaults: `{}` when None) with `overrides` applied; a bad key
    or value is a one-line ConfigError naming the file or `--set` it came from (see `config_errors`)."""
    overrides = list(overrides or [])
    raw = read_toml(path) if path is not None else {}
    with config_errors(path, overrides):
        return build(apply_overrides(raw, overrides))


@contextmanager
def config_errors(path: str | Path | None = None, overrides: Sequence[str] = (),
                  layers: Sequence[tuple[str, dict[str, Any]]] = ()) -> Iterator[None]:
    """Re-raise a ValueError from building a config read from `path` (+ `layers`, named tables merged over it
    in order, + `overrides`) as one line that starts with where the offending key came from: the file (or the
    base file it inherits), a layer, or the `--set`. Errors already located pass through unchanged."""
    try:
        yield
    except ValueError as err:
        if getattr(err, "located", False):
            raise
        where = _where(err, None if path is None else Path(path), overrides, layers)
        message = " ".join(str(err).splitlines())
        if where:  # "FILE: message", or "FILE --set ITEM: ..." for a --set that cannot be applied
            message = f"{where} {message}" if message.startswith("--set ") else f"{where}: {message}"
        located = ConfigError(message, getattr(err, "key", None), table=getattr(err, "table", False))
        located.located = True
        raise located from err


def _where(err: ValueError, path: Path | None, overrides: Sequence[str],
           layers: Sequence[tuple[str, dict[str, Any]]]) -> str:
    top = str(path) if path is not None else ""
    key = getattr(err, "key", None)
    if key is None:
        return top
    try:
        files = _chain(path) if path is not None else []
    except ValueError:
        files = []
    sources: list[tuple[str, str, Any]] = [("file", str(p), t) for p, t in files]
    sources += [("layer", name, table) for name, table in layers]
    for item in overrides:
        try:
            sources.append(("set", item, apply_overrides({}, [item])))
        except ValueError:
            continue
    hits = [(kind, name) for kind, name, table in sources if _touches(table, key)]
    if not hits:
        return top
    if not getattr(err, "table", False):
        hits = hits[-1:]  # the value that won
    if len(hits) == 1 and hits[0][0] == "file":
        return hits[0][1] if hits[0][1] == top else f"{hits[0][1]} (inherited by {top})"
    parts = [top] if top else []
    parts += [f"in {name}" for kind, name in hits if kind == "layer"]
    parts += [f"--set {name}" for kind, name in hits if kind == "set"]
    return " ".join(parts)


def _touches(table: Any, key: str) -> bool:
    """Whether `table` holds the dotted `key` (`data.sources[1].weight` indexes lists)."""
    node = table
    for part in key.split("."):
        name = part.split("[", 1)[0]
        indices = [int(i) for i in re.findall(r"\[(\d+)\]", part)]
        if not isinstance(node, dict) or name not in node:
            return False
        node = node[name]
        for i in indices:
            if not isinstance(node, list) or i >= len(node):
                return False
            node = node[i]
    return True


__all__ = ["ConfigError", "apply_overrides", "build_section", "check_keys", "check_table", "check_type",
           "config_errors", "load_config", "merge_tables", "parse_value", "read_toml", "table_errors"]
