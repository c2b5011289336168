"""Time the quantile-balancing routing math against plain top-k.

Default shape: N = 65536 tokens, E = 256 experts, k = 8, fp32 sigmoid scores with per-expert
offsets (so capacity mode has real overflow work), on CUDA when present. ``--scores FILE`` (from
``tools/router_scores.py``) routes a trained checkpoint's recorded scores instead, with its router's
bias: the most skewed MoE layer (or ``--scores-layer``), its rows tiled to N; E and k come from the file.
Ops:

* ``torch.topk``: the bare selection (DESIGN.md section 8 quotes 0.90 ms on an H200);
* ``topk_routing``: top-k + gates, the baseline the ratios are against;
* ``capacity_routing`` at each ``--capacity-factor`` (one process: no collectives timed;
  add one ``E x num_bins`` int64 all-reduce per round, see docs/quantile_balancing.md), with
  its round count (``rounds``; 1 for the top-k rows): with host reads (rounds until nothing
  moves) and without (every round that can matter, ``rounds_that_can_matter``), each with the
  rounds as PyTorch ops (``torch``) and, on CUDA, as the Triton kernels (``triton``;
  ``capacity_routing(..., rounds=...)``), all eager;
* ``as trained``: a ``CapacityRouting`` with its defaults, as one-rank training routes (on CUDA: Triton
  rounds, no host reads, each call replayed from its CUDA graph; on the CPU: PyTorch rounds with reads);
* ``dual_bias_histogram`` (per microbatch) and ``dual_bias_update`` (per step).

Times are medians over ``--repeats`` calls (CUDA-synchronised). Prints a table and writes
JSON to ``--out``. ``--profile`` then also prints the kernels of ``--repeats`` calls ``as trained`` at
the first capacity factor (torch.profiler: device time per call, CPU time on the CPU). On a CPU machine use a smaller
``--num-tokens``:

    python tools/dev/bench_routing.py [--out docs/bench/routing-h200.json]
    python tools/dev/bench_routing.py --num-tokens 8192 --num-experts 64 --capacity-factor 1.25 --profile  # training's
    python tools/dev/bench_routing.py --num-tokens 4096 --repeats 5 --out /tmp/routing-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron_ext.moe.quantile import (  # noqa: E402
    capacity_routing,
    dual_bias_histogram,
    dual_bias_range,
    dual_bias_update,
    topk_routing,
)
from megatron_ext.moe.metrics import max_violation  # noqa: E402
from megatron_ext.moe.quantile_capacity import CapacityRouting  # noqa: E402
from megatron_ext.moe.router import expert_counts  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=65536)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--capacity-factor", type=float, nargs="+", default=[1.0, 1.25])
    parser.add_argument("--num-bins", type=int, default=1000)
    parser.add_argument("--skew", type=float, default=1.0, help="spread of per-expert logit offsets")
    parser.add_argument("--scores", default=None, help="recorded scores (tools/router_scores.py --scores-out)")
    parser.add_argument("--scores-layer", type=int, default=None, help="its layer (default: the most skewed)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true", help="print the kernels of the calls as trained")
    parser.add_argument("--out", default="docs/bench/routing.json", help="JSON path ('' to skip)")
    return parser.parse_args(argv)


def median_ms(fn, repeats, warmup, device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_scores(args, device):
    """(scores [N, E], selection bias or None, what they are): synthetic, or recorded (``--scores``), which also
    sets ``args.num_experts`` and ``args.k``."""
    if args.scores:
        from tools.router_scores import load_scores, tile_rows

        recorded, bias, source = load_scores(args.scores, args.scores_layer)
        args.num_experts, args.k = recorded.shape[1], source["topk"]
        bias = None if bias is None else bias.to(device)
        return tile_rows(recorded, args.num_tokens).to(device), bias, source
    gen = torch.Generator(device=device).manual_seed(0)
    offsets = torch.linspace(-args.skew, args.skew, args.num_experts, device=device)
    logits = torch.randn(args.num_tokens, args.num_experts, generator=gen, device=device) + offsets
    return logits.sigmoid(), None, dict(skew=args.skew)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    scores, selection_bias, source = make_scores(args, device)
    k, n, e = args.k, args.num_tokens, args.num_experts
    bias = torch.zeros(e, device=device) if selection_bias is None else selection_bias
    lo, hi = dual_bias_range(bias)
    counts = dual_bias_histogram(scores, bias, k, lo, hi, args.num_bins)

    def load_stats(routing):
        return {"max_vio": max_violation(expert_counts(routing.experts, e)),
                "dropped": routing.dropped.item(), "rerouted": routing.rerouted.item(),
                "rounds": routing.rounds if routing.rounds is not None else 1}

    ops = {
        "torch.topk": (lambda: scores.topk(k, dim=1), None),
        "topk_routing": (lambda: topk_routing(scores, k, selection_bias),
                         lambda: load_stats(topk_routing(scores, k, selection_bias))),
    }
    # (label, host reads, rounds): the one-rank rounds as PyTorch ops / Triton kernels
    kinds = [("reads torch", True, "torch"), ("no-reads torch", False, "torch")]
    if device.type == "cuda":
        kinds += [("reads triton", True, "triton"), ("no-reads triton", False, "triton")]
    for cf in args.capacity_factor:
        for label, host_reads, rounds in kinds:
            def run(cf=cf, host_reads=host_reads, rounds=rounds):
                return capacity_routing(scores, k, cf, bias=selection_bias, num_bins=args.num_bins,
                                        host_reads=host_reads, rounds=rounds)
            ops[f"capacity cf={cf:g} {label}"] = (run, lambda run=run: load_stats(run()))
        trained = CapacityRouting(k, cf, num_bins=args.num_bins, device=device)
        ops[f"capacity cf={cf:g} as trained"] = (lambda trained=trained: trained(scores, selection_bias),
                                                 lambda trained=trained: load_stats(trained(scores, selection_bias)))
    ops["dual_bias_histogram"] = (lambda: dual_bias_histogram(scores, bias, k, lo, hi, args.num_bins), None)
    ops["dual_bias_update"] = (lambda: dual_bias_update(counts, lo, hi, k), None)

    baseline = None
    rows = []
    for name, (fn, stats) in ops.items():
        ms = median_ms(fn, args.repeats, args.warmup, device)
        baseline = ms if name == "topk_routing" else baseline
        rows.append({"op": name, "ms": ms, **(stats() if stats else {})})
    for row in rows:
        row["vs_topk_routing"] = row["ms"] / baseline

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {device_name}   N={n} E={e} k={k} bins={args.num_bins} scores={source}")
    print(f"{'op':<34}{'ms (median)':>12}{'x topk_routing':>16}{'MaxVio':>8}{'dropped':>9}{'rerouted':>10}"
          f"{'rounds':>8}")
    for row in rows:
        extra = (f"{row['max_vio']:>8.3f}{row['dropped']:>9d}{row['rerouted']:>10d}{row['rounds']:>8d}"
                 if "max_vio" in row else "")
        print(f"{row['op']:<34}{row['ms']:>12.3f}{row['vs_topk_routing']:>16.2f}{extra}")
    if args.out:
        result = {
            "device": device_name, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "shape": {"num_tokens": n, "num_experts": e, "k": k, "num_bins": args.num_bins}, "scores": source,
            "repeats": args.repeats, "baseline": "topk_routing", "results": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.profile:
        print(profile_calls(ops[f"capacity cf={args.capacity_factor[0]:g} as trained"][0], args.repeats, device))


def profile_calls(call, calls: int, device: torch.device) -> str:
    """The kernels of ``calls`` warm calls (a graph already captured), time per call."""
    from torch.profiler import ProfilerActivity, profile

    from tools.profile_tables import kernel_table

    cuda = device.type == "cuda"
    call()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize(device)
    return kernel_table(prof, calls, cuda=cuda, top=25)


if __name__ == "__main__":
    main()
