"""Benchmark the fused RMSNorm kernel against the PyTorch path it replaces.

On a GPU (default), bf16 activations, fp32 weight: [8192, 2048] (the hidden norms of one 8192-token step)
and [8192 * 16, 128] (the KDA head norm, 16 heads of 128), each plain and gated (the KDA output
``norm(o) * sigmoid(g)``; the reference is the layer's old ops). For each case it checks that kernel and
reference agree, then times forward and forward+backward (median of CUDA events after a warm-up), prints a
table and writes JSON (``--out``).

``--smoke``: tiny fp32 shapes on the CPU under Triton's interpreter (wall-clock median); checks the
code paths, not the speed. JSON is written only when ``--out`` is given.

    python tools/bench_rms_norm.py [--out docs/bench/rms-norm-h200.json]
    python tools/bench_rms_norm.py --smoke [--out /tmp/smoke.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_OUT = "docs/bench/rms-norm-h200.json"
GPU_CASES = [(8192, 2048, False), (8192 * 16, 128, False), (8192 * 16, 128, True)]  # (rows, h, gated)
SMOKE_CASES = [(37, 2048, False), (45, 128, False), (45, 128, True)]  # rows off the tiles
EPS = 1e-5
# Agreement bound, max |kernel - reference| / max |reference| per tensor: bf16 rounds y, dx, dgate once
# (relative 2^-8; the gated reference rounds twice); fp32 only reorders sums.
TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"JSON path (GPU default: {DEFAULT_OUT}; smoke: none)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU Triton interpreter")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    return parser.parse_args(argv)


def make_steps(impl, x, weight, gate, grad_out):
    """(forward, forward+backward) closures; forward+backward returns (y, dx, dweight[, dgate])."""
    import torch

    from kernels.rms_norm import gated_rms_norm_reference, rms_norm, rms_norm_reference

    def forward():
        if impl == "kernel":
            return rms_norm(x, weight, EPS, gate=gate, use_kernel=True)
        if gate is None:
            return rms_norm_reference(x, weight, EPS)
        return gated_rms_norm_reference(x, weight, EPS, gate)

    inputs = (x, weight) if gate is None else (x, weight, gate)

    def forward_backward():
        y = forward()
        return (y, *torch.autograd.grad(y, inputs, grad_out))

    return forward, forward_backward


def bench_case(rows, hidden, gated, device, dtype_name, warmup, iters):
    import torch

    from tools.bench_common import local_median_ms

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator(device=device).manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).requires_grad_()
    gate = torch.randn(rows, hidden, generator=gen, device=device).to(dtype).requires_grad_() if gated else None
    grad_out = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    results = {impl: make_steps(impl, x, weight, gate, grad_out)[1]() for impl in ("kernel", "reference")}
    errors = {}
    for i, name in enumerate(("y", "dx", "dweight", "dgate")[: len(results["kernel"])]):
        ref = results["reference"][i].float()
        errors[name] = ((results["kernel"][i].float() - ref).abs().max() / ref.abs().max()).item()
    if max(errors.values()) > TOLERANCE[dtype_name]:
        raise SystemExit(f"kernel and reference disagree at [{rows}, {hidden}] gated={gated}: {errors}")
    row = {"rows": rows, "h": hidden, "gated": gated, "dtype": dtype_name, "max_rel_error": errors}
    cuda = device == "cuda"
    for impl in ("kernel", "reference"):
        forward, forward_backward = make_steps(impl, x, weight, gate, grad_out)
        row[f"{impl}_fwd_ms"] = local_median_ms(forward, warmup, iters, cuda)
        row[f"{impl}_fwd_bwd_ms"] = local_median_ms(forward_backward, warmup, iters, cuda)
    row["speedup_fwd"] = row["reference_fwd_ms"] / row["kernel_fwd_ms"]
    row["speedup_fwd_bwd"] = row["reference_fwd_bwd_ms"] / row["kernel_fwd_bwd_ms"]
    # Bytes the kernels must move at least: forward reads x (and the gate), writes y; backward reads x, dy
    # (and the gate), writes dx (and dgate).
    tensor_bytes = rows * hidden * x.element_size()
    fwd_tensors, bwd_tensors = (3, 5) if gated else (2, 3)
    row["kernel_fwd_gb_per_s"] = fwd_tensors * tensor_bytes / (row["kernel_fwd_ms"] * 1e-3) / 1e9
    fwd_bwd_bytes = (fwd_tensors + bwd_tensors) * tensor_bytes
    row["kernel_fwd_bwd_gb_per_s"] = fwd_bwd_bytes / (row["kernel_fwd_bwd_ms"] * 1e-3) / 1e9
    return row


def print_table(rows):
    header = (f"{'rows':>7} {'h':>5} {'gate':>4} | {'kernel fwd':>10} {'ref fwd':>8} {'x':>6} | "
              f"{'kernel f+b':>10} {'ref f+b':>8} {'x':>6} | {'GB/s fwd':>8} {'f+b':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['rows']:>7} {r['h']:>5} {'yes' if r['gated'] else 'no':>4} | {r['kernel_fwd_ms']:>10.3f} "
              f"{r['reference_fwd_ms']:>8.3f} {r['speedup_fwd']:>5.1f}x | {r['kernel_fwd_bwd_ms']:>10.3f} "
              f"{r['reference_fwd_bwd_ms']:>8.3f} {r['speedup_fwd_bwd']:>5.1f}x | "
              f"{r['kernel_fwd_gb_per_s']:>8.0f} {r['kernel_fwd_bwd_gb_per_s']:>6.0f}")


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is first imported
    import torch

    if args.smoke:
        device, dtype_name, cases, out_path = "cpu", "fp32", SMOKE_CASES, args.out
        warmup, iters = 0, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter check")
        device, dtype_name, cases, out_path = "cuda", "bf16", GPU_CASES, args.out or DEFAULT_OUT
        warmup, iters = args.warmup, args.iters
    rows = [bench_case(r, h, g, device, dtype_name, warmup, iters) for r, h, g in cases]
    print_table(rows)
    if out_path:
        from tools.bench_common import write_kernel_report

        write_kernel_report(
            out_path, "kernels.rms_norm.rms_norm (Triton) vs rms_norm_reference / gated_rms_norm_reference (torch ops)",
            device == "cuda", f"median ms of {iters} (CUDA events)" if device == "cuda" else "median wall ms (smoke)",
            rows)


if __name__ == "__main__":
    repo_root = Path(__file__).resolve().parents[1]
    if str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))
    main()
