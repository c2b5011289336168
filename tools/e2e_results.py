"""The end-to-end benchmark's results (tools/bench_e2e.py): the printed table, each row's median over repeated
runs, the JSON file (one-GPU and EP2 rows side by side) and the join of several calls of one commit."""

from __future__ import annotations

import json
from pathlib import Path

H200_DATASHEET_BF16_TFLOPS = 989.0  # H200 SXM dense bf16, NVIDIA datasheet
DATASHEET_PEAK_NAME = "H200 SXM dense bf16, NVIDIA datasheet"

TABLE_HEADER = ("name", "gpus", "seq", "mb", "step ms", "optim ms", "tokens/s", "TFLOP/s", "MFU meas.",
                f"MFU {H200_DATASHEET_BF16_TFLOPS:.0f}", "peak GB", "grads", "dropped", "rerouted")


def format_table(rows) -> str:
    """One line per row; ``MFU meas.`` is against the matmul peak measured in the run, ``MFU 989`` against the
    datasheet; dropped / rerouted are ``-`` for rows without capacity routing."""
    lines = [" | ".join(f"{h:>13}" for h in TABLE_HEADER)]
    for r in rows:
        cells = [r["name"], r["gpus"], r["seq"], r["micro_batch"]]
        if r.get("error"):
            cells.append("failed: " + r["error"][:60])
        else:
            cells += [f"{r['step_ms']:.1f}", f"{r['optimizer_ms']:.1f}", f"{r['tokens_per_sec']:,.0f}",
                      f"{r['tflops']:.1f}", f"{r['mfu']:.1%}", f"{r['mfu_datasheet']:.1%}", f"{r['peak_gb']:.2f}",
                      r.get("main_grad_dtype", ""), r.get("dropped", "-"), r.get("rerouted", "-")]
        lines.append(" | ".join(f"{c!s:>13}" for c in cells))
    return "\n".join(lines)


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per name and GPU count (first-appearance order): its middle run by step time (the lower middle for an even count;
    failed runs left out, the first failure when all failed) with ``step_ms_runs``, every run's step time."""
    by_name: dict[tuple, list[dict]] = {}
    for run in runs:
        by_name.setdefault((run["name"], run.get("gpus")), []).append(run)
    rows = []
    for group in by_name.values():
        timed = sorted((r for r in group if not r.get("error")), key=lambda r: r["step_ms"])
        middle = timed[(len(timed) - 1) // 2] if timed else group[0]
        row = {key: value for key, value in middle.items() if key != "round"}
        rows.append(dict(row, step_ms_runs=[r.get("step_ms") for r in group]))
    return rows


def merge_calls(results: list[dict], commit: str) -> dict:
    """Join the JSON of several calls that timed ``commit``: ``runs`` holds every timed run in call order (a file's
    ``runs``, or its ``rows`` where it ran one round) with its ``call``, ``rows`` each row's median over them all
    (``median_rows``), ``calls`` each file's date, peak and rows. A file that records another commit is refused;
    one that records none (an A/B's tree: tools/dev/ab.sh passes no ``--commit``) is taken as ``commit``."""
    others = sorted({str(r.get("commit")) for r in results} - {commit, "None"})
    if others:
        raise SystemExit(f"merge: the files record commit(s) {', '.join(others)}, not {commit}")
    runs = [dict(run, call=i) for i, result in enumerate(results) for run in result.get("runs") or result["rows"]]
    calls = [{"date": r.get("date"), "commit": r.get("commit"), "device": r.get("device"),
              "peak_tflops_measured": r.get("peak_tflops_measured"), "repeat": r.get("repeat", 1),
              "rows": [row["name"] for row in r["rows"]]} for r in results]
    rows = median_rows(runs)
    add_scaling_efficiency(rows)
    return {**results[-1], "rows": rows, "runs": runs, "repeat": None, "commit": commit, "calls": calls}


def add_scaling_efficiency(rows: list[dict]) -> None:
    """Multi-GPU rows get ``scaling_efficiency`` = tokens/s / (GPUs x tokens/s of the one-GPU row of the same
    name): tokens per GPU are the same in both, so 1.0 is perfect weak scaling."""
    single = {r["name"]: r.get("tokens_per_sec") for r in rows if r.get("gpus") == 1}
    for r in rows:
        base = single.get(r["name"])
        if r.get("gpus", 1) > 1 and base and r.get("tokens_per_sec"):
            r["scaling_efficiency"] = r["tokens_per_sec"] / (r["gpus"] * base)


def write_json(path: str, result: dict) -> None:
    """Write ``result``; rows of another GPU count already in ``path`` are kept (1-GPU + EP2 in one file),
    and multi-GPU rows get their scaling efficiency against the one-GPU rows."""
    out = Path(path)
    if out.exists():
        try:
            old = json.loads(out.read_text())
            kept = [r for r in old.get("rows", []) if r.get("gpus") not in {r2["gpus"] for r2 in result["rows"]}]
            result = {**result, "rows": kept + result["rows"]}
        except (json.JSONDecodeError, AttributeError, KeyError):
            pass  # an unreadable old file is replaced
    add_scaling_efficiency(result["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")  # replaced in one step: a kill mid-write leaves the last whole file
    part.write_text(json.dumps(result, indent=1) + "\n")
    part.replace(out)
