"""Benchmark the fused Block AttnRes depth-attention kernel against the eager PyTorch reference.

On a GPU (default): n in {2, 5, 9} sources, T = 8192 tokens (s*b), h = 2048, bf16. For each
shape it checks that kernel and reference agree, then times forward and forward+backward
(median of ``triton.testing.do_bench``), measures the memory each keeps alive between
forward and backward, prints a table and writes JSON (``--out``).

The kernel gets the sources as a list of separate tensors (as the model produces them); the
reference gets them pre-stacked, so the stack copy a caller of the reference would pay is not
counted against it.

``--schedule``: also time one training step's depth-attention calls (N = 8 blocks over 16
sublayers and the final mix: n = 1, 2, 2, 3, 3, ..., 9, 9; blocks' grads summed in place, the
sublayer norms fused, stand-in sublayers ``p = x / 2``) forward + backward, each mixer's backward on its
own (``unpaired``) and with the attention/MLP mixers' backwards paired (``pair``, the model's default,
``attn_res_pair_backward``), under ``schedule``. Launch choices are compared across commits, not here.

``--smoke``: tiny fp32 shapes on the CPU under Triton's interpreter (the wall time of one call
instead of do_bench, no memory numbers); checks the code paths, not the speed. JSON is
written only when ``--out`` is given.

    python tools/dev/bench_attnres_kernel.py [--out docs/bench/attnres-kernel-h200.json]
    python tools/dev/bench_attnres_kernel.py --smoke [--out /tmp/smoke.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_OUT = "docs/bench/attnres-kernel-h200.json"
GPU_SHAPES = [(n, 8192, 2048) for n in (2, 5, 9)]  # (n sources, T tokens, h)
SMOKE_SHAPES = [(n, 19, 48) for n in (2, 5, 9)]
# Agreement bounds, as max |kernel - reference| / max |reference| per tensor.
# d_query / d_norm_weight: the backward uses c = dout . out with the bf16-rounded output.
TOLERANCE = {"bf16": {"out": 1e-2, "d_sources": 1e-2, "d_query": 1e-2, "d_norm_weight": 1e-2},
             "fp32": {"out": 1e-5, "d_sources": 1e-5, "d_query": 1e-5, "d_norm_weight": 1e-5}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"JSON path (GPU default: {DEFAULT_OUT}; smoke: none)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU Triton interpreter")
    parser.add_argument("--schedule", action="store_true",
                        help="also time one step's 17 depth-attention calls, unpaired and paired")
    return parser.parse_args(argv)


def make_inputs(n, tokens, hidden, device, dtype, seed):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    scales = torch.rand(n, 1, 1, generator=gen, device=device) * 3 + 0.2
    sources = (torch.randn(n, tokens, hidden, generator=gen, device=device) * scales).to(dtype)
    query = torch.randn(hidden, generator=gen, device=device) * 0.5
    norm_weight = 1 + 0.3 * torch.randn(hidden, generator=gen, device=device)
    grad_out = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    leaves = [t.requires_grad_(True) for t in (sources, query, norm_weight)]
    return leaves, grad_out


def make_steps(impl, leaves, grad_out):
    """(forward, forward+backward) closures for ``impl`` in {"kernel", "reference"}."""
    import torch

    from kimi_kernels.attn_res import depth_attention, depth_attention_reference

    sources, query, norm_weight = leaves
    source_list = [s.detach().requires_grad_(True) for s in sources.unbind(0)]

    if impl == "kernel":
        inputs = [*source_list, query, norm_weight]

        def forward():
            return depth_attention(source_list, query, norm_weight, impl="triton")
    else:
        inputs = leaves

        def forward():
            return depth_attention_reference(sources, query, norm_weight)

    def forward_backward():
        out = forward()
        return out, torch.autograd.grad(out, inputs, grad_out)

    return forward, forward_backward


def results_for(impl, leaves, grad_out):
    """Output and grads (sources stacked) of one implementation, for the agreement check."""
    import torch

    _, forward_backward = make_steps(impl, leaves, grad_out)
    out, grads = forward_backward()
    grad_sources = torch.stack(grads[:-2]) if impl == "kernel" else grads[0]
    return {"out": out, "d_sources": grad_sources, "d_query": grads[-2], "d_norm_weight": grads[-1]}


def relative_errors(kernel, reference):
    errors = {}
    for name, expected in reference.items():
        scale = expected.float().abs().max().item() or 1.0
        errors[name] = (kernel[name].float() - expected.float()).abs().max().item() / scale
    return errors


def median_ms(fn, smoke):
    if not smoke:
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    from tools.bench_common import local_median_ms

    return local_median_ms(fn, 0, 1, cuda=False)  # the smoke checks the code path; its times mean nothing


def saved_megabytes(forward, smoke):
    """Memory the output and its autograd graph keep alive after one forward (GPU only)."""
    if smoke:
        return None
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del out
    return kept / 2**20


def bench_shape(n, tokens, hidden, device, dtype_name, smoke):
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    leaves, grad_out = make_inputs(n, tokens, hidden, device, dtype, seed=n)
    errors = relative_errors(results_for("kernel", leaves, grad_out), results_for("reference", leaves, grad_out))
    bad = {k: v for k, v in errors.items() if v > TOLERANCE[dtype_name][k]}
    if bad:
        raise SystemExit(f"kernel and reference disagree at n={n} T={tokens} h={hidden}: {bad}")
    row = {"n": n, "T": tokens, "h": hidden, "dtype": dtype_name, "max_rel_error": errors}
    for impl in ("kernel", "reference"):
        forward, forward_backward = make_steps(impl, leaves, grad_out)
        row[f"{impl}_fwd_ms"] = median_ms(forward, smoke)
        row[f"{impl}_ms"] = median_ms(forward_backward, smoke)
        row[f"{impl}_saved_mb"] = saved_megabytes(forward, smoke)
    row["speedup"] = row["reference_ms"] / row["kernel_ms"]
    # Bytes the fused forward must move at least: read n sources, write one output.
    element = torch.finfo(dtype).bits // 8
    row["kernel_fwd_gb_per_s"] = (n + 1) * tokens * hidden * element / (row["kernel_fwd_ms"] * 1e-3) / 1e9
    return row


SCHEDULE_VARIANTS = {"unpaired": False, "pair": True}  # name: pair the layer's two mixers (DepthPair)


def schedule_step(device, dtype, tokens, hidden, layers=8, seed=0):
    """(forward+backward closure, its leaves) for one training step's depth-attention calls as
    the model makes them with blocks of 2 sublayers (``megatron_ext/attn_res``): each layer's
    attention mixer over the blocks, a stand-in sublayer ``p = x / 2``, the MLP mixer over the
    blocks + p (paired with the attention mixer when asked), the block closed as ``p + y / 2``;
    then the final mix over all blocks. Every block tracked (in-place grads), norms fused."""
    import torch

    from kimi_kernels.attn_res import DepthPair, depth_attention, track_source_grad

    gen = torch.Generator(device=device).manual_seed(seed)
    embedding = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype).requires_grad_(True)

    def param(scale, offset=0.0):
        return (offset + scale * torch.randn(hidden, generator=gen, device=device)).requires_grad_(True)

    mixers = [(param(0.1), param(0.1, 1.0), param(0.1, 1.0)) for _ in range(2 * layers + 1)]
    grad_out = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)

    def step(pair_on):
        tracked, source_grad = track_source_grad(embedding)
        blocks, grads = [tracked], [source_grad]
        for k in range(layers):
            (q1, g1, o1), (q2, g2, o2) = mixers[2 * k], mixers[2 * k + 1]
            pair = DepthPair(q2, g2) if pair_on else None
            x = depth_attention(blocks, q1, g1, impl="triton", source_grads=grads, out_norm_weight=o1,
                                pair=pair and pair.first)
            p = x * 0.5
            y = depth_attention(blocks + [p], q2, g2, impl="triton", source_grads=grads + [None], out_norm_weight=o2,
                                pair=pair and pair.second)
            block, block_grad = track_source_grad(p + y * 0.5)
            blocks, grads = blocks + [block], grads + [block_grad]
        q, g, o = mixers[-1]
        out = depth_attention(blocks, q, g, impl="triton", source_grads=grads, out_norm_weight=o)
        leaves = [embedding, *[t for m in mixers for t in m]]
        return torch.autograd.grad(out, leaves, grad_out)

    return step


def time_schedule(device, dtype_name, tokens, hidden, smoke):
    """Forward+backward ms of one step's depth-attention calls, unpaired and paired, and the paired grads' max
    relative difference to the unpaired ones."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    step = schedule_step(device, dtype, tokens, hidden, layers=2 if smoke else 8)
    result, grads = {"T": tokens, "h": hidden, "dtype": dtype_name, "ms": {}}, {}
    for name, pair_on in SCHEDULE_VARIANTS.items():
        grads[name] = step(pair_on)
        result["ms"][name] = median_ms(lambda pair_on=pair_on: step(pair_on), smoke)
    result["max_rel_diff_pair_vs_unpaired"] = max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(grads["pair"], grads["unpaired"]))
    print("step schedule fwd+bwd ms: " + _fmt(result["ms"])
          + f"; pair saves {result['ms']['unpaired'] - result['ms']['pair']:.3f} ms")
    return result


