"""A run's MoE load history, read back from its ``metrics.jsonl`` or its TensorBoard events.

Both sources carry the same numbers (:mod:`megatron_ext.moe.metrics` writes them): every logged step
the ``moe/...`` scalars of all layers (``moe/maxvio/layer_<l>``, ``moe/ep_load_factor/layer_<l>``,
``moe/ep_most_loaded_rank/layer_<l>``, ``moe/dropped/...``, ``moe/ep_size``, ...), and on the image
steps the global tokens per expert of every layer (jsonl: ``moe/tokens_per_expert``; TensorBoard:
the histograms ``moe/expert_load/layer_<l>``, one bucket per expert). Both files may still be
growing (a running job): an incomplete last line or record is skipped. After a resume the later
value of an iteration wins. The TensorBoard events are parsed here record by record (TFRecord
framing; CRCs not checked), so reading a large file shows its progress.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

EXPERT_LOAD_HISTOGRAM = re.compile(r"^moe/expert_load/layer_(\d+)$")
LAYER_TAG = re.compile(r"^moe/maxvio/layer_(\d+)$")
RANK_DIR = re.compile(r"^rank_(\d+)$")
PROGRESS_MIN_BYTES = 16 * 2**20  # smaller event files load in about a second: no progress lines


@dataclass
class LoadHistory:
    source: str
    scalars: dict[str, dict[int, float]] = field(default_factory=dict)  # tag -> {iteration: value}
    # iteration -> {layer: global tokens per expert}
    expert_load: dict[int, dict[int, list[float]]] = field(default_factory=dict)

    def add_scalar(self, tag: str, iteration: int, value: float) -> None:
        self.scalars.setdefault(tag, {})[iteration] = value

    def series(self, tag: str) -> tuple[list[int], list[float]]:
        points = sorted(self.scalars.get(tag, {}).items())
        return [i for i, _ in points], [v for _, v in points]

    @property
    def layers(self) -> list[int]:
        return sorted(int(m.group(1)) for tag in self.scalars if (m := LAYER_TAG.match(tag)))

    @property
    def iterations(self) -> list[int]:
        return sorted({i for values in self.scalars.values() for i in values})

    @property
    def ep_size(self) -> int:
        _, sizes = self.series("moe/ep_size")
        return int(sizes[-1]) if sizes else 1


def read_jsonl(path: str | os.PathLike) -> LoadHistory:
    history = LoadHistory(source=str(path))
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the line a running job is writing
                continue
            if "iteration" not in record or record.get("split") == "valid":
                continue
            it = int(record["iteration"])
            for key, value in record.items():
                if key == "moe/tokens_per_expert":
                    history.expert_load[it] = {int(layer): counts for layer, counts in value.items()}
                elif key.startswith("moe/") and isinstance(value, (int, float)):
                    history.add_scalar(key, it, value)
    return history


def event_files(directory: str | os.PathLike) -> list[Path]:
    """The run's event files in write order (the name holds the start time); not its subfolders'."""
    def start_time(p: Path) -> tuple:
        parts = p.name.split(".")
        return (int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0, p.name)

    return sorted((p for p in Path(directory).glob("events.out.tfevents.*") if p.is_file()), key=start_time)


def _records(path: Path, progress):
    """The serialized events of one TFRecord file (length, crc, data, crc), up to a partial tail."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            if len(data) < length or len(f.read(4)) < 4:
                return
            progress(f.tell(), size)
            yield data


def read_tensorboard(directory: str | os.PathLike, progress_min_bytes: int = PROGRESS_MIN_BYTES,
                     out=sys.stderr) -> LoadHistory:
    """The scalars and per-expert loads of the run whose event files are directly in ``directory``."""
    from tensorboard.compat.proto.event_pb2 import Event

    history = LoadHistory(source=str(directory))
    for path in event_files(directory):
        for data in _records(path, _Progress(path, progress_min_bytes, out)):
            event = Event.FromString(data)
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value" and value.tag.startswith("moe/"):
                    history.add_scalar(value.tag, event.step, value.simple_value)
                elif kind == "histo" and (m := EXPERT_LOAD_HISTOGRAM.match(value.tag)):
                    history.expert_load.setdefault(event.step, {})[int(m.group(1))] = list(value.histo.bucket)
    return history


class _Progress:
    """Progress lines for one large file, every 10% of its bytes (no output for small files)."""

    def __init__(self, path: Path, min_bytes: int, out):
        self.path, self.min_bytes, self.out, self.next_percent = path, min_bytes, out, 10

    def __call__(self, done: int, size: int) -> None:
        if size < self.min_bytes or size == 0:
            return
        percent = 100 * done // size
        if percent >= self.next_percent:
            print(f"reading {self.path.name}: {percent}% of {size / 2**20:.1f} MB", file=self.out, flush=True)
            self.next_percent = (percent // 10 + 1) * 10


def find_tensorboard_dir(run_dir: str | os.PathLike) -> Path | None:
    """``run_dir`` itself or its ``tensorboard``/``tb`` folder, whichever holds the main run's events."""
    for candidate in (Path(run_dir), Path(run_dir) / "tensorboard", Path(run_dir) / "tb"):
        if event_files(candidate):
            return candidate
    return None


def rank_dirs(tensorboard_dir: str | os.PathLike) -> dict[int, Path]:
    """The per-rank runs ``rank_<r>`` beside the main run, by rank."""
    runs = {int(m.group(1)): p for p in Path(tensorboard_dir).iterdir() if p.is_dir() and (m := RANK_DIR.match(p.name))}
    return dict(sorted(runs.items()))


def read_run(run_dir: str | os.PathLike, source: str = "auto", progress_min_bytes: int = PROGRESS_MIN_BYTES,
             out=sys.stderr) -> LoadHistory:
    """A run directory's history: ``source`` = ``jsonl``, ``tensorboard`` or ``auto`` (the jsonl
    when there is one: it is smaller and holds the same numbers)."""
    jsonl = Path(run_dir) / "metrics.jsonl"
    if source in ("auto", "jsonl") and jsonl.is_file():
        return read_jsonl(jsonl)
    tb = find_tensorboard_dir(run_dir)
    if source in ("auto", "tensorboard") and tb is not None:
        return read_tensorboard(tb, progress_min_bytes, out)
    wanted = {"jsonl": "metrics.jsonl", "tensorboard": "TensorBoard events"}.get(source, "metrics.jsonl or events")
    raise FileNotFoundError(f"{run_dir}: no {wanted} (looked in it and its tensorboard/ and tb/ folders)")
