"""Benchmark our chunk_kda against fla's (bf16, one GPU): correctness, first-call time, median fwd and fwd+bwd,
per-kernel breakdowns of both (fwd+bwd, and the forward alone). Prints a table last and writes JSON rows to --out.

fla 0.6.0 refuses some gated backward kernels on Hopper with triton < 3.7.1 (a flag check in
fla.ops.common.chunk_o). Should its KDA backward raise that error, the flag is switched on for the
timing only (recorded in the JSON as fla_note); the numbers then measure fla's kernels as shipped.
"""

import argparse
import datetime
import json
import time

import torch
import triton.testing

from kimi_kernels.kda import chunk_kda, kda_gate_lower_bound, naive_chunk_kda

# (B, T, H, D); the last is one KDA layer of bench_e2e's model at sequence 4096 (micro-batch 2, 16 heads), where
# the kernels' share of the end-to-end step is decided
SHAPES = [(4, 8192, 32, 128), (1, 8192, 64, 128), (2, 16384, 16, 128), (2, 4096, 16, 128)]
LOWER_BOUND = -5.0


def make_inputs(B, T, H, D, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    x = dict(q=rnd(B, T, H, D), k=rnd(B, T, H, D), v=rnd(B, T, H, D), g=rnd(B, T, H, D),
             beta=torch.rand(B, T, H, device="cuda", generator=gen))
    x = {n: t.to(dtype).requires_grad_() for n, t in x.items()}
    x["A_log"] = (rnd(H) * 0.5).requires_grad_()
    x["dt_bias"] = rnd(H * D).requires_grad_()
    return x


def call(fn, x, gate, extra=None):
    lb = LOWER_BOUND if gate == "lower_bound" else None
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
              lower_bound=lb, **(extra or {}))
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)[0]


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check_correctness(fla_kda, heads):
    """bf16 ours vs the fp32 reference and vs fla on a small shape; relative max errors. Run after the timings
    with a timed shape's head count: fla's autotune keys hold H, not B or T, so its configs (tuned at the timed
    shape) are reused here instead of tuned a second time, for minutes, at a shape no timing uses."""
    x = make_inputs(1, 1024, heads, 128)
    out = {}
    o = call(chunk_kda, x, "lower_bound")
    do = torch.randn_like(o)
    o.backward(do)
    ours_grads = {n: t.grad.clone() for n, t in x.items()}
    ref = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    g = kda_gate_lower_bound(ref["g"], ref["A_log"], ref["dt_bias"], LOWER_BOUND)
    o_ref, _ = naive_chunk_kda(ref["q"], ref["k"], ref["v"], g, ref["beta"], use_qk_l2norm=True)
    o_ref.backward(do.float())
    out["o_vs_fp32_ref"] = rel_err(o, o_ref)
    out.update({f"d{n}_vs_fp32_ref": rel_err(ours_grads[n], ref[n].grad) for n in x})
    if fla_kda is not None:
        out["o_vs_fla"] = rel_err(o, call(fla_kda, x, "lower_bound", dict(safe_gate=True)))
    return out


def first_call_ms(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def bench(fn, x, gate, extra=None):
    def fwd():
        with torch.no_grad():
            call(fn, x, gate, extra)

    def fwdbwd():
        call(fn, x, gate, extra).backward(do)

    do = torch.randn_like(x["v"])
    first = first_call_ms(fwdbwd)
    grads = [t for t in x.values()]
    out = dict(first_call_ms=first,
               fwd_ms=triton.testing.do_bench(fwd, return_mode="median"),
               fwdbwd_ms=triton.testing.do_bench(fwdbwd, grad_to_none=grads, return_mode="median"))
    print(f"  {getattr(fn, '__module__', '?')} {gate}: {out}", flush=True)
    return out


def kernel_breakdown(fn, x, gate, extra=None, backward=True):
    """CUDA time per kernel name over one call of fn (torch profiler), in ms: fwd+bwd, or the forward alone under
    no_grad (what inference runs; fla's backward re-runs some forward kernels, so the fwd+bwd table alone cannot
    split its forward out)."""
    do = torch.randn_like(x["v"])

    def once():
        if backward:
            call(fn, x, gate, extra).backward(do)
        else:
            with torch.no_grad():
                call(fn, x, gate, extra)

    once()
    for t in x.values():  # else the profiled backward adds into the warm-up's grads (elementwise adds)
        t.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.key[:60]] = rows.get(e.key[:60], 0.0) + e.device_time_total / 1e3
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def import_fla():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        return fla_chunk_kda
    except ImportError:
        return None


