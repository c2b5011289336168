"""Benchmark the fused causal short conv + SiLU kernel against the PyTorch path it replaces.

On a GPU (default): [s, b, C] = [4096, 2, 2048] and [16384, 1, 2048], K = 4, bf16 activations, fp32
weight (as CausalShortConv holds it). For each shape it checks that kernel and reference agree, then
times forward and forward+backward (median of CUDA events after a warm-up), prints a table and writes
JSON (``--out``). The reference is the old module path: permute, F.pad, depthwise F.conv1d, F.silu,
transpose (weight cast to bf16), autograd through those ops.

``--smoke``: tiny fp32 shapes on the CPU under Triton's interpreter (wall-clock median); checks the
code paths, not the speed. JSON is written only when ``--out`` is given.

    python tools/bench_short_conv.py [--out docs/bench/short-conv-h200.json]
    python tools/bench_short_conv.py --smoke [--out /tmp/smoke.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_OUT = "docs/bench/short-conv-h200.json"
GPU_SHAPES = [(4096, 2, 2048), (16384, 1, 2048)]  # (s, b, C)
SMOKE_SHAPES = [(21, 2, 48), (13, 1, 130)]  # off the tiles; small: the interpreter is slow
KERNEL_SIZE = 4
# Agreement bound, max |kernel - reference| / max |reference| per tensor: bf16 rounds y, dx and the
# reference's weight once (relative 2^-8); fp32 only reorders sums.
TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"JSON path (GPU default: {DEFAULT_OUT}; smoke: none)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU Triton interpreter")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    return parser.parse_args(argv)


def make_steps(impl, x, weight, grad_out):
    """(forward, forward+backward) closures; forward+backward returns (y, dx, dweight)."""
    import torch

    from kernels.short_conv import causal_conv_silu, causal_conv_silu_reference

    def forward():
        if impl == "kernel":
            return causal_conv_silu(x, weight, use_kernel=True)
        return causal_conv_silu_reference(x, weight)

    def forward_backward():
        y = forward()
        return (y, *torch.autograd.grad(y, (x, weight), grad_out))

    return forward, forward_backward


def bench_shape(seq, batch, channels, device, dtype_name, warmup, iters):
    import torch

    from tools.bench_common import local_median_ms

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator(device=device).manual_seed(seq)
    x = torch.randn(seq, batch, channels, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(channels, KERNEL_SIZE, generator=gen, device=device)).requires_grad_()
    grad_out = torch.randn(batch, seq, channels, generator=gen, device=device).to(dtype)
    results = {impl: make_steps(impl, x, weight, grad_out)[1]() for impl in ("kernel", "reference")}
    errors = {}
    for i, name in enumerate(("y", "dx", "dweight")):
        ref = results["reference"][i].float()
        errors[name] = ((results["kernel"][i].float() - ref).abs().max() / ref.abs().max()).item()
    if max(errors.values()) > TOLERANCE[dtype_name]:
        raise SystemExit(f"kernel and reference disagree at [s, b, C] = [{seq}, {batch}, {channels}]: {errors}")
    row = {"s": seq, "b": batch, "C": channels, "K": KERNEL_SIZE, "dtype": dtype_name, "max_rel_error": errors}
    cuda = device == "cuda"
    for impl in ("kernel", "reference"):
        forward, forward_backward = make_steps(impl, x, weight, grad_out)
        row[f"{impl}_fwd_ms"] = local_median_ms(forward, warmup, iters, cuda)
        row[f"{impl}_fwd_bwd_ms"] = local_median_ms(forward_backward, warmup, iters, cuda)
    row["speedup_fwd"] = row["reference_fwd_ms"] / row["kernel_fwd_ms"]
    row["speedup_fwd_bwd"] = row["reference_fwd_bwd_ms"] / row["kernel_fwd_bwd_ms"]
    # Bytes the kernels must move at least: forward reads x, writes y; backward reads x and dy, writes dx.
    tensor_bytes = seq * batch * channels * x.element_size()
    row["kernel_fwd_gb_per_s"] = 2 * tensor_bytes / (row["kernel_fwd_ms"] * 1e-3) / 1e9
    row["kernel_fwd_bwd_gb_per_s"] = 5 * tensor_bytes / (row["kernel_fwd_bwd_ms"] * 1e-3) / 1e9
    return row


def print_table(rows):
    header = (f"{'s':>6} {'b':>2} {'C':>5} | {'kernel fwd':>10} {'ref fwd':>8} {'x':>6} | "
              f"{'kernel f+b':>10} {'ref f+b':>8} {'x':>6} | {'GB/s fwd':>8} {'f+b':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['s']:>6} {r['b']:>2} {r['C']:>5} | {r['kernel_fwd_ms']:>10.3f} {r['reference_fwd_ms']:>8.3f} "
              f"{r['speedup_fwd']:>5.1f}x | {r['kernel_fwd_bwd_ms']:>10.3f} {r['reference_fwd_bwd_ms']:>8.3f} "
              f"{r['speedup_fwd_bwd']:>5.1f}x | {r['kernel_fwd_gb_per_s']:>8.0f} {r['kernel_fwd_bwd_gb_per_s']:>6.0f}")


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is first imported
    import torch

    if args.smoke:
        device, dtype_name, shapes, out_path = "cpu", "fp32", SMOKE_SHAPES, args.out
        warmup, iters = 0, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter check")
        device, dtype_name, shapes, out_path = "cuda", "bf16", GPU_SHAPES, args.out or DEFAULT_OUT
        warmup, iters = args.warmup, args.iters
    rows = [bench_shape(s, b, c, device, dtype_name, warmup, iters) for s, b, c in shapes]
    print_table(rows)
    if out_path:
        from tools.bench_common import write_kernel_report

        write_kernel_report(
            out_path, "kernels.short_conv.causal_conv_silu (Triton) vs causal_conv_silu_reference (conv1d path)",
            device == "cuda", f"median ms of {iters} (CUDA events)" if device == "cuda" else "median wall ms (smoke)",
            rows)

if __name__ == "__main__":
    repo_root = Path(__file__).resolve().parents[1]
    if str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))
    main()
