"""Roll the logs back to a resumed checkpoint, so the iterations run again are not logged twice.

A job that dies after iteration 130 and resumes from its checkpoint of iteration 100 logs 101..130
a second time. Before the resumed run writes, ``rewind_metrics_jsonl`` drops the records after the
checkpoint's iteration from ``metrics.jsonl`` and ``rewind_tensorboard`` the events after it from the
TensorBoard event files of a directory. (TensorBoard's own ``purge_step`` cannot do it here: it purges
by step across all tags, and the ``<tag> vs samples`` scalars are stepped by consumed samples.) Both
rewrite a file only when something goes, through a temporary file and ``os.replace``.
"""

from __future__ import annotations

import glob
import json
import os


def _replace_file(path: str, write) -> None:
    tmp = f"{path}.rewind.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _is_kept_record(line: str, iteration: int) -> bool:
    try:
        return json.loads(line)["iteration"] <= iteration
    except (ValueError, KeyError, TypeError):
        return False  # a line torn by a crash


def rewind_metrics_jsonl(path: str, iteration: int) -> int:
    """Drop the records of ``path`` logged after ``iteration`` (and torn lines); returns how many went."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    kept = [line for line in lines if _is_kept_record(line, iteration)]
    if len(kept) < len(lines):
        _replace_file(path, lambda f: f.write("".join(f"{line}\n" for line in kept).encode()))
    return len(lines) - len(kept)


def rewind_tensorboard(log_dir: str, iteration: int, consumed_samples: int) -> int:
    """Drop the summary values of ``log_dir``'s event files (not its subdirectories) logged after
    ``iteration``; ``<tag> vs samples`` values count by ``consumed_samples``. Returns how many went."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from tensorboard.summary.writer.record_writer import RecordWriter

    dropped = 0
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        events, file_dropped = [], 0
        for event in LegacyEventFileLoader(path).Load():  # as written: no migration to tensors
            if event.HasField("summary"):
                values = list(event.summary.value)
                keep = [v for v in values
                        if event.step <= (consumed_samples if v.tag.endswith(" vs samples") else iteration)]
                file_dropped += len(values) - len(keep)
                if not keep:
                    continue
                del event.summary.value[:]
                event.summary.value.extend(keep)
            events.append(event)
        if file_dropped:
            def write(f, events=events):
                writer = RecordWriter(f)
                for event in events:
                    writer.write(event.SerializeToString())

            _replace_file(path, write)
            dropped += file_dropped
    return dropped
