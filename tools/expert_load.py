"""Per-layer MoE expert load of a training run, from its ``metrics.jsonl`` or TensorBoard events.

    python tools/expert_load.py RUN_DIR [--source auto|jsonl|tensorboard] [--plot out.png]
    python tools/expert_load.py --compare RUN_A RUN_B [--plot out.png]

RUN_DIR holds ``metrics.jsonl`` and/or the main TensorBoard run (its event files directly, or in
``RUN_DIR/tensorboard``); the job may still be running. The report has, per MoE layer: MaxVio now
(the last logged step) and its min / max over the run; the EP load factor now and the most loaded
EP rank with the iteration since which it has been the most loaded; the hottest and coldest
experts (tokens over the layer mean, at the last step with per-expert counts, every
``log_images_interval``); dropped and rerouted pairs over the logged steps (capacity modes).
``--compare`` sets two runs' MaxVio side by side (e.g. ``qb_bias`` against ``aux_loss``).
``--plot`` writes the heatmap of the latest per-expert load and MaxVio over iterations (one PNG).
``--ranks`` also reads every rank's own TensorBoard run (``rank_<r>``) and lists the most loaded
ranks: the tokens their experts received over their own EP group's mean (with data parallelism each
EP group is its own all-to-all), mean over the rank's layers, now and over the run.
Under pipeline parallelism every layer appears once (the logging rank gathers all stages).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.moe.load_history import (  # noqa: E402
    LoadHistory,
    find_tensorboard_dir,
    rank_dirs,
    read_run,
    read_tensorboard,
)

NUM_EXTREMES = 3  # hottest / coldest experts listed per layer
NUM_RANKS_LISTED = 8  # --ranks: the most loaded ranks


@dataclass
class LayerSummary:
    layer: int
    maxvio_now: float
    maxvio_min: float
    maxvio_max: float
    maxvio_mean: float
    ep_load_now: float | None
    most_loaded_rank: int | None
    most_loaded_since: int | None  # first iteration of the rank's current streak as most loaded
    hottest: list[tuple[int, float]]  # (expert, tokens / layer mean), hottest first
    coldest: list[tuple[int, float]]  # coldest first
    dropped: float
    rerouted: float


def _streak_start(iterations: list[int], values: list[float]) -> int | None:
    if not values:
        return None
    start = len(values) - 1
    while start > 0 and values[start - 1] == values[-1]:
        start -= 1
    return iterations[start]


def latest_load(history: LoadHistory) -> tuple[int | None, dict[int, np.ndarray]]:
    """The last iteration with per-expert counts and each layer's tokens over its mean there."""
    if not history.expert_load:
        return None, {}
    it = max(history.expert_load)
    out = {}
    for layer, counts in history.expert_load[it].items():
        c = np.asarray(counts, dtype=np.float64)
        out[layer] = c / c.mean() if c.mean() > 0 else np.ones_like(c)
    return it, out


