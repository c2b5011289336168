"""The g_min sweep's outputs (``tools/gmin_sweep.py``): its JSON (rewritten after every setting), the plot of training
loss and of held-out loss against context length, and the printed table."""

from __future__ import annotations

import json
import math
import os


def write_outputs(summary: dict, args, log) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, args.json)
    if args.plot:
        try:
            plot_sweep(summary, args.plot)
        except Exception as exc:  # the JSON is what matters; say why the plot is missing
            log(f"    plot failed: {exc}")


def plot_sweep(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summary["settings"]:
        curve = [(i, x) for i, x in s.get("train_curve") or [] if math.isfinite(x)]
        if curve:
            a.plot(*zip(*curve), label=s["name"])
        rows = [r for r in s.get("lengths") or [] if r.get("loss") is not None and math.isfinite(r["loss"])]
        if rows:
            b.plot([r["length"] for r in rows], [r["loss"] for r in rows], marker="o", label=s["name"])
    a.set_xlabel("iteration")
    a.set_ylabel("training loss (nats/token)")
    a.set_title("training loss")
    b.axvline(summary["train_length"], color="grey", linestyle=":", label="training length")
    b.set_xscale("log", base=2)
    b.set_xlabel("context length (tokens)")
    b.set_ylabel("held-out loss (nats/token)")
    b.set_title("held-out loss vs context length")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"g_min sweep: {summary['config']} ({summary['device']})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(summary: dict) -> str:
    lines = [f"{'setting':<10} {'steps':>5} {'train':>7} {'held@1x':>8} {'held@max':>8} {'past-train':>10} "
             f"{'kernel ms':>9} {'nonfinite':>9}  status"]
    for s in summary["settings"]:
        rows = [r for r in s.get("lengths") or [] if r.get("loss") is not None]
        last = rows[-1] if rows else {}
        nf = s.get("nonfinite") or {}
        nonfinite = sum(v for v in nf.values() if isinstance(v, int)) + (s.get("heldout_nonfinite") or 0)
        fmt = lambda x: f"{x:.4f}" if isinstance(x, (int, float)) and x is not None else "-"  # noqa: E731
        kernel = (s.get("kernel_ms") or {}).get("ms")
        lines.append(f"{s['name']:<10} {s.get('steps', 0):>5} {fmt(s.get('train_loss')):>7} "
                     f"{fmt(s.get('heldout_loss_train_length')):>8} {fmt(last.get('loss')):>8} "
                     f"{fmt(last.get('loss_beyond_train')):>10} {kernel if kernel is not None else '-':>9} "
                     f"{nonfinite:>9}  {s.get('status', '')}")
    return "\n".join(lines)
