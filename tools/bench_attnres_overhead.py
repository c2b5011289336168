"""Host (Python) overhead of one depth-attention call, forward and backward.

Default (CPU): the Triton kernels are replaced by no-ops, so what is timed is only the wrapper:
validation, the autograd Function, allocations, launch-parameter work and the small torch ops around
the kernels (the CPU time that, in the training step, decides whether the CPU keeps ahead of the
GPU). Tiny sources (``[8, 2, 128]``) keep the CPU allocator cheap, like CUDA's caching allocator. The
Triton launch itself (``kernel[grid](...)``) is not included.

``--cuda``: the real kernels on CUDA sources of 16 tokens at hidden 2048 (the benchmark's
specialisations; the GPU work per call is a few microseconds, so the host sets the pace): wall time
per call, Triton's launches included. The difference to the CPU rows is what the launches cost.

Cases: n sources, as the model calls them: all but the last (the partial sum) given a
``SourceGrad`` ("tracked") or none ("plain"); through the public ``depth_attention`` and, where
present, through ``depth_attention_unchecked`` (what ``DepthMixer`` calls after its first call).

``--profile N``: instead of the table, cProfile over the model path's forward + backward at n sources
(tracked), the functions with the most own time first: which part of a call's host time is Triton's launch
(``JITFunction.run``, its binder, the launcher), the autograd Function, the torch ops.

    python tools/bench_attnres_overhead.py [--reps 300] [--cuda] [--profile 9]
"""

from __future__ import annotations

import os

import sys

CUDA = "--cuda" in sys.argv[1:]
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # impl="triton" on CPU tensors

import argparse
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attn_res import depth_attention, track_source_grad  # noqa: E402
from kernels.attn_res import fused  # noqa: E402

SHAPE = (16, 1, 2048) if CUDA else (8, 2, 128)
DEVICE = "cuda" if CUDA else "cpu"


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _patch_kernels():
    for name in ("_depth_attention_fwd_kernel", "_depth_attention_bwd_kernel", "_depth_attention_bwd_preload_kernel",
                 "_depth_attention_finish_kernel"):
        if hasattr(fused, name):
            setattr(fused, name, _NoLaunch())


CALLS_PER_GRAPH = 8  # mixers reading the same sources in one forward / backward


def _time(fn, reps: int, trials: int = 5) -> float:
    """µs per call: the best of ``trials`` timings of ``reps`` graphs (a shared machine's noise only ever
    adds time). CPU: this thread's CPU time (torch runs on one thread here, autograd runs CPU graphs on the
    calling thread); CUDA: wall time from a synchronised start to a synchronised end (a sync's spin would
    count as CPU time)."""
    clock = time.perf_counter if CUDA else time.thread_time
    _warm_up(fn, reps)
    best = float("inf")
    for _ in range(trials):
        if CUDA:
            torch.cuda.synchronize()
        start = clock()
        for _ in range(reps):
            fn()
        if CUDA:
            torch.cuda.synchronize()
        best = min(best, clock() - start)
    return best / reps / CALLS_PER_GRAPH * 1e6


def _warm_up(fn, reps: int) -> None:
    """Up to 50 untimed calls (compiles, caches, allocator), then the device drained."""
    for _ in range(min(50, reps)):
        fn()
    if CUDA:
        torch.cuda.synchronize()


def make_graph(n: int, tracked: bool, via_mixer: bool):
    """(forward, forward_backward) callables: ``CALLS_PER_GRAPH`` calls (each with its own query and norm
    weight, as the model's mixers) read the same n sources; one backward over all of them (autograd sums
    the untracked sources' grads; the tracked ones are summed in place)."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    leaves = [torch.randn(SHAPE, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(n)]
    params = [
        (torch.zeros(SHAPE[-1], device=DEVICE, requires_grad=True),
         torch.ones(SHAPE[-1], device=DEVICE, requires_grad=True))
        for _ in range(CALLS_PER_GRAPH)
    ]
    grad_out = torch.ones(SHAPE, device=DEVICE, dtype=dtype)
    unchecked = None
    if via_mixer:
        from kernels.attn_res import depth_attention_unchecked as unchecked

    def forward():
        sources, grads = list(leaves), [None] * n
        if tracked:  # the model tracks every block once, not per call
            for i in range(n - 1):
                sources[i], grads[i] = track_source_grad(leaves[i])
        if unchecked is not None:
            return [unchecked(sources, q, g, 1e-6, "triton", grads if tracked else None) for q, g in params]
        return [depth_attention(sources, q, g, 1e-6, "triton", grads if tracked else None) for q, g in params]

    def forward_backward():
        outs = forward()
        wrt = [*leaves, *(t for pair in params for t in pair)]
        torch.autograd.grad(outs, wrt, [grad_out] * len(outs))

    return forward, forward_backward


def measure(n: int, tracked: bool, reps: int, via_mixer: bool) -> tuple[float, float]:
    """(forward µs, forward + backward µs) per call of :func:`make_graph`'s graphs."""
    forward, forward_backward = make_graph(n, tracked, via_mixer)
    return _time(forward, reps), _time(forward_backward, reps)


def profile(n: int, reps: int, top: int = 30) -> None:
    """cProfile of ``reps`` forward + backward graphs (n tracked sources, model path), sorted by own time."""
    import cProfile
    import pstats

    run = make_graph(n, tracked=True, via_mixer=True)[1]
    _warm_up(run, reps)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        run()
    if CUDA:
        torch.cuda.synchronize()
    profiler.disable()
    print(f"# cProfile: {reps} graphs of {CALLS_PER_GRAPH} calls, n = {n} tracked sources, {DEVICE}; "
          f"times are totals over {reps * CALLS_PER_GRAPH} calls")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--cuda", action="store_true", help="real kernels on CUDA (read before the parse: see CUDA)")
    p.add_argument("--profile", type=int, default=None, metavar="N", help="cProfile at N sources instead of the table")
    args = p.parse_args(argv)
    if not args.cuda:
        _patch_kernels()
    torch.set_num_threads(1)
    if args.profile is not None:
        profile(args.profile, args.reps)
        return
    try:
        from kernels.attn_res import depth_attention_unchecked  # noqa: F401

        paths = [("depth_attention", False), ("unchecked", True)]
    except ImportError:  # before the unchecked path existed
        paths = [("depth_attention", False)]
    print(f"{'path':16s} {'n':>2s} {'sources':8s} {'fwd us':>8s} {'fwd+bwd us':>10s} {'bwd us':>8s}")
    for label, via_mixer in paths:
        for n in (2, 5, 9):
            for tracked in (False, True):
                fwd, both = measure(n, tracked, args.reps, via_mixer)
                kind = "tracked" if tracked else "plain"
                print(f"{label:16s} {n:2d} {kind:8s} {fwd:8.1f} {both:10.1f} {both - fwd:8.1f}")


if __name__ == "__main__":
    main()
