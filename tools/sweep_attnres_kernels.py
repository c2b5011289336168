"""Sweep the depth-attention kernels' launch layouts (``kernels/attn_res/fused.py``) on the GPU.

Each config changes module constants of fused.py from their defaults. The measure is one training
step's depth-attention calls as the benchmark model makes them (``bench_attnres_kernel.schedule_step``:
N = 8 blocks over 16 sublayers and the final mix, bf16, T = 8192, h = 2048, in-place block grads, fused
norms, each layer's two mixers paired as in the model; ``--unpaired``: every call on its own, the measure
before 2026-12-02 17:00): the CUDA time of the forward, backward and finish kernels (torch profiler, mean of a
few steps, so host time and launch gaps do not count), each kernel call's microseconds in call order, and the
step's ``do_bench`` median, in rounds that visit the configs in alternating order (the GPU clocks up over the
first seconds; a config timed only first would look slow). Every config's grads are compared with the
default's (max |diff| / max |ref|).

Triton compiles ~26 specialisations per config (n = 1..9, accumulate masks, the norm); ``--jobs`` runs the
compiles in parallel processes on a tiny token count first (same specialisation keys), then times in this
process from the warm cache.

    python tools/sweep_attnres_kernels.py [--only a,b] [--out docs/bench/attnres-sweep-h200.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels.attn_res.fused as fused  # noqa: E402
from tools import bench_common  # noqa: E402
from tools.bench_attnres_kernel import schedule_step  # noqa: E402

# (name, {fused.py constant: value}); register counts from an offline sm_90 compile (n = 9, h = 2048, the norm).
# The defaults: one row over 4 warps both ways (forward: the n loads first, rows held packed, 128 registers, 4
# programs per SM; backward: sources reloaded in the grad loop, old grads loaded after their source's reductions,
# rows packed, 255 registers, 2 programs per SM), 32 columns per finish program. Each config names every constant
# it depends on, so that its meaning does not move with the defaults ("unpacked": the defaults before 2026-12-02).
_UNPACKED_FORWARD = {"FORWARD_PACK_ROWS": False}
_UNPACKED_BACKWARD = {"BACKWARD_PIPELINE": 0, "BACKWARD_PACK_ROWS": False}
_OLD_FORWARD = {**_UNPACKED_FORWARD, "FORWARD_VALUES_PER_THREAD": 8, "FORWARD_PRELOAD": False}  # 8 warps, 48 registers
_OLD_BACKWARD = {**_UNPACKED_BACKWARD, "BACKWARD_PRELOAD_VALUES_PER_THREAD": 4,  # 16 warps, 128 registers
                 "BACKWARD_RELOAD": False}
# Row sums one source at a time, the forward uncapped: every config below measured before 2026-12-02 21:30 keeps its
# meaning with it.
_BEFORE_BATCHED_SUMS = {"FORWARD_SOURCES_PER_REDUCTION": 1, "BACKWARD_SOURCES_PER_REDUCTION": 1,
                        "FORWARD_MAXNREG": None}
_EARLIER_CONFIGS = [
    ("unpacked", {**_UNPACKED_FORWARD, **_UNPACKED_BACKWARD}),  # the defaults 2026-12-01 to 2026-12-02
    ("fwd-unpacked", _UNPACKED_FORWARD),
    ("bwd-unpacked", _UNPACKED_BACKWARD),
    ("old-layouts", {**_OLD_FORWARD, **_OLD_BACKWARD, "FINISH_BLOCK": 128}),  # before the 2026-12-01 sweep
    ("fwd-old", _OLD_FORWARD),
    ("fwd-no-preload", {**_UNPACKED_FORWARD, "FORWARD_PRELOAD": False}),  # 72 registers
    ("fwd-8vpt-preload", {**_UNPACKED_FORWARD, "FORWARD_VALUES_PER_THREAD": 8}),  # 8 warps, 79 registers
    # Forward opt-ins (fused.py: FORWARD_PACK_ROWS, the sources' bf16 rows held as int32 pairs; FORWARD_NEXT_TILE, a
    # persistent grid with the next tile's rows in flight while this one is mixed, 1 source by source into the
    # registers each frees, 2 all n at the tile's top). ptxas sm_90 with Triton 3.8 (kernels/_compile_check, pointers
    # aligned), n = 9, h = 2048, without | with the fused norm: registers, spill-store bytes, programs per SM from the
    # registers; [unpacked, same layout]. Default 128, 0 | 128, 0, 4 per SM. Not run on a GPU.
    ("fwd-pack", {"FORWARD_PACK_ROWS": True}),  # 128, 0 | 128, 0; 4 per SM [same; 1688 -> 1624 instructions]
    ("fwd-pack-32vpt", {"FORWARD_PACK_ROWS": True,  # 1 row over 2 warps: 255, 0 | 255, 0; 4 per SM
                        "FORWARD_VALUES_PER_THREAD": 32}),  # [255, 0 | 255, 68]
    ("fwd-pack-2rows", {"FORWARD_PACK_ROWS": True, "FORWARD_VALUES_PER_THREAD": 32,  # 2 rows over 4 warps:
                        "FORWARD_TILE_ELEMENTS": 4096}),  # 255, 0 | 255, 0; 2 per SM [255, 0 | 255, 24]
    ("fwd-next1-pack", {"FORWARD_PACK_ROWS": True, "FORWARD_NEXT_TILE": 1}),  # 195, 0 | 186, 0; 2 per SM
    # [255, 4 | 254, 0]
    ("fwd-next2-pack", {"FORWARD_PACK_ROWS": True, "FORWARD_NEXT_TILE": 2}),  # 255, 20 | 255, 0; 2 per SM
    # [255, 0 | 255, 8]
    ("fwd-next1-8vpt-pack", {"FORWARD_PACK_ROWS": True, "FORWARD_NEXT_TILE": 1,  # 8 warps: 107, 0 | 106, 0;
                             "FORWARD_VALUES_PER_THREAD": 8}),  # 2 per SM [128, 0 | 130, 0; 2 | 1 per SM]
    ("fwd-next2-8vpt-pack", {"FORWARD_PACK_ROWS": True, "FORWARD_NEXT_TILE": 2,  # 8 warps: 128, 0 | 128, 0;
                             "FORWARD_VALUES_PER_THREAD": 8}),  # 2 per SM [165, 0 | 166, 0; 1 per SM]
    ("fwd-next2-4vpt-pack", {"FORWARD_PACK_ROWS": True, "FORWARD_NEXT_TILE": 2,  # 16 warps: 64, 0 | 64, 0;
                             "FORWARD_VALUES_PER_THREAD": 4}),  # 2 per SM [90, 0 | 99, 0; 1 per SM]
    ("bwd-old", _OLD_BACKWARD),
    ("bwd-4vpt-reload", {**_UNPACKED_BACKWARD, "BACKWARD_PRELOAD_VALUES_PER_THREAD": 4}),  # 16 warps, 104 registers
    ("bwd-8vpt-reload", {**_UNPACKED_BACKWARD, "BACKWARD_PRELOAD_VALUES_PER_THREAD": 8}),  # 8 warps, 128 registers
    # half the partial-sum rows for the finish kernel
    ("bwd-1-per-sm", {**_UNPACKED_BACKWARD, "BACKWARD_PROGRAMS_PER_SM": 1}),
    ("finish-16", {"FINISH_BLOCK": 16}),  # 128 finish programs instead of 64 (all SMs busy)
    ("finish-64", {"FINISH_BLOCK": 64}),  # 32 finish programs instead of 64
    ("finish-128", {"FINISH_BLOCK": 128}),  # 16: the block before the 2026-12-01 sweep
    # Overlapping loads with the backward's compute and stores (preload_bwd.py: PIPELINE bits 1 old grads after
    # their source's reductions, 2 the next tile's rows during this tile's grad pass, 4 sources reloaded one ahead;
    # PACK rows held as int32 pairs; STAGES Triton's pipelining). ptxas sm_90 with Triton 3.8 (kernels/_compile_check,
    # pointers aligned), n = 9 with the norm, every source accumulated | the widest pair (8 shared blocks): registers,
    # spill-store bytes; default 255, 48 | 255, 52. "bwd" ms: this sweep on the H200 (2026-12-02, Triton 3.6 there),
    # the step's 17 calls, default 3.63.
    ("bwd-pack", {"BACKWARD_PIPELINE": 0, "BACKWARD_PACK_ROWS": True}),  # 255, 16 | 255, 48; 2 per SM; 3.70
    ("bwd-pipe1", {"BACKWARD_PIPELINE": 1, "BACKWARD_PACK_ROWS": False}),  # 255, 76 | 255, 240; 2 per SM; 3.67
    ("bwd-pipe1-pack", {"BACKWARD_PIPELINE": 1, "BACKWARD_PACK_ROWS": True}),  # 255, 44 | 255, 164; 2 per SM; 3.01
    ("bwd-pipe5-pack", {"BACKWARD_PIPELINE": 5, "BACKWARD_PACK_ROWS": True}),  # 255, 68 | 255, 348; 2 per SM
    ("bwd-pipe3-pack", {"BACKWARD_PIPELINE": 3, "BACKWARD_PACK_ROWS": True}),  # 255, 148 | 255, 604; 2 per SM; 3.85
    ("bwd-pipe3-8vpt-pack", {"BACKWARD_PIPELINE": 3, "BACKWARD_PACK_ROWS": True,  # 8 warps: 178 | 254, no spills;
                             "BACKWARD_PRELOAD_VALUES_PER_THREAD": 8}),  # 1 per SM (n <= 2: 2); 4.73
    ("bwd-pipe3-4vpt-pack", {"BACKWARD_PIPELINE": 3, "BACKWARD_PACK_ROWS": True,  # 16 warps: 128 | 128, no spills;
                             "BACKWARD_PRELOAD_VALUES_PER_THREAD": 4}),  # 1 per SM; 5.20
    # Triton's own pipelining (cp.async into shared memory, issued after the tile's last store and waited for at
    # the next tile's top, so little overlap): 139 KB | 160 KB of shared memory, 1 per SM (n <= 5: 2)
    ("bwd-stages2", {**_UNPACKED_BACKWARD, "BACKWARD_TILE_STAGES": 2}),  # 255, 140 | 255, 336; 3.35
    ("bwd-stages2-8vpt", {**_UNPACKED_BACKWARD, "BACKWARD_TILE_STAGES": 2,
                          "BACKWARD_PRELOAD_VALUES_PER_THREAD": 8}),  # 155 | 199, 0; 3.83
    # a pair's second call's own pass (one source, with the handoff; default capped at 168: 166 registers, no spills,
    # three per SM, 62 us a call on the H200): uncapped 167 offline but two per SM on the H200, 74 us; 128: 32 bytes
    # spilled, four per SM, 58 us (docs/attn_res.md, "The second call's mix gradient handed over")
    ("bwd-subset-uncapped", {"BACKWARD_SUBSET_MAXNREG": None}),
    ("bwd-subset-128", {"BACKWARD_SUBSET_MAXNREG": 128}),
]
CONFIGS = [
    ("default", {}),
    *[(name, {**_BEFORE_BATCHED_SUMS, **changes}) for name, changes in _EARLIER_CONFIGS],
    ("batch1", _BEFORE_BATCHED_SUMS),  # the default before 2026-12-02 21:30
    # the row sums of 2 / 4 sources in one reduction, for every call (the default picks by the call's width;
    # fused.py). ptxas sm_90, Triton 3.8, n = 9 with the norm: forward 128 | 128 | 168 registers at 1 | 2 | 4, no
    # spills; the widest pair 255 registers, spills 120 | 24 | 44 bytes
    ("fwd-batch2", {"FORWARD_SOURCES_PER_REDUCTION": 2}),
    ("fwd-batch4", {"FORWARD_SOURCES_PER_REDUCTION": 4}),
    ("bwd-batch2", {"BACKWARD_SOURCES_PER_REDUCTION": 2}),
    ("bwd-batch4", {"BACKWARD_SOURCES_PER_REDUCTION": 4}),
    # the forward capped at 128 registers for every call / for none (the default: from 7 sources): four programs per
    # SM at n = 8 (three uncapped), 96 bytes spilled at n = 9
    ("fwd-cap128", {"FORWARD_MAXNREG": 128}),
    ("fwd-uncapped", {"FORWARD_MAXNREG": None}),
]
KERNELS = {"_depth_attention_fwd_kernel": "fwd", "_depth_attention_bwd_preload_kernel": "bwd",
           "_depth_attention_bwd_kernel": "bwd", "_depth_attention_finish_kernel": "finish"}


def layout_changes(name: str) -> dict:
    """The constants of a layout name; ``a+b``: both layouts' changes (a forward and a backward one together)."""
    configs = dict(CONFIGS)
    return {key: value for part in name.split("+") for key, value in configs[part].items()}


