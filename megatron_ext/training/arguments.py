"""Config loading: flat YAML file + command-line flags -> validated dataclasses.

Keys are Megatron-LM argument names with underscores in YAML (``micro_batch_size: 4``) and
dashes on the command line (``--micro-batch-size 4``); flags override the file. Each key is
owned by exactly one dataclass ("section"); the caller lists the sections, e.g.::

    cfg = load_config([ParallelConfig, TrainingConfig, DataConfig, CheckpointConfig,
                       LoggingConfig, Section(HybridConfig, fields=MODEL_KEYS, build=...)],
                      sys.argv[1:], world_size=world_size)
    cfg[TrainingConfig].lr

Bool flags: ``--sequence-parallel`` / ``--no-sequence-parallel`` / ``--bf16=false``.
List flags take several values: ``--data-path a b``. ``--help`` lists every key.
Every error is a ``ConfigError`` naming the key, the source and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence


from megatron_ext.errors import ConfigError
from megatron_ext.training.sections import (  # noqa: F401  (re-exported)
    TRAINING_SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    TrainingConfig,
    _require,
)

# --------------------------------------------------------------------------- the generic loader


@dataclass(frozen=True)
class Section:
    """A dataclass whose fields are config keys.

    ``fields``: the user-settable keys (None: every init field). ``build(values, built)``
    constructs the instance from the given values and the sections built before it (a dict
    type -> instance); default ``cls(**values)``. Use it to inject e.g. parallel sizes into a
    model config.
    """

    cls: type
    fields: Optional[tuple[str, ...]] = None
    build: Optional[Callable[[dict, dict], Any]] = None


class LoadedConfig:
    """The built sections, indexable by dataclass type, plus where each value came from."""

    def __init__(self, instances: dict[type, Any], sources: dict[str, str]):
        self.instances = instances
        self.sources = sources

    def __getitem__(self, cls: type) -> Any:
        return self.instances[cls]

    def to_dict(self) -> dict[str, Any]:
        """The merged config as a flat JSON-friendly dict (every init field of every section)."""
        out = {}
        for inst in self.instances.values():
            for f in dataclasses.fields(inst):
                if f.init:
                    out[f.name] = _jsonable(getattr(inst, f.name))
        return out


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if callable(value):
        # By name, not repr: a repr carries a memory address that differs between ranks, and
        # the checkpoint's common state must be identical on every rank.
        inner = getattr(value, "func", value)  # functools.partial
        return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__name__)}"
    return str(value)


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp, value):
    """Convert ``value`` (a YAML value or a flag string, or a list of flag strings) to ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        single = value[0] if isinstance(value, list) and len(value) == 1 else value
        # "" (e.g. `--save ""`) also switches an optional setting off.
        if single is None or (isinstance(single, str) and single.lower() in ("", "null", "none")):
            if type(None) in args:
                return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value)
            except (TypeError, ValueError):
                continue
        raise ValueError
    if isinstance(value, list) and len(value) == 1 and origin is not list:
        value = value[0]  # a flag given one value
    if origin is Literal:
        if value in args:
            return value
        raise ValueError
    if origin is list:
        items = value if isinstance(value, list) else [value]
        return [_coerce(args[0], v) for v in items]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return int(value)
        raise ValueError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return float(value)  # also YAML's '1e-3', which PyYAML reads as a string
        raise ValueError
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError
    raise TypeError(f"unsupported config type {tp!r}")


def _key_table(sections: Sequence[Section]) -> dict[str, tuple[Section, Any, Any]]:
    """key -> (section, type, default); duplicate keys are a programming error."""
    table: dict[str, tuple[Section, Any, Any]] = {}
    for sec in sections:
        hints = typing.get_type_hints(sec.cls)
        init_fields = {f.name: f for f in dataclasses.fields(sec.cls) if f.init}
        names = sec.fields if sec.fields is not None else tuple(init_fields)
        for name in names:
            if name not in init_fields:
                raise TypeError(f"{sec.cls.__name__} has no init field {name!r}")
            if name in table:
                raise TypeError(f"config key {name!r} is owned by both "
                                f"{table[name][0].cls.__name__} and {sec.cls.__name__}")
            f = init_fields[name]
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
            table[name] = (sec, hints[name], default)
    return table


def _unknown(key: str, table: dict, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(table), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; run with --help to list the keys"
    return ConfigError(f"unknown config key {key!r} {where}{hint}")


def _is_bool(tp) -> bool:
    """bool, or bool | None (null: decided later): both take ``--key`` and ``--no-key``."""
    return tp is bool or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                          and set(typing.get_args(tp)) == {bool, type(None)})


