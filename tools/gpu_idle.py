"""Where the GPU waits: idle time between kernels, and the host syncs that drain its queue.

A host-bound step shows up as gaps between kernels. Each gap ends when the host launches the next
kernel, so the gap is charged to the operator that launched it (with its autograd node, as in
``profile_tables.op_table``): a run of small launches right after a host sync is where the time goes.
A gap that contains the end of a host sync (``cudaStreamSynchronize``, a blocking ``cudaMemcpy``...)
is also charged to that sync's operator: the GPU ran dry because the host waited for it.

* :func:`idle_summary`: the arithmetic on plain spans (tested on the CPU).
* :func:`idle_table`: markdown from a finished ``torch.profiler.profile`` with CUDA activity.
* :class:`SyncCensus` (and :func:`sync_sites_table`): the Python call sites of every synchronizing CUDA call in one step
  (``torch.cuda.set_sync_debug_mode("warn")``); the backward runs on autograd's thread, whose syncs
  have no Python frame and are listed as such.
"""

from __future__ import annotations

import collections
import traceback
import warnings
from pathlib import Path
from typing import NamedTuple

from torch.autograd import DeviceType

REPO = str(Path(__file__).resolve().parents[1])
# CUDA runtime calls that block the host until the device (or a stream) is done.
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


class Span(NamedTuple):
    start: float  # microseconds, one clock for host and device events
    end: float
    label: str


def idle_summary(kernels: list[Span], syncs: list[Span], min_gap_us: float = 0.0) -> dict:
    """Idle time of the device between ``kernels`` (any stream: busy = the union of their spans).

    Returns ``busy_us``, ``idle_us``, ``gaps`` (count), ``by_next`` {label of the kernel that ends the
    gap: [idle us, gaps]} and ``by_sync`` {label of a host sync that ends inside the gap: [idle us, gaps]}
    (a gap holding several syncs is charged to the last). Gaps shorter than ``min_gap_us`` count in
    ``idle_us`` but are not attributed (launch-rate noise)."""
    spans = sorted(kernels)
    by_next = collections.defaultdict(lambda: [0.0, 0])
    by_sync = collections.defaultdict(lambda: [0.0, 0])
    sync_ends = sorted((s.end, s.label) for s in syncs)
    busy = idle = 0.0
    gaps = 0
    covered_until = None
    j = 0
    for span in spans:
        if covered_until is None:
            busy += span.end - span.start
            covered_until = span.end
            continue
        gap = span.start - covered_until
        if gap > 0:
            idle += gap
            gaps += 1
            while j < len(sync_ends) and sync_ends[j][0] < covered_until:
                j += 1
            last_sync = None
            while j < len(sync_ends) and sync_ends[j][0] <= span.start:
                last_sync = sync_ends[j][1]
                j += 1
            if gap >= min_gap_us:
                entry = by_next[span.label]
                entry[0] += gap
                entry[1] += 1
                if last_sync is not None:
                    entry = by_sync[last_sync]
                    entry[0] += gap
                    entry[1] += 1
            busy += span.end - span.start
            covered_until = span.end
        elif span.end > covered_until:
            busy += span.end - covered_until
            covered_until = span.end
    return {"busy_us": busy, "idle_us": idle, "gaps": gaps, "by_next": dict(by_next), "by_sync": dict(by_sync)}


def _backward_node(event) -> str:
    parent = event
    while parent is not None and not parent.name.startswith("autograd::engine::evaluate_function: "):
        parent = parent.cpu_parent
    return "" if parent is None else " (bwd " + parent.name.split(": ", 1)[1] + ")"


NOT_OPERATORS = {"overhead", "cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"}
DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}  # Kineto's activity types; not syncs or annotations


def _is_device_work(raw) -> bool:
    if hasattr(raw, "activity_type"):
        return str(raw.activity_type()) in DEVICE_WORK
    return not (raw.name().startswith("ProfilerStep") or getattr(raw, "is_user_annotation", lambda: False)())


