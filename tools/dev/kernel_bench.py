"""The kernel-vs-reference harness of the elementwise kernel benchmarks (``bench_short_conv.py``,
``bench_rms_norm.py``).

A benchmark gives its cases and, per case, the inputs and a forward closure for each implementation
(``"kernel"``: the Triton kernel; ``"reference"``: the PyTorch path it replaced). :func:`measure` checks
that the two agree (``max |kernel - reference| / max |reference|`` for the output and each input
gradient), times forward and forward+backward of both (median of CUDA events; wall clock under
``--smoke``), and adds the speedups and the kernel's GB/s from the bytes the benchmark says the op must
move at least. :func:`main` is the command line both scripts share: GPU cases in bf16 by default, tiny
fp32 cases under Triton's CPU interpreter with ``--smoke``, a table, and the JSON report.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Sequence

IMPLS = ("kernel", "reference")


def measure(case: dict, forwards: dict, inputs: Sequence, grad_out, names: Sequence[str], tolerance: float,
            warmup: int, iters: int, cuda: bool, min_bytes: tuple[int, int]) -> dict:
    """One result row: ``case`` + ``max_rel_error`` + ``{impl}_fwd_ms`` / ``{impl}_fwd_bwd_ms`` +
    ``speedup_*`` + ``kernel_*_gb_per_s``. ``names`` label the output and the gradients of ``inputs``;
    ``min_bytes`` = (forward, forward+backward) bytes. Exits when the two disagree beyond ``tolerance``."""
    import torch

    from tools.bench_common import local_median_ms

    def steps(forward: Callable):
        def forward_backward():
            y = forward()
            return (y, *torch.autograd.grad(y, inputs, grad_out))
        return forward, forward_backward

    timed = {impl: steps(forwards[impl]) for impl in IMPLS}
    results = {impl: timed[impl][1]() for impl in IMPLS}
    errors = {}
    for name, got, ref in zip(names, results["kernel"], results["reference"]):
        ref = ref.float()
        errors[name] = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    if max(errors.values()) > tolerance:
        raise SystemExit(f"kernel and reference disagree at {case}: {errors}")
    row = {**case, "max_rel_error": errors}
    for impl, (forward, forward_backward) in timed.items():
        row[f"{impl}_fwd_ms"] = local_median_ms(forward, warmup, iters, cuda)
        row[f"{impl}_fwd_bwd_ms"] = local_median_ms(forward_backward, warmup, iters, cuda)
    for suffix, nbytes in zip(("fwd", "fwd_bwd"), min_bytes):
        row[f"speedup_{suffix}"] = row[f"reference_{suffix}_ms"] / row[f"kernel_{suffix}_ms"]
        row[f"kernel_{suffix}_gb_per_s"] = nbytes / (row[f"kernel_{suffix}_ms"] * 1e-3) / 1e9
    return row


def print_table(rows: list[dict], case_columns: Sequence[tuple[str, int, Callable[[dict], object]]]) -> None:
    """One line per row: the case columns (header, width, value of a row), then the timings."""
    head = " ".join(f"{title:>{width}}" for title, width, _ in case_columns)
    header = (f"{head} | {'kernel fwd':>10} {'ref fwd':>8} {'x':>6} | {'kernel f+b':>10} {'ref f+b':>8} {'x':>6} | "
              f"{'GB/s fwd':>8} {'f+b':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        case = " ".join(f"{value(r)!s:>{width}}" for _, width, value in case_columns)
        print(f"{case} | {r['kernel_fwd_ms']:>10.3f} {r['reference_fwd_ms']:>8.3f} {r['speedup_fwd']:>5.1f}x | "
              f"{r['kernel_fwd_bwd_ms']:>10.3f} {r['reference_fwd_bwd_ms']:>8.3f} {r['speedup_fwd_bwd']:>5.1f}x | "
              f"{r['kernel_fwd_gb_per_s']:>8.0f} {r['kernel_fwd_bwd_gb_per_s']:>6.0f}")


def main(argv, *, description: str, op: str, default_out: str, gpu_cases: list, smoke_cases: list,
         bench_case: Callable[..., dict], case_columns) -> list[dict]:
    """Parse ``--out/--smoke/--warmup/--iters``, run ``bench_case(*case, device, dtype_name, warmup, iters)``
    for every case, print the table, write the report."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=None, help=f"JSON path (GPU default: {default_out}; smoke: none)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 cases on the CPU Triton interpreter")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is first imported
    import torch

    if args.smoke:
        device, dtype_name, cases, out_path, warmup, iters = "cpu", "fp32", smoke_cases, args.out, 0, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter check")
        device, dtype_name, cases = "cuda", "bf16", gpu_cases
        out_path, warmup, iters = args.out or default_out, args.warmup, args.iters
    rows = [bench_case(*case, device, dtype_name, warmup, iters) for case in cases]
    print_table(rows, case_columns)
    if out_path:
        from tools.bench_common import write_kernel_report

        cuda = device == "cuda"
        write_kernel_report(out_path, op, cuda, f"median ms of {iters} (CUDA events)" if cuda else "median wall ms (smoke)",
                            rows)
    return rows