def _parse_flags(argv: Sequence[str], table: dict) -> tuple[Optional[str], dict[str, Any], bool]:
    """argv -> (config path, {key: raw value}, help requested)."""
    config_path, raw, want_help = None, {}, False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            want_help, i = True, i + 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --micro-batch-size 4")
        name, eq, inline = arg[2:].partition("=")
        values = [inline] if eq else []
        i += 1
        if not eq:
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
        key = name.replace("-", "_")
        if key == "config":
            if len(values) != 1:
                raise ConfigError("--config takes one path: --config configs/tiny.yaml")
            config_path = values[0]
            continue
        negated = key not in table and key.startswith("no_") and key[3:] in table
        if negated:
            key = key[3:]
        if key not in table:
            raise _unknown(key, table, f"(flag {arg.split('=')[0]})")
        if _is_bool(table[key][1]) and not values:
            values = ["true"]
        if negated:
            if not _is_bool(table[key][1]) or values != ["true"]:
                raise ConfigError(f"--no-{name[3:]}: only bool keys take a --no- form")
            values = ["false"]
        if not values:
            raise ConfigError(f"flag --{name} needs a value ({_describe(table[key][1])})")
        raw[key] = values
    return config_path, raw, want_help


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a flat mapping of key: value")
    for key, value in data.items():
        if isinstance(value, dict):
            raise ConfigError(f"{key!r} in {path}: keys are flat (no nesting), e.g. micro_batch_size: 4")
    return data


def format_help(sections: Sequence[Section]) -> str:
    lines = ["usage: [--config FILE.yaml] [--key value ...]   (YAML: key_name: value)"]
    for key, (sec, tp, default) in _key_table(sections).items():
        lines.append(f"  --{key.replace('_', '-'):42s} {_describe(tp)}  "
                     f"[{sec.cls.__name__}, default {default!r}]")
    return "\n".join(lines)


def load_config(
    sections: Sequence[type | Section],
    argv: Optional[Sequence[str]] = None,
    *,
    config_path: Optional[str] = None,
    world_size: Optional[int] = None,
) -> LoadedConfig:
    """Build every section from ``--config``/``config_path`` plus flags (flags win).

    With ``world_size``, also checks the layout against it (parallel sizes divide it, global
    batch divisible by micro batch x data-parallel size; a missing global batch becomes
    micro batch x dp). ``--help`` prints the keys and exits.
    """
    sections = [s if isinstance(s, Section) else Section(s) for s in sections]
    table = _key_table(sections)
    flag_path, flag_values, want_help = _parse_flags(list(sys.argv[1:] if argv is None else argv), table)
    if want_help:
        print(format_help(sections))
        raise SystemExit(0)
    path = flag_path or config_path
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        for key, value in _read_yaml(path).items():
            if key not in table:
                raise _unknown(key, table, f"in {path}")
            values[key], sources[key] = value, path
    for key, value in flag_values.items():
        values[key], sources[key] = value, "command line"
    per_section: dict[int, dict[str, Any]] = {id(s): {} for s in sections}
    for key, value in values.items():
        sec, tp, _ = table[key]
        try:
            per_section[id(sec)][key] = _coerce(tp, value)
        except (TypeError, ValueError):
            shown = value if not isinstance(value, list) or len(value) > 1 else value[0]
            raise ConfigError(f"{key} = {shown!r} (from {sources[key]}): expected {_describe(tp)}") from None
    built: dict[type, Any] = {}
    for sec in sections:
        kwargs = per_section[id(sec)]
        try:
            built[sec.cls] = sec.build(kwargs, built) if sec.build else sec.cls(**kwargs)
        except ConfigError as exc:
            key = re.match(r"\w*", str(exc)).group(0)  # messages start with the key
            raise ConfigError(f"{exc} (from {sources.get(key, 'the default')})") from None
        except (ValueError, AssertionError, TypeError) as exc:
            raise ConfigError(f"invalid {sec.cls.__name__}: {exc}") from exc
    if world_size is not None and ParallelConfig in built and TrainingConfig in built:
        _check_batch_layout(built[ParallelConfig], built[TrainingConfig], world_size)
    return LoadedConfig(built, sources)


def _check_batch_layout(par: ParallelConfig, train: TrainingConfig, world_size: int) -> None:
    dp = par.data_parallel_size(world_size)
    if train.global_batch_size is None:
        train.global_batch_size = train.micro_batch_size * dp
    _require(train.global_batch_size % (train.micro_batch_size * dp) == 0, "global_batch_size",
             f"must be divisible by micro_batch_size ({train.micro_batch_size}) x data-parallel "
             f"size ({dp}) = {train.micro_batch_size * dp}, got {train.global_batch_size}")