def layout(changes: dict):
    """fused.py with ``changes`` applied inside the block (also used by ``bench_attnres --ab-kernel``)."""
    return bench_common.constants_layout(fused, changes)


def kernel_ms(step, paired: bool, steps: int = 5) -> dict:
    """:func:`kernel_times` of ``steps`` steps under the torch profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(paired)
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernel_times(events, steps)


def kernel_times(events, steps: int) -> dict:
    """From the CUDA kernels of ``steps`` identical steps, ``(name, start, microseconds)``: ms per step of the
    depth-attention kernel groups (``fwd``, ``bwd``, ``finish``, their sum ``attn_res``, and ``other``), and
    ``calls``: each group's microseconds per call in call order, the mean over the steps."""
    total = {"fwd": 0.0, "bwd": 0.0, "finish": 0.0, "other": 0.0}
    sequences = {"fwd": [], "bwd": [], "finish": []}
    for name, _, us in sorted(events, key=lambda e: e[1]):
        group = KERNELS.get(name, "other")
        total[group] += us / 1e3 / steps
        if group != "other":
            sequences[group].append(us)
    total["attn_res"] = total["fwd"] + total["bwd"] + total["finish"]
    result = {k: round(v, 4) for k, v in total.items()}
    calls = {}
    for group, seq in sequences.items():
        if len(seq) % steps:
            raise ValueError(f"{len(seq)} {group} kernels are not {steps} equal steps")
        per = len(seq) // steps
        calls[group] = [round(sum(seq[k * per + j] for k in range(steps)) / steps, 1) for j in range(per)]
    result["calls"] = calls
    return result


