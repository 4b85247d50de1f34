"""Configuration: one dataclass per component, a YAML file, dotted command-line overrides.

A run's configuration is a tree of dataclasses (each component's next to the class that uses it). A YAML
file sets any subset of it, ``--section.key=value`` overrides set more, and every value is checked
against its field's annotation. An unknown key or a bad value is a ``ConfigError`` naming the key: a typo
must never silently become a default.

    @dataclass
    class Optim:
        lr: float = 1e-6
        # peak learning rate (this comment is the field's doc in `unison train --help`)

    @dataclass
    class Run:
        max_steps: int = 100
        optim: Optim = field(default_factory=Optim)

    load_config(Run, "run.yaml", ["--max_steps=10", "--optim.lr=1e-5"])
    # -> Run(max_steps=10, optim=Optim(lr=1e-05)), whatever run.yaml set for them

Values are read with YAML's scalar rules (``1e-5`` is a float, ``[1, 2]`` a list, ``null`` is None), then
coerced to the field's type: int, float (ints accepted), bool, str, ``X | None``, ``Literal[...]``,
``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, nested dataclasses. On the command line a ``str`` field
takes the text as typed, so ``--run_name=2024`` is the string "2024".
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import os
import re
import textwrap
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be loaded; the message names the offending key or file."""


class InputError(RuntimeError):
    """A run's input that cannot be used (a missing model or data file, an ``output_dir`` that is a file, a server
    that cannot be reached): the message names the file or URL. The CLI prints it as one ``error:`` line and exits
    with status 1 (a ``ConfigError`` exits with 2)."""


class MissingInputError(InputError, FileNotFoundError):
    """A missing input (model folder, data file, checkpoint): still a ``FileNotFoundError`` to callers that catch
    that."""


class InvalidInputError(InputError, ValueError):
    """An input that exists but cannot be used (undecodable, no usable row): still a ``ValueError`` to callers that
    catch that."""


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from the YAML file at ``path`` (optional) and ``--key=value`` / ``key=value`` overrides,
    applied in order after the file (the last one wins)."""
    data = _read_yaml(path) if path is not None else {}
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(data, key, value)
    return _build(cls, data, prefix="")


def check_literals(cfg: Any, prefix: str = "") -> None:
    """Raise ValueError naming the first field of dataclass instance ``cfg`` whose value is not one its ``Literal``
    annotation allows; for ``__post_init__``, so each field's choices are written once, in its annotation. A config
    loaded from YAML or the CLI was already checked (as a ``ConfigError`` naming the dotted key); this catches
    direct construction in Python.

    >>> @dataclasses.dataclass
    ... class Sync:
    ...     mode: Literal["sparse", "full"] = "sparse"
    ...     def __post_init__(self):
    ...         check_literals(self, "sync.")
    >>> Sync("dense")
    Traceback (most recent call last):
    ValueError: sync.mode must be 'sparse' or 'full', got 'dense'
    """
    hints = _type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        tp, value = hints[f.name], getattr(cfg, f.name)
        choices = get_args(tp)
        if get_origin(tp) is Literal and value not in choices:
            allowed = " or ".join(filter(None, [", ".join(map(repr, choices[:-1])), repr(choices[-1])]))
            raise ValueError(f"{prefix}{f.name} must be {allowed}, got {value!r}")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The dataclass tree as plain YAML-able data (tuples become lists); ``load_config`` reads it back."""
    if not _is_instance(cfg):
        raise TypeError(f"expected a dataclass instance, got {type(cfg).__name__}")
    return _to_plain(cfg)


def dump_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved configuration as YAML (e.g. into the run directory, to rerun it exactly)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.dump(config_to_dict(cfg), f, Dumper=_Dumper, sort_keys=False)


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """One key of a configuration tree, for help text."""

    key: str  # dotted, e.g. "optim.lr"
    type: str  # e.g. "float", "Literal['mask', 'truncate']", "int | None"
    default: str  # as it would be written in YAML; "(required)" when there is none
    doc: str  # the field's comment or docstring, "" if it has none


def config_fields(cls: type, prefix: str = "", defaults: Any = None) -> list[ConfigField]:
    """Every key of ``cls`` and its nested sections, in declaration order, with defaults and docs."""
    hints, docs, out = _type_hints(cls), _field_docs(cls), []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp = prefix + f.name, hints[f.name]
        default = _field_default(f, defaults)
        section = _section_class(tp)
        if section is not None:
            if default is None:  # an optional section, off by default: still list what it would take
                out.append(ConfigField(key, _type_name(tp), "null", docs.get(f.name, "")))
            out += config_fields(section, key + ".", default if _is_instance(default) else None)
            continue
        shown = "(required)" if default is dataclasses.MISSING else format_value(default)
        out.append(ConfigField(key, _type_name(tp), shown, docs.get(f.name, "")))
    return out


