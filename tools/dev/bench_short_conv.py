"""Benchmark the fused causal short conv + SiLU kernel against the PyTorch path it replaces.

On a GPU (default): [s, b, C] = [4096, 2, 2048] and [16384, 1, 2048], K = 4, bf16 activations, fp32
weight (as CausalShortConv holds it). For each shape it checks that kernel and reference agree, then
times forward and forward+backward (median of CUDA events after a warm-up), prints a table and writes
JSON (``--out``). The reference is the old module path: permute, F.pad, depthwise F.conv1d, F.silu,
transpose (weight cast to bf16), autograd through those ops.

``--smoke``: tiny fp32 shapes on the CPU under Triton's interpreter (wall-clock median); checks the
code paths, not the speed. JSON is written only when ``--out`` is given.

    python tools/dev/bench_short_conv.py [--out docs/bench/short-conv-h200.json]
    python tools/dev/bench_short_conv.py --smoke [--out /tmp/smoke.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_OUT = "docs/bench/short-conv-h200.json"
GPU_SHAPES = [(4096, 2, 2048), (16384, 1, 2048)]  # (s, b, C)
SMOKE_SHAPES = [(21, 2, 48), (13, 1, 130)]  # off the tiles; small: the interpreter is slow
KERNEL_SIZE = 4
# Agreement bound, max |kernel - reference| / max |reference| per tensor: bf16 rounds y, dx and the
# reference's weight once (relative 2^-8); fp32 only reorders sums.
TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}


def bench_shape(seq, batch, channels, device, dtype_name, warmup, iters):
    import torch

    from kimi_kernels.short_conv import causal_conv_silu, causal_conv_silu_reference
    from tools.dev.kernel_bench import measure

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator(device=device).manual_seed(seq)
    x = torch.randn(seq, batch, channels, generator=gen, device=device).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(channels, KERNEL_SIZE, generator=gen, device=device)).requires_grad_()
    grad_out = torch.randn(batch, seq, channels, generator=gen, device=device).to(dtype)
    forwards = {"kernel": lambda: causal_conv_silu(x, weight, use_kernel=True),
                "reference": lambda: causal_conv_silu_reference(x, weight)}
    # Bytes the kernels must move at least: forward reads x, writes y; backward reads x and dy, writes dx.
    tensor_bytes = seq * batch * channels * x.element_size()
    case = {"s": seq, "b": batch, "C": channels, "K": KERNEL_SIZE, "dtype": dtype_name}
    return measure(case, forwards, (x, weight), grad_out, ("y", "dx", "dweight"), TOLERANCE[dtype_name], warmup,
                   iters, device == "cuda", (2 * tensor_bytes, 5 * tensor_bytes))


def main(argv=None):
    from tools.dev.kernel_bench import main as kernel_bench_main

    return kernel_bench_main(
        argv, description=__doc__.split("\n\n")[0], default_out=DEFAULT_OUT, gpu_cases=GPU_SHAPES,
        smoke_cases=SMOKE_SHAPES, bench_case=bench_shape,
        op="kimi_kernels.short_conv.causal_conv_silu (Triton) vs causal_conv_silu_reference (conv1d path)",
        case_columns=[("s", 6, lambda r: r["s"]), ("b", 2, lambda r: r["b"]), ("C", 5, lambda r: r["C"])])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
