"""Sweep the KDA kernels' launch configs (``kernels/kda/chunk.py``) one knob at a time on the GPU.

Each config changes one launch dict (or module constant) of chunk.py from its default; the sweep times
forward+backward of ``chunk_kda`` (lower-bounded gate, bf16, ``triton.testing.do_bench`` median) and each
kernel's CUDA time (torch profiler, one fwd+bwd), and checks the output and every input gradient against
the default config's (max |diff| / max |ref|; a config that disagrees is reported, not ranked). The
compile check (``tests/kernels/test_kda_compile.py``) asserts no spills only for the shipped defaults:
a config found faster here must pass it before it becomes the default.

    python tools/sweep_kda_kernels.py [--shape 4,8192,32,128] [--out docs/bench/kda-sweep-h200.json]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton.testing

import kernels.kda.chunk as chunk
from kernels.kda import chunk_kda
from tools import bench_common
from tools.bench_kda import call, kernel_breakdown, make_inputs

# (name, {chunk.py attribute: value}); dict values update that launch dict, others replace the constant.
CONFIGS = [
    ("default", {}),
    ("dqk-2w", {"DQK_CONFIG": dict(num_warps=2)}),
    ("dqk-8w", {"DQK_CONFIG": dict(num_warps=8)}),
    ("inter-4w", {"INTER_BWD_CONFIG": dict(num_warps=4)}),
    ("inter-bk32-4w", {"INTER_BWD_CONFIG": dict(BK=32, num_warps=4)}),
    ("inter-bv64", {"INTER_BWD_CONFIG": dict(BV=64)}),
    ("dqk-bkt64", {"BKT": 64}),
    ("intra-8w", {"INTRA_FWD_CONFIG": dict(num_warps=8)}),
    # the state walks' V tile (chunk.state_config picks per shape), warps and stages
    ("state-bv16", {"STATE_CONFIGS": (dict(BV=16, num_warps=4),)}),
    ("state-bv32", {"STATE_CONFIGS": (dict(BV=32, num_warps=4),)}),
    ("state-bv64", {"STATE_CONFIGS": (dict(BV=64, num_warps=4),)}),
    ("state-8w", {"STATE_CONFIGS": tuple(dict(BV=bv, num_warps=8) for bv in (16, 32, 64))}),
    ("state-s2", {"STATE_CONFIGS": tuple(dict(BV=bv, num_warps=4, num_stages=2) for bv in (16, 32, 64))}),
    ("dv-8w", {"DV_CONFIG": dict(num_warps=8)}),
    ("gatebwd-8w", {"GATE_BWD_CONFIG": dict(num_warps=8)}),
]


def layout(changes: dict):
    """chunk.py with ``changes`` applied inside the block (also used by ``bench_e2e``'s ``NAME@LAYOUT`` rows)."""
    return bench_common.constants_layout(chunk, changes)


def fwd_bwd_outputs(x, do):
    for t in x.values():
        t.grad = None
    o = call(chunk_kda, x, "lower_bound")
    o.backward(do)
    return [o.detach()] + [t.grad.detach().clone() for t in x.values()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4,8192,32,128", help="B,T,H,D")
    parser.add_argument("--only", default=None, help="comma list of config names (default: all)")
    parser.add_argument("--tolerance", type=float, default=2e-2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    B, T, H, D = (int(s) for s in args.shape.split(","))
    x = make_inputs(B, T, H, D)
    do = torch.randn_like(x["v"])
    names = ["o"] + [f"d{n}" for n in x]
    wanted = set(args.only.split(",")) if args.only else None
    rows, reference = [], None
    for name, changes in CONFIGS:
        if wanted is not None and name not in wanted and name != "default":
            continue
        try:
            with layout(changes):
                outs = fwd_bwd_outputs(x, do)
                if reference is None:
                    reference = outs
                err = {n: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                       for n, a, b in zip(names, outs, reference)}

                def fwdbwd():
                    call(chunk_kda, x, "lower_bound").backward(do)

                ms = triton.testing.do_bench(fwdbwd, grad_to_none=list(x.values()), return_mode="median")
                kernels = {k: round(v, 3) for k, v in kernel_breakdown(x, "lower_bound").items() if v > 0.05}
            row = dict(config=name, changes=changes, fwdbwd_ms=ms, max_rel_diff=max(err.values()),
                       agrees=max(err.values()) <= args.tolerance, kernels_ms=kernels)
        except Exception as exc:  # a config that does not compile or crashes: reported, sweep goes on
            row = dict(config=name, changes=changes, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels_ms"}), flush=True)
    base = rows[0].get("fwdbwd_ms")
    print(f"\nKDA launch sweep, B{B} T{T} H{H} D{D} bf16, {torch.cuda.get_device_name()}")
    print(f"{'config':>16} {'fwd+bwd ms':>11} {'vs default':>10} {'max diff':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:>16} {'error':>11}  {r['error'][:60]}")
        else:
            flag = "" if r["agrees"] else "  DISAGREES"
            print(f"{r['config']:>16} {r['fwdbwd_ms']:>11.3f} {base / r['fwdbwd_ms']:>9.3f}x {r['max_rel_diff']:>9.2e}{flag}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                           shape=dict(B=B, T=T, H=H, D=D), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