def format_value(value: Any) -> str:
    """A value as one would type it in YAML or after ``--key=``."""
    if type(value) is float and math.isfinite(value):
        return repr(value)  # 1e-05 rather than YAML's 1.0e-05: both read back as the same float
    text = yaml.dump(_to_plain(value), Dumper=_Dumper, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


# --- reading --------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-5`` as a float (YAML 1.1 wants ``1.0e-5``) and rejects duplicate keys."""


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings ``_Loader`` would read as floats (the string "1e-5")."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} on line {key_node.start_mark.line + 1}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_Loader)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {os.fspath(path)}") from None
    except (OSError, yaml.YAMLError, ConfigError) as e:
        raise ConfigError(f"cannot read config file {os.fspath(path)}: {e}") from None
    if data is None:  # an empty file sets nothing
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{os.fspath(path)}: the top level must be a mapping of keys, got {kind}")
    return data


@dataclasses.dataclass(frozen=True)
class _CliText:
    """A command-line value: the YAML reading and the text as typed (what a ``str`` field gets)."""

    raw: str
    parsed: Any


def _parse_override(arg: str) -> tuple[str, Any]:
    key, eq, raw = arg.removeprefix("--").partition("=")
    if not eq or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {arg!r}: expected --key=value (e.g. --optim.lr=1e-5)")
    try:
        parsed = yaml.load(raw, Loader=_Loader)
    except (yaml.YAMLError, ConfigError):
        parsed = raw  # not valid YAML: keep the text, the field's type decides whether it is acceptable
    return key, parsed if isinstance(parsed, list | dict) else _CliText(raw, parsed)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    node, walked = data, []
    for name in sections:
        walked.append(name)
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        elif isinstance(child, _CliText) and child.parsed is None:  # an earlier --section=null
            child = node[name] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"cannot set '{key}': '{'.'.join(walked)}' is {_plain(child)!r}, not a section")
        node = child
    node[leaf] = value


# --- building and type checking ---------------------------------------------------------------------------