def summarize(history: LoadHistory) -> list[LayerSummary]:
    _, loads = latest_load(history)
    summaries = []
    for layer in history.layers:
        _, maxvio = history.series(f"moe/maxvio/layer_{layer}")
        _, ep_load = history.series(f"moe/ep_load_factor/layer_{layer}")
        rank_its, ranks = history.series(f"moe/ep_most_loaded_rank/layer_{layer}")
        load = loads.get(layer)
        order = [] if load is None else np.argsort(-load, kind="stable").tolist()
        n = min(NUM_EXTREMES, len(order) // 2)
        summaries.append(LayerSummary(
            layer=layer, maxvio_now=maxvio[-1], maxvio_min=min(maxvio), maxvio_max=max(maxvio),
            maxvio_mean=sum(maxvio) / len(maxvio),
            ep_load_now=ep_load[-1] if ep_load else None,
            most_loaded_rank=int(ranks[-1]) if ranks else None,
            most_loaded_since=_streak_start(rank_its, ranks),
            hottest=[(e, float(load[e])) for e in order[:n]],
            coldest=[(e, float(load[e])) for e in order[::-1][:n]],
            dropped=sum(history.series(f"moe/dropped/layer_{layer}")[1]),
            rerouted=sum(history.series(f"moe/rerouted/layer_{layer}")[1]),
        ))
    return summaries


def _experts(pairs: list[tuple[int, float]]) -> str:
    return ", ".join(f"e{e} {load:.2f}" for e, load in pairs) or "-"


def report(history: LoadHistory) -> str:
    summaries = summarize(history)
    if not summaries:
        return f"{history.source}: no MoE metrics (moe/maxvio/layer_<l>) yet"
    its = history.iterations
    load_it, _ = latest_load(history)
    with_drops = any(s.dropped or s.rerouted for s in summaries)
    lines = [f"{history.source}: {len(its)} logged steps, iterations {its[0]}-{its[-1]}, "
             f"EP{history.ep_size}, expert load at iteration {load_it if load_it is not None else '-'}",
             f"{'layer':>5} | {'MaxVio now':>10} {'min':>7} {'max':>7} | {'EP load':>7} {'rank':>4} {'since':>6} | "
             f"{'hottest experts (load/mean)':<30} | {'coldest experts':<30}"
             + (" | dropped rerouted" if with_drops else "")]
    for s in summaries:
        ep = (f"{s.ep_load_now:7.3f} {s.most_loaded_rank:4d} {s.most_loaded_since:6d}" if s.ep_load_now is not None
              else f"{'-':>7} {'-':>4} {'-':>6}")
        line = (f"{s.layer:5d} | {s.maxvio_now:10.4f} {s.maxvio_min:7.4f} {s.maxvio_max:7.4f} | {ep} | "
                f"{_experts(s.hottest):<30} | {_experts(s.coldest):<30}")
        lines.append(line + (f" | {s.dropped:7.0f} {s.rerouted:8.0f}" if with_drops else ""))
    mean = sum(s.maxvio_now for s in summaries) / len(summaries)
    lines.append(f"{'mean':>5} | {mean:10.4f}")
    return "\n".join(line.rstrip() for line in lines)


def compare(a: LoadHistory, b: LoadHistory, names: tuple[str, str]) -> str:
    """Per layer, MaxVio now / mean over the run / max of run A and run B; last row: mean of the layers."""
    sa, sb = ({s.layer: s for s in summarize(h)} for h in (a, b))
    width = max(6, *(len(n) for n in names))
    lines = [f"A = {names[0]}: {a.source}", f"B = {names[1]}: {b.source}", "MaxVio now / mean over the run / max",
             f"{'layer':>5}" + "".join(f" | {n:>{width}}{'now':>8} {'mean':>7} {'max':>7}" for n in names)]

    def cells(picked: list) -> str:
        return "".join(f" | {' ' * width}{c[0]:8.4f} {c[1]:7.4f} {c[2]:7.4f}" if c else f" | {'-':>{width + 24}}"
                       for c in picked)

    for layer in sorted(set(sa) | set(sb)):
        lines.append(f"{layer:5d}" + cells([(s.maxvio_now, s.maxvio_mean, s.maxvio_max) if s else None
                                             for s in (sa.get(layer), sb.get(layer))]))
    means = [tuple(np.mean([getattr(s, f) for s in run.values()]) for f in ("maxvio_now", "maxvio_mean", "maxvio_max"))
             if run else None for run in (sa, sb)]
    lines.append(f"{'mean':>5}" + cells(means))
    return "\n".join(lines)


def plot(histories: list[LoadHistory], names: list[str], path: str) -> None:
    """One PNG: the latest load heatmap of each run (top) and MaxVio over iterations (bottom)."""
    from megatron_ext.moe.load_figures import draw_load_heatmap, draw_maxvio_curves, new_figure

    fig = new_figure(10.0 * len(histories), 9.0)
    grid = fig.add_gridspec(2, len(histories), height_ratios=(1.2, 1.0))
    for col, (history, name) in enumerate(zip(histories, names)):
        it, loads = latest_load(history)
        ax = fig.add_subplot(grid[0, col])
        if loads:
            layers = sorted(loads)
            draw_load_heatmap(fig, ax, np.stack([loads[layer] for layer in layers]), layers, history.ep_size,
                              title=f"{name}: expert load, iteration {it}")
        else:
            ax.set_title(f"{name}: no per-expert counts yet")
    curves = {}
    for history, name in zip(histories, names):
        layers = history.layers
        per_layer = [history.series(f"moe/maxvio/layer_{layer}") for layer in layers]
        if len(histories) == 1 and len(layers) <= 12:
            curves.update({f"layer {layer}": series for layer, series in zip(layers, per_layer)})
        for label, reduce in (("mean", np.mean), ("max", np.max)):
            its = sorted(set.intersection(*(set(i) for i, _ in per_layer))) if per_layer else []
            values = [reduce([dict(zip(*s))[i] for s in per_layer]) for i in its]
            curves[f"{name}: {label} over layers" if len(histories) > 1 else f"{label} over layers"] = (its, values)
    draw_maxvio_curves(fig.add_subplot(grid[1, :]), curves, title="MaxVio per logged step")
    fig.savefig(path)


def rank_table(tensorboard_dir) -> str:
    """The most loaded ranks by ``moe/ep_rank_load/mean`` at the last logged step."""
    rows = []
    for rank, path in rank_dirs(tensorboard_dir).items():
        its, loads = read_tensorboard(path).series("moe/ep_rank_load/mean")
        if loads:
            rows.append((rank, its[-1], loads[-1], sum(loads) / len(loads), max(loads)))
    if not rows:
        return f"{tensorboard_dir}: no rank_<r> runs with moe/ep_rank_load"
    rows.sort(key=lambda row: (-row[2], row[0]))
    lines = [f"ranks by tokens received over their EP group's mean (mean over their layers), "
             f"{len(rows)} ranks, the {min(len(rows), NUM_RANKS_LISTED)} most loaded:",
             f"{'rank':>5} {'iteration':>9} {'now':>7} {'run mean':>8} {'run max':>7}"]
    lines += [f"{r:5d} {it:9d} {now:7.3f} {mean:8.3f} {top:7.3f}" for r, it, now, mean, top in rows[:NUM_RANKS_LISTED]]
    return "\n".join(lines)


def _name(run_dir: str) -> str:
    return os.path.basename(os.path.normpath(run_dir)) or run_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", help="the run's metrics dir or TensorBoard dir")
    parser.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="two runs side by side")
    parser.add_argument("--source", choices=("auto", "jsonl", "tensorboard"), default="auto",
                        help="auto: metrics.jsonl when present, else the TensorBoard events")
    parser.add_argument("--plot", metavar="OUT.png", help="write the heatmap and MaxVio figure here")
    parser.add_argument("--ranks", action="store_true", help="also the most loaded ranks, from the rank_<r> runs")
    args = parser.parse_args(argv)
    run_dirs = args.compare or ([args.run_dir] if args.run_dir else [])
    if len(run_dirs) not in (1, 2) or (args.compare and args.run_dir):
        parser.error("give RUN_DIR or --compare RUN_A RUN_B")
    try:
        histories = [read_run(d, args.source) for d in run_dirs]
    except FileNotFoundError as exc:
        parser.exit(2, f"error: {exc}\n")
    names = [_name(d) for d in run_dirs]
    print(compare(*histories, names=tuple(names)) if len(histories) == 2 else report(histories[0]))
    for run_dir in run_dirs if args.ranks else []:
        tb = find_tensorboard_dir(run_dir)
        print(rank_table(tb) if tb is not None else f"{run_dir}: no TensorBoard run for --ranks")
    if args.plot:
        plot(histories, names, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
