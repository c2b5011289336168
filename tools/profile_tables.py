"""Markdown tables from a finished ``torch.profiler.profile`` of a few training steps.

* :func:`kernel_table`: the top kernels by self device time (CUDA; CPU ops on the CPU).
* :func:`op_table`: device time per operator, with the autograd node that ran it in backward
  (``bwd: MulBackward0``), so that anonymous elementwise kernels get a name a reader can act on.
* :func:`host_table`: the host (CPU) time per operator and runtime call: where a step that launches
  faster than the GPU runs would not be limited by the CPU, and where it is.
* :func:`report`: those three, plus on the GPU ``tools/gpu_idle.py``'s device idle time and host syncs.
"""

from __future__ import annotations

import collections

from torch.autograd import DeviceType


def _label(text: str, width: int = 90) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def kernel_table(prof, steps: int, cuda: bool, top: int = 20) -> str:
    events = list(prof.key_averages())
    if cuda:
        events = [e for e in events if e.device_type == DeviceType.CUDA] or events
        key, unit = "self_device_time_total", "CUDA"
    else:
        key, unit = "self_cpu_time_total", "CPU"
    events = [e for e in events if not e.key.startswith("ProfilerStep")]  # the profiler's own step ranges
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    lines = [f"Top {top} kernels by {unit} time (ms per step; % of all {unit} time, {total / 1e3 / steps:.1f} ms "
             "per step):", "", f"| # | kernel | calls / step | {unit} ms / step | % |", "| --- | --- | --- | --- | --- |"]
    for i, e in enumerate(events[:top], 1):
        us = getattr(e, key)
        lines.append(f"| {i} | `{_label(e.key)}` | {e.count / steps:.0f} | {us / 1e3 / steps:.3f} | "
                     f"{100 * us / total:.1f} |")
    return "\n".join(lines) + "\n"


def _backward_node(event) -> str:
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("autograd::engine::evaluate_function: "):
        parent = parent.cpu_parent
    return "" if parent is None else "bwd: " + parent.name.split(": ", 1)[1]


def op_table(prof, steps: int, cuda: bool, top: int = 25) -> str:
    """Device time of the kernels each operator launched (CPU: its own CPU time), per (operator, backward
    node)."""
    totals = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type != DeviceType.CPU or event.name.startswith(("ProfilerStep", "autograd::engine")):
            continue
        us = sum(k.duration for k in event.kernels) if cuda else event.self_cpu_time_total
        if us <= 0:
            continue
        entry = totals[(event.name, _backward_node(event))]
        entry[0] += us
        entry[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    grand = sum(t for t, _ in totals.values()) or 1.0
    unit = "the device time of their kernels" if cuda else "CPU time"
    lines = [f"Top {top} operators by {unit} (forward ops have no backward node):", "",
             "| # | operator | backward node | calls / step | ms / step | % |", "| --- | --- | --- | --- | --- | --- |"]
    for i, ((name, node), (us, calls)) in enumerate(rows[:top], 1):
        lines.append(f"| {i} | `{_label(name, 60)}` | {node or '-'} | {calls / steps:.0f} | {us / 1e3 / steps:.3f} | "
                     f"{100 * us / grand:.1f} |")
    return "\n".join(lines) + "\n"


def host_table(prof, steps: int, top: int = 25) -> str:
    """Self CPU time per operator / CUDA runtime call (ms per step), largest first."""
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU
              and not e.key.startswith("ProfilerStep")]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    lines = [f"Top {top} host-side entries by self CPU time ({total / 1e3 / steps:.1f} ms per step in all):", "",
             "| # | operator / runtime call | calls / step | self CPU ms / step | % |", "| --- | --- | --- | --- | --- |"]
    for i, e in enumerate(events[:top], 1):
        lines.append(f"| {i} | `{_label(e.key, 60)}` | {e.count / steps:.0f} | {e.self_cpu_time_total / 1e3 / steps:.3f} | "
                     f"{100 * e.self_cpu_time_total / total:.1f} |")
    return "\n".join(lines) + "\n"


def report(prof, steps: int, cuda: bool, sync_sites=None) -> str:
    """All tables of a profiled run of ``steps`` recorded steps: kernels, operators, on the GPU the device's idle
    time (and a :class:`tools.gpu_idle.SyncCensus`'s ``sites`` if given), host time."""
    from tools.gpu_idle import idle_table, sync_sites_table

    tables = [kernel_table(prof, steps, cuda, top=30), op_table(prof, steps, cuda, top=40)]
    if cuda:
        tables.append(idle_table(prof, steps))
        if sync_sites is not None:
            tables.append(sync_sites_table(sync_sites))
    return "\n".join(tables + [host_table(prof, steps)])