def compile_all(names: list[str], jobs: int, extra: tuple = ()) -> None:
    """Compile each config's specialisations in its own process (tiny T, same keys), ``jobs`` at once;
    ``extra``: more arguments for those processes."""
    pending, running = list(names), []
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            running.append(subprocess.Popen([sys.executable, __file__, "--compile-only", name, *extra],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        proc = running.pop(0)
        _, err = proc.communicate()
        if proc.returncode:
            print(f"compile of one config failed: {err[-400:]}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=None, help="comma list of config names (default: all)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--tolerance", type=float, default=2e-2)
    parser.add_argument("--unpaired", dest="paired", action="store_false",
                        help="every call's backward on its own (the measure before 2026-12-02 17:00), not paired")
    parser.add_argument("--compile-only", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    wanted = set(args.only.split(",")) if args.only else None
    configs = [(n, c) for n, c in CONFIGS if wanted is None or n in wanted or n == "default"]
    if args.compile_only:
        changes = dict(CONFIGS)[args.compile_only]
        bench_common.set_constants(fused, changes)
        schedule_step(device, torch.bfloat16, 64, args.hidden)(args.paired)
        torch.cuda.synchronize()
        return
    t0 = datetime.datetime.now(datetime.timezone.utc)
    compile_all([n for n, _ in configs], args.jobs, () if args.paired else ("--unpaired",))
    print(f"compiled {len(configs)} configs in {(datetime.datetime.now(datetime.timezone.utc) - t0).seconds} s",
          flush=True)
    import triton.testing

    step = schedule_step(device, torch.bfloat16, args.tokens, args.hidden)
    rows = {name: dict(config=name, changes=changes, step_ms=[], kernels=[]) for name, changes in configs}
    reference = None
    for name, changes in configs:  # grads first (also warms every config up)
        try:
            with layout(changes):
                grads = step(args.paired)
            if reference is None:
                reference = grads
            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                      for a, b in zip(grads, reference))
            rows[name].update(max_rel_diff=err, agrees=err <= args.tolerance)
        except Exception as exc:  # a config that does not compile or crashes: reported, sweep goes on
            rows[name]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for name, changes in order:
            if "error" in rows[name]:
                continue
            with layout(changes):
                rows[name]["step_ms"].append(triton.testing.do_bench(lambda: step(args.paired), return_mode="median"))
                rows[name]["kernels"].append(kernel_ms(step, args.paired))
    table = []
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:24s} ERROR {row['error'][:120]}")
            continue
        best = min(row["kernels"], key=lambda k: k["attn_res"])
        row["best_kernels"] = best
        row["median_step_ms"] = sorted(row["step_ms"])[len(row["step_ms"]) // 2]
        table.append(row)
    base = rows["default"].get("best_kernels", {}).get("attn_res")
    print(f"{'config':24s} {'fwd':>7s} {'bwd':>7s} {'finish':>7s} {'kernels':>8s} {'vs def':>7s} {'step':>7s} agrees")
    for row in sorted(table, key=lambda r: r["best_kernels"]["attn_res"]):
        k = row["best_kernels"]
        print(f"{row['config']:24s} {k['fwd']:7.3f} {k['bwd']:7.3f} {k['finish']:7.3f} {k['attn_res']:8.3f} "
              f"{k['attn_res'] / base:7.3f} {row['median_step_ms']:7.3f} {row['agrees']} ({row['max_rel_diff']:.1e})")
    print("backward us per call, in call order (the final mix first; paired: each MLP mixer's own pass, then its pair):")
    for row in table:
        print(f"  {row['config']:22s} {row['best_kernels']['calls']['bwd']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), date=t0.strftime("%Y-%m-%d %H:%M UTC"), torch=torch.__version__,
            triton=__import__("triton").__version__, tokens=args.tokens, hidden=args.hidden, paired=args.paired,
            what="one step's 17 depth-attention calls (N = 8, 16 sublayers), CUDA ms per kernel group and us per "
                 "call (best of rounds), and do_bench step medians", rows=list(rows.values())), indent=1))


if __name__ == "__main__":
    main()