def _fmt(times):
    return ", ".join(f"{tile}: {ms:.3f}" for tile, ms in times.items())


def print_table(rows):
    header = f"{'n':>3} {'T':>6} {'h':>5} | {'kernel fwd':>10} {'ref fwd':>9} | {'kernel f+b':>10} {'ref f+b':>9} {'speedup':>7} | {'fwd GB/s':>8} | {'saved MB k/ref':>15}"
    print(header)
    print("-" * len(header))
    for r in rows:
        saved = "n/a" if r["kernel_saved_mb"] is None else f"{r['kernel_saved_mb']:.0f}/{r['reference_saved_mb']:.0f}"
        print(f"{r['n']:>3} {r['T']:>6} {r['h']:>5} | {r['kernel_fwd_ms']:>10.3f} {r['reference_fwd_ms']:>9.3f} | "
              f"{r['kernel_ms']:>10.3f} {r['reference_ms']:>9.3f} {r['speedup']:>6.2f}x | "
              f"{r['kernel_fwd_gb_per_s']:>8.0f} | {saved:>15}")


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        # The interpreter must be chosen before triton is first imported.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.smoke:
        device, dtype_name, shapes, out_path = "cpu", "fp32", SMOKE_SHAPES, args.out
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU interpreter check")
        device, dtype_name, shapes, out_path = "cuda", "bf16", GPU_SHAPES, args.out or DEFAULT_OUT
    rows = [bench_shape(n, t, h, device, dtype_name, args.smoke) for n, t, h in shapes]
    print_table(rows)
    schedule = None
    if args.schedule:
        _, tokens, hidden = shapes[0]
        schedule = time_schedule(device, dtype_name, tokens, hidden, args.smoke)
    if out_path:
        from tools.bench_common import write_kernel_report

        write_kernel_report(
            out_path, "kimi_kernels.attn_res.depth_attention (fused Triton) vs depth_attention_reference (eager)",
            not args.smoke, "median ms, triton.testing.do_bench" if not args.smoke else "wall ms of one call (smoke)",
            rows, note="kernel gets a list of sources; reference gets them pre-stacked (stack cost not counted)",
            schedule=schedule)

if __name__ == "__main__":
    repo_root = Path(__file__).resolve().parents[2]
    if str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))
    main()