def _build(cls: type[T], data: Any, prefix: str, base: Any = None) -> T:
    """Instantiate ``cls`` from a mapping; fields it does not set come from ``base`` or the class defaults."""
    base = base if _is_instance(base) else None
    if not isinstance(data, Mapping):
        raise ConfigError(f"bad value for '{prefix[:-1]}': expected a mapping of keys, got {_plain(data)!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in data:
        if name not in fields:
            raise ConfigError(_unknown_key(cls, prefix, str(name)))
    kwargs = {}
    for name, value in data.items():
        f, key = fields[name], prefix + name
        section = _section_class(hints[name])
        if section is not None and isinstance(_plain(value), Mapping):
            # a partial mapping refines the section's default instance, not the section class's defaults
            kwargs[name] = _build(section, _plain(value), key + ".", _field_default(f, base))
        else:
            kwargs[name] = _coerce(hints[name], value, key)
    if base is None:
        missing = [n for n, f in fields.items() if n not in kwargs and not _has_default(f)]
        if missing:
            raise ConfigError(f"missing required key '{prefix + missing[0]}'")
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # a __post_init__ check: say which section it came from
        raise ConfigError(f"{prefix[:-1] or cls.__name__}: {e}") from None


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(tp, args, value, key)
    if isinstance(value, _CliText):  # a str field takes the text as typed unless YAML read it as a string
        value = value.raw if tp is str and not isinstance(value.parsed, str) else value.parsed
    if tp is Any or tp is object:
        return value
    if origin is Literal:
        for choice in args:  # compare types too: True == 1 but is not a valid choice for Literal[0, 1]
            if value == choice and type(value) is type(choice):
                return choice
        raise ConfigError(f"'{key}' must be one of {list(args)!r}, got {value!r}")
    if tp is float and (type(value) in (int, float) or str(value).lower().lstrip("+-") in ("inf", "nan")):
        return float(value)  # YAML spells infinity `.inf`; accept the `inf` people type too
    if tp in (int, bool, str, type(None)) and type(value) is tp:  # bool is an int, but not an int field
        return value
    if origin in (list, tuple) and isinstance(value, list | tuple):
        return _coerce_sequence(tp, origin, args, value, key)
    if origin is dict and isinstance(value, Mapping):
        key_tp, value_tp = args or (Any, Any)
        return {_coerce(key_tp, k, f"{key}.{k}"): _coerce(value_tp, v, f"{key}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return _build(tp, value, key + ".")
        raise ConfigError(f"bad value for '{key}': expected a mapping of keys, got {value!r}")
    elif origin is None and isinstance(tp, type) and tp not in (int, float, bool, str):
        if isinstance(value, tp):  # any other class: only an instance of it (YAML cannot make one)
            return value
    raise ConfigError(f"bad value for '{key}': expected {_type_name(tp)}, got {value!r}")


def _coerce_union(tp: Any, args: tuple, value: Any, key: str) -> Any:
    if _plain(value) is None and type(None) in args:
        return None
    arms = [a for a in args if a is not type(None)]
    if len(arms) == 1:  # X | None: X's own error message is the helpful one
        return _coerce(arms[0], value, key)
    for arm in arms:
        try:
            return _coerce(arm, value, key)
        except ConfigError:
            continue
    raise ConfigError(f"bad value for '{key}': expected {_type_name(tp)}, got {_plain(value)!r}")


def _coerce_sequence(tp: Any, origin: type, args: tuple, value: list | tuple, key: str) -> list | tuple:
    if origin is tuple and args and (len(args) != 2 or args[1] is not Ellipsis):
        if len(value) != len(args):
            raise ConfigError(f"bad value for '{key}': expected {len(args)} items, got {len(value)}")
        item_types = list(args)
    else:
        item_types = [args[0] if args else Any] * len(value)
    items = [_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(item_types, value, strict=True))]
    return tuple(items) if origin is tuple else items


# --- helpers -------------------------------------------------------------------------------------------


def _type_hints(cls: type) -> dict[str, Any]:
    try:  # resolves the strings that `from __future__ import annotations` leaves
        return get_type_hints(cls)
    except NameError as e:
        raise TypeError(f"cannot resolve the annotations of {cls.__qualname__} ({e}); "
                        "define config dataclasses at module level") from e


def _is_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _plain(value: Any) -> Any:
    return value.parsed if isinstance(value, _CliText) else value


def _section_class(tp: Any) -> type | None:
    """The dataclass behind a ``Section`` or ``Section | None`` annotation, else None."""
    if get_origin(tp) in (Union, types.UnionType):
        arms = [a for a in get_args(tp) if a is not type(None)]
        tp = arms[0] if len(arms) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _field_default(f: dataclasses.Field, base: Any = None) -> Any:
    if base is not None:
        return getattr(base, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _unknown_key(cls: type, prefix: str, name: str) -> str:
    key = prefix + name
    renamed = getattr(cls, "renamed_keys", {}).get(name)  # a key a config section used to have
    if renamed:
        return f"'{key}' is now {renamed}"
    siblings = [prefix + f.name for f in dataclasses.fields(cls) if f.init]
    every = siblings + [f.key for f in config_fields(cls, prefix)]
    guess = [k for k in every if k.rsplit(".", 1)[-1] == name][:1]  # the right key in the wrong section
    guess = guess or difflib.get_close_matches(key, siblings, n=1)
    guess = guess or difflib.get_close_matches(key, every, n=1)
    return f"unknown key '{key}'" + (f" (did you mean '{guess[0]}'?)" if guess else "")


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return f"Literal{list(args)!r}"
    if tp is type(None):
        return "None"
    if tp is Ellipsis:
        return "..."
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp).removeprefix("typing."))


def _to_plain(value: Any) -> Any:
    if _is_instance(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if value is None or type(value) in (int, float, bool, str):
        return value
    return str(value)  # e.g. a Path: written as text


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's doc: a trailing ``# comment``, a string right under it, or ``#`` lines right under it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        body = ast.parse(source).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return {}  # no source (e.g. defined in a REPL): help shows no docs
    lines, docs = source.splitlines(), {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        last_line = lines[node.end_lineno - 1].encode()[node.end_col_offset :].decode(errors="replace")
        parts = [last_line.split("#", 1)[1].strip()] if "#" in last_line else []
        after = body[i + 1] if i + 1 < len(body) else None
        string = getattr(after.value, "value", None) if isinstance(after, ast.Expr) else None
        if isinstance(string, str):
            parts.append(" ".join(inspect.cleandoc(string).split()))
        else:
            j = node.end_lineno
            while j < len(lines) and lines[j].strip().startswith("#"):
                parts.append(lines[j].strip().lstrip("#").strip())
                j += 1
        docs[node.target.id] = " ".join(p for p in parts if p)
    return docs


