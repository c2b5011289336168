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
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence


from megatron_ext.errors import ConfigError


def _require(ok: bool, key: str, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {allowed}")


# --------------------------------------------------------------------- training-side sections


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1  # our MoE layer keeps whole experts on a rank
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    def __post_init__(self):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "expert_model_parallel_size"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _require(vpp >= 1, "virtual_pipeline_model_parallel_size", f"must be >= 1, got {vpp}")
            _require(vpp == 1 or self.pipeline_model_parallel_size > 1,
                     "virtual_pipeline_model_parallel_size",
                     "needs pipeline_model_parallel_size > 1 (interleaved schedule)")
        etp = self.expert_tensor_parallel_size
        _require(etp is None or etp >= 1, "expert_tensor_parallel_size", f"must be >= 1, got {etp}")
        _require(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
                 "sequence_parallel", "needs tensor_model_parallel_size > 1")

    def data_parallel_size(self, world_size: int) -> int:
        """Dense data-parallel size for ``world_size`` ranks (checks divisibility)."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _require(world_size % (tp * pp) == 0, "tensor_model_parallel_size",
                 f"tensor ({tp}) x pipeline ({pp}) parallel size must divide the world size "
                 f"({world_size})")
        ep = self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size or tp
        _require((world_size // pp) % (ep * etp) == 0, "expert_model_parallel_size",
                 f"expert ({ep}) x expert-tensor ({etp}) parallel size must divide "
                 f"world_size / pipeline = {world_size // pp}")
        return world_size // (tp * pp)


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # None: micro_batch_size x data-parallel size
    seq_length: int = 128
    train_iters: int = 100
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None: train_iters
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    bf16: bool = False

    def __post_init__(self):
        for key in ("micro_batch_size", "seq_length", "train_iters"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        gbs = self.global_batch_size
        _require(gbs is None or gbs >= 1, "global_batch_size", f"must be >= 1, got {gbs}")
        _require(self.lr >= 0, "lr", f"must be >= 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")
        decay = self.lr_decay_iters
        _require(decay is None or decay >= 1, "lr_decay_iters", f"must be >= 1, got {decay}")
        # Megatron's scheduler needs warmup to end before decay does.
        decay_end = self.train_iters if decay is None else decay
        _require(0 <= self.lr_warmup_iters < decay_end, "lr_warmup_iters",
                 f"must be in [0, {decay_end}) (lr_decay_iters, or train_iters), "
                 f"got {self.lr_warmup_iters}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        for key in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, key) < 1, key, f"must be in [0, 1), got {getattr(self, key)}")
        _require(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        _require(self.clip_grad >= 0, "clip_grad", f"must be >= 0 (0 disables), got {self.clip_grad}")


@dataclass
class DataConfig:
    data_path: Optional[list[str]] = None  # None: the stdlib corpus; else Megatron blend list
    split: str = "969,30,1"  # train,valid,test weights
    tokenizer_json: Optional[str] = None  # local Hugging Face tokenizer.json; None: bytes
    data_cache_path: Optional[str] = None  # GPTDataset index cache; None: next to the data
    stdlib_max_mb: Optional[float] = None  # read at most this many MB of stdlib source
    eod_mask_loss: bool = False

    def __post_init__(self):
        _require(self.data_path is None or len(self.data_path) > 0, "data_path",
                 "a non-empty list of .bin/.idx prefixes (optionally weight, prefix pairs), "
                 "or null for the stdlib corpus")
        try:
            weights = [float(w) for w in self.split.split(",")]
        except ValueError:
            weights = []
        _require(0 < len(weights) <= 3 and all(w >= 0 for w in weights) and weights[0] > 0,
                 "split", f"comma-separated train,valid,test weights like '969,30,1', got {self.split!r}")
        mb = self.stdlib_max_mb
        _require(mb is None or mb > 0, "stdlib_max_mb", f"must be > 0 or null, got {mb}")

    def split_weights(self) -> tuple[float, float, float]:
        """Normalised (train, valid, test) fractions."""
        w = [float(x) for x in self.split.split(",")] + [0.0, 0.0]
        total = sum(w[:3])
        return (w[0] / total, w[1] / total, w[2] / total)


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False

    def __post_init__(self):
        si = self.save_interval
        _require(si is None or si >= 1, "save_interval", f"must be >= 1 or null, got {si}")


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard_dir: Optional[str] = None
    metrics_dir: Optional[str] = None  # metrics.jsonl goes here; None: no jsonl
    eval_interval: int = 1000
    eval_iters: int = 10  # 0 disables evaluation
    peak_tflops: Optional[float] = None  # per-GPU peak for MFU; None: no MFU

    def __post_init__(self):
        for key in ("log_interval", "eval_interval"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require(self.eval_iters >= 0, "eval_iters", f"must be >= 0, got {self.eval_iters}")
        pk = self.peak_tflops
        _require(pk is None or pk > 0, "peak_tflops", f"must be > 0 or null, got {pk}")


TRAINING_SECTIONS = (ParallelConfig, TrainingConfig, DataConfig, CheckpointConfig, LoggingConfig)


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
        if table[key][1] is bool and not values:
            values = ["true"]
        if negated:
            if table[key][1] is not bool or values != ["true"]:
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