def spans_from_profile(prof) -> tuple[list[Span], list[Span]]:
    """(device kernels and copies labelled by the operator that launched them, host syncs labelled by the
    operator that made them) from a finished profile."""
    ops = {}  # correlation id -> the innermost operator (frontend event) of a launch
    for event in prof.events():
        # runtime calls (cudaLaunchKernel, cuLaunchKernelEx...) and the profiler's own overhead events number
        # their ids apart from the operators'
        kind = str(getattr(event, "activity_type", "") or "")
        if event.device_type == DeviceType.CPU and kind not in NOT_OPERATORS and \
                not event.name.startswith(("cu", "Activity Buffer")):
            ops[event.id] = event
    kernels, syncs = [], []
    for raw in prof.profiler.kineto_results.events():
        op = ops.get(raw.linked_correlation_id())
        label = "?" if op is None else op.name + _backward_node(op)
        start = raw.start_ns() / 1e3
        span = Span(start, start + raw.duration_ns() / 1e3, label)
        if raw.device_type() == DeviceType.CUDA:
            # the device timeline also carries the ranges of record_function scopes (ProfilerStep#n spans
            # a whole step): only kernels, copies and fills keep the device busy
            if _is_device_work(raw):
                kernels.append(span)
        elif raw.name() in SYNC_CALLS:
            syncs.append(span._replace(label=f"{raw.name()} in {label}"))
    return kernels, syncs


def idle_table(prof, steps: int, top: int = 25, min_gap_us: float = 2.0) -> str:
    """Markdown: idle device time per step, by the operator whose kernel ended the gap and by host sync."""
    kernels, syncs = spans_from_profile(prof)
    s = idle_summary(kernels, syncs, min_gap_us)
    lines = [f"Device idle between kernels: {s['idle_us'] / 1e3 / steps:.1f} ms per step in {s['gaps'] / steps:.0f} "
             f"gaps (busy {s['busy_us'] / 1e3 / steps:.1f} ms; gaps under {min_gap_us:g} us are counted, not "
             f"attributed). By the operator that launched the kernel ending the gap:", "",
             "| # | operator | gaps / step | idle ms / step | mean us |", "| --- | --- | --- | --- | --- |"]
    for i, (label, (us, n)) in enumerate(sorted(s["by_next"].items(), key=lambda kv: -kv[1][0])[:top], 1):
        lines.append(f"| {i} | `{label[:90]}` | {n / steps:.0f} | {us / 1e3 / steps:.3f} | {us / n:.0f} |")
    lines += ["", f"Of that, gaps in which a host sync ended ({len(syncs) / steps:.0f} sync calls per step), by sync:",
              "", "| # | sync | gaps / step | idle ms / step |", "| --- | --- | --- | --- |"]
    for i, (label, (us, n)) in enumerate(sorted(s["by_sync"].items(), key=lambda kv: -kv[1][0])[:top], 1):
        lines.append(f"| {i} | `{label[:90]}` | {n / steps:.1f} | {us / 1e3 / steps:.3f} |")
    return "\n".join(lines) + "\n"


def sync_sites_table(sites: collections.Counter) -> str:
    """Markdown: a :class:`SyncCensus`'s sites, most syncs first."""
    lines = [f"Host syncs of one step (`torch.cuda.set_sync_debug_mode`, {sum(sites.values())} in all), by call site:",
             "", "| site | syncs |", "| --- | --- |"]
    lines += [f"| `{site}` | {count} |" for site, count in sites.most_common()]
    return "\n".join(lines) + "\n"


class SyncCensus:
    """Call ``step()`` after every training step (it also steps ``profiler``, if given). During step
    ``census_step`` (0-based) every synchronizing CUDA call is recorded with its innermost frame in this
    repository (or the nearest frame outside it); ``sites`` maps it to a count."""

    def __init__(self, census_step: int, profiler=None):
        self.census_step, self.profiler, self.steps_done = census_step, profiler, 0
        self.sites: collections.Counter = collections.Counter()
        self._saved = None
        if census_step == 0:
            self._start()

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()
        if self.steps_done == self.census_step:
            self._stop()
        self.steps_done += 1
        if self.steps_done == self.census_step:
            self._start()

    def _start(self) -> None:
        import torch

        torch.cuda.synchronize()
        self._saved = warnings.showwarning
        warnings.showwarning = self._record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def _stop(self) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        if self._saved is not None:
            warnings.showwarning = self._saved
            self._saved = None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return self._saved(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        if frames and frames[-1].name == "set_sync_debug_mode":
            return  # the census switching itself off
        if any("torch/autograd" in f.filename for f in frames[-2:]):
            site = "backward (autograd's thread: replayed at the end of backward, no frame)"
        else:
            ours = [f for f in frames if f.filename.startswith(REPO) and not f.filename.startswith(REPO + "/tools/")]
            frame = (ours or frames)[-1]
            site = f"{frame.filename.replace(REPO + '/', '')}:{frame.lineno} {frame.name}"
        self.sites[site] += 1
