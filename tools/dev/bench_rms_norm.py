"""Benchmark the fused RMSNorm kernel against the PyTorch path it replaces.

On a GPU (default), bf16 activations, fp32 weight: [8192, 2048] (the hidden norms of one 8192-token step)
and [8192 * 16, 128] (the KDA head norm, 16 heads of 128), each plain and gated (the KDA output
``norm(o) * sigmoid(g)``; the reference is the layer's old ops). For each case it checks that kernel and
reference agree, then times forward and forward+backward (median of CUDA events after a warm-up), prints a
table and writes JSON (``--out``).

``--smoke``: tiny fp32 shapes on the CPU under Triton's interpreter (wall-clock median); checks the
code paths, not the speed. JSON is written only when ``--out`` is given.

    python tools/dev/bench_rms_norm.py [--out docs/bench/rms-norm-h200.json]
    python tools/dev/bench_rms_norm.py --smoke [--out /tmp/smoke.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_OUT = "docs/bench/rms-norm-h200.json"
GPU_CASES = [(8192, 2048, False), (8192 * 16, 128, False), (8192 * 16, 128, True)]  # (rows, h, gated)
SMOKE_CASES = [(37, 2048, False), (45, 128, False), (45, 128, True)]  # rows off the tiles
EPS = 1e-5
# Agreement bound, max |kernel - reference| / max |reference| per tensor: bf16 rounds y, dx, dgate once
# (relative 2^-8; the gated reference rounds twice); fp32 only reorders sums.
TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}


def bench_case(rows, hidden, gated, device, dtype_name, warmup, iters):
    import torch

    from kimi_kernels.rms_norm import gated_rms_norm_reference, rms_norm, rms_norm_reference
    from tools.dev.kernel_bench import measure

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator(device=device).manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).requires_grad_()
    gate = torch.randn(rows, hidden, generator=gen, device=device).to(dtype).requires_grad_() if gated else None
    grad_out = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    reference = (lambda: gated_rms_norm_reference(x, weight, EPS, gate)) if gated else \
        (lambda: rms_norm_reference(x, weight, EPS))
    forwards = {"kernel": lambda: rms_norm(x, weight, EPS, gate=gate, use_kernel=True), "reference": reference}
    inputs, names = ((x, weight, gate), ("y", "dx", "dweight", "dgate")) if gated else \
        ((x, weight), ("y", "dx", "dweight"))
    # Bytes the kernels must move at least: forward reads x (and the gate), writes y; backward reads x, dy
    # (and the gate), writes dx (and dgate).
    tensor_bytes = rows * hidden * x.element_size()
    fwd_tensors, bwd_tensors = (3, 5) if gated else (2, 3)
    case = {"rows": rows, "h": hidden, "gated": gated, "dtype": dtype_name}
    return measure(case, forwards, inputs, grad_out, names, TOLERANCE[dtype_name], warmup, iters, device == "cuda",
                   (fwd_tensors * tensor_bytes, (fwd_tensors + bwd_tensors) * tensor_bytes))


def main(argv=None):
    from tools.dev.kernel_bench import main as kernel_bench_main

    return kernel_bench_main(
        argv, description=__doc__.split("\n\n")[0], default_out=DEFAULT_OUT, gpu_cases=GPU_CASES,
        smoke_cases=SMOKE_CASES, bench_case=bench_case,
        op="kimi_kernels.rms_norm.rms_norm (Triton) vs rms_norm_reference / gated_rms_norm_reference (torch ops)",
        case_columns=[("rows", 7, lambda r: r["rows"]), ("h", 5, lambda r: r["h"]),
                      ("gate", 4, lambda r: "yes" if r["gated"] else "no")])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