def bench_fla(fla_kda, x):
    extra = dict(safe_gate=True)
    try:
        return bench(fla_kda, x, "lower_bound", extra), None
    except RuntimeError as err:
        if "3.7.1" not in str(err):
            raise
        import fla.ops.common.chunk_o as chunk_o
        chunk_o.TRITON_ABOVE_3_7_1 = True
        return bench(fla_kda, x, "lower_bound", extra), f"fla raised '{str(err)[:80]}...'; flag bypassed"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs/bench/kda-h200.json")
    parser.add_argument("--shapes", default="all", help="'all' or an index list like 0,1")
    parser.add_argument("--skip-fla", action="store_true", help="time ours only (fla autotunes for minutes)")
    parser.add_argument("--skip-softplus", action="store_true",
                        help="time the lower-bounded gate only (an A/B of kernels: half the compiles and timings)")
    parser.add_argument("--commit", default=None,
                        help="the commit to record in the JSON (the device's copy of a tree may carry stale git metadata)")
    args = parser.parse_args()
    device, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    fla_kda = None if args.skip_fla else import_fla()
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    rows, correctness = [], None
    breakdowns = {"kernel_breakdown_ms": {}, "kernel_breakdown_fwd_ms": {}, "fla_kernel_breakdown_ms": {},
                  "fla_kernel_breakdown_fwd_ms": {}}  # per shape; fla's only where fla ran
    for B, T, H, D in shapes:
        x = make_inputs(B, T, H, D)
        ours = bench(chunk_kda, x, "lower_bound")
        soft = {} if args.skip_softplus else bench(chunk_kda, x, "softplus")
        fla, note = bench_fla(fla_kda, x) if fla_kda is not None else ({}, "fla not importable")
        row = dict(B=B, T=T, H=H, D=D, ours_fwd_ms=ours["fwd_ms"], ours_fwdbwd_ms=ours["fwdbwd_ms"],
                   fla_fwd_ms=fla.get("fwd_ms"), fla_fwdbwd_ms=fla.get("fwdbwd_ms"),
                   ours_softplus_fwd_ms=soft.get("fwd_ms"), ours_softplus_fwdbwd_ms=soft.get("fwdbwd_ms"),
                   ours_first_call_ms=ours["first_call_ms"], fla_first_call_ms=fla.get("first_call_ms"),
                   fla_note=note, device=device, date=date)
        rows.append(row)
        shape = f"B{B}_T{T}_H{H}_D{D}"
        for prefix, fn, extra in [("", chunk_kda, None)] + ([("fla_", fla_kda, dict(safe_gate=True))] if fla else []):
            breakdowns[f"{prefix}kernel_breakdown_ms"][shape] = kernel_breakdown(fn, x, "lower_bound", extra)
            breakdowns[f"{prefix}kernel_breakdown_fwd_ms"][shape] = kernel_breakdown(fn, x, "lower_bound", extra,
                                                                                     backward=False)
        print(json.dumps(row), flush=True)
        for key, table in breakdowns.items():
            if shape in table:
                print(f"{key}:", json.dumps(table[shape], indent=1), flush=True)
        del x
        torch.cuda.empty_cache()
        if correctness is None:
            correctness = check_correctness(fla_kda, H)
            print("correctness (relative max error, bf16):", json.dumps(correctness, indent=1), flush=True)
        with open(args.out, "w") as fh:  # after every shape, so a run cut short still leaves its rows
            json.dump(dict(commit=args.commit, rows=rows, correctness=correctness, **breakdowns), fh, indent=1)
    print(f"\n{'shape':<22}{'ours fwd':>10}{'fla fwd':>10}{'ours f+b':>10}{'fla f+b':>10}{'softplus f+b':>14}"
          f"{'speedup f+b':>12}")
    for r in rows:
        fla_fb = r["fla_fwdbwd_ms"]
        speed = f"{fla_fb / r['ours_fwdbwd_ms']:.2f}x" if fla_fb else "-"
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"B{r['B']} T{r['T']} H{r['H']} D{r['D']:<6}{fmt(r['ours_fwd_ms']):>10}{fmt(r['fla_fwd_ms']):>10}"
              f"{fmt(r['ours_fwdbwd_ms']):>10}{fmt(fla_fb):>10}{fmt(r['ours_softplus_fwdbwd_ms']):>14}{speed:>12}")


if __name__ == "__main__":
    main()
