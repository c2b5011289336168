"""Training-step cost of Block Attention Residuals on one GPU, and its depth-attention kernel.

Runs, in one process:

1. the training step (forward + backward + optimizer) of the same dense decoder with standard
   residuals and with Block AttnRes (N = 8 blocks), both models on the GPU at once and timed in
   alternating rounds (``--rounds`` x ``--steps-per-round`` steps each, after ``--warmup``; CUDA
   events), so that a drift of the machine during the run falls on both: ``standard_step_ms`` /
   ``attnres_step_ms`` are the medians of all their steps, ``overhead_round_median`` the median
   over rounds of the per-round ratio. Then each model alone, one after the other
   (``sequential``: ``--steps`` steps after ``--warmup``), for its peak allocated memory (weights,
   AdamW state and activations) and its ``optimizer.step()`` time. GPU model: 8 layers, hidden
   2048, 16 heads (4 KV groups), SwiGLU FFN 5632, vocab 32000, seq 4096, micro-batch 2, bf16 (Megatron Float16Module + bf16 AdamW), full
   attention ("A"), dense MLP, no parallelism;
2. the fused depth-attention kernel against its PyTorch reference (``kimi_kernels.attn_res``
   ``impl="triton"`` vs ``impl="torch"``), forward + backward, n = 9 sources (the final mix of
   N = 8), T = 8192 tokens, h = 2048, bf16; median of CUDA-event times.

Prints a table and writes JSON (``--out``, default docs/bench/attnres-h200.json) with
``standard_step_ms``, ``attnres_step_ms``, ``standard_peak_mem_gb``, ``attnres_peak_mem_gb``,
``kernel_ms``, ``reference_ms``, ``device``, ``date`` (plus the settings used).

``--smoke``: the same code path on the CPU with tiny sizes (fp32, gloo, cpu_compat, the
kernel under Triton's interpreter); checks that it runs, not the speed. Writes JSON only
with ``--out``.

    python tools/bench_attnres.py [--out docs/bench/attnres-h200.json]
    python tools/bench_attnres.py --smoke [--out /tmp/attnres-smoke.json]
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import dataclasses
import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import bench_common, bench_training  # noqa: E402

DEFAULT_OUT = "docs/bench/attnres-h200.json"
GPU_MODEL = dict(
    num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
    ffn_hidden_size=5632, vocab_size=32000, max_sequence_length=4096,
)
SMOKE_MODEL = dict(
    num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=64, vocab_size=257, max_sequence_length=16,
)
GPU_SHAPE = dict(seq=4096, micro_batch=2, sources=9)
SMOKE_SHAPE = dict(seq=16, micro_batch=2, sources=9)
ATTN_RES_BLOCKS = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help=f"JSON path (default on GPU: {DEFAULT_OUT}; smoke: none)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (code path check)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 12 GPU, 2 smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 GPU, 1 smoke)")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds of the interleaved timing (default 10 GPU, 2 smoke)")
    p.add_argument("--steps-per-round", type=int, default=None,
                   help="timed steps of each model per round (default 4 GPU, 1 smoke)")
    p.add_argument("--no-inplace-source-grads", dest="inplace_source_grads", action="store_false",
                   help="AttnRes with autograd's per-call source-gradient sums (attn_res_inplace_source_grads=False)")
    p.add_argument("--no-fuse-norm", dest="fuse_norm", action="store_false",
                   help="AttnRes with the sublayer norms run separately on the mix (attn_res_fuse_norm=False)")
    p.add_argument("--pair-backward", action=argparse.BooleanOptionalAction, default=None,
                   help="attn_res_pair_backward on / off (default: HybridConfig's, on)")
    p.add_argument("--ab-pair", action="store_true",
                   help="also time AttnRes without the paired backward, a third model in the interleaved rounds: "
                        "attnres_unpaired_step_ms")
    p.add_argument("--automatic-gc", action="store_true",
                   help="leave Python's collector on during the steps (default: off, as in training's manual_gc)")
    p.add_argument("--profile", choices=("standard", "attnres"), default=None,
                   help="instead of timing: profile 3 training steps of one model, print kernel and operator tables")
    return p.parse_args(argv)


def make_config(model: dict, bf16: bool, attn_res: bool, inplace_source_grads: bool = True, fuse_norm: bool = True,
                pair_backward: bool | None = None):
    from megatron_ext.config import HybridConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    extra = dict(attn_res=True, attn_res_num_blocks=ATTN_RES_BLOCKS,
                 attn_res_inplace_source_grads=inplace_source_grads, attn_res_fuse_norm=fuse_norm) if attn_res else {}
    if attn_res and pair_backward is not None:
        extra["attn_res_pair_backward"] = pair_backward
    return HybridConfig(bf16=bf16, params_dtype=torch.float32, pipeline_dtype=dtype,
                        use_cpu_initialization=not bf16, **model, **extra)


def time_training_step(config, shape: dict, steps: int, warmup: int, profiler=None, manual_gc: bool = True) -> dict:
    """Median step ms and peak GB of one model: forward+backward (Megatron schedule) + AdamW."""
    from megatron_ext.parallel import build_model_chunks

    result = bench_training.time_training_step(
        lambda: build_model_chunks(config), config, config.vocab_size, shape["seq"], shape["micro_batch"],
        warmup, steps, profiler=profiler, manual_gc=manual_gc)
    return {"step_ms": result["step_ms"], "optimizer_ms": result["optimizer_ms"], "peak_mem_gb": result["peak_gb"]}


def time_interleaved(configs: dict, shape: dict, warmup: int, rounds: int, steps_per_round: int,
                     manual_gc: bool = True) -> dict:
    """The models of ``configs`` (name -> config, the baseline first) resident at once, timed in alternating
    rounds (``bench_training.time_interleaved_training_steps``)."""
    from megatron_ext.parallel import build_model_chunks

    models = {name: (lambda config=config: build_model_chunks(config), config) for name, config in configs.items()}
    first = next(iter(configs.values()))
    return bench_training.time_interleaved_training_steps(
        models, first.vocab_size, shape["seq"], shape["micro_batch"], warmup, rounds, steps_per_round,
        manual_gc=manual_gc)


def time_depth_attention(shape: dict, hidden: int, dtype, steps: int, warmup: int, cuda: bool) -> dict:
    """Median forward+backward ms of depth_attention, impl='triton' vs impl='torch'."""
    from kimi_kernels.attn_res import depth_attention

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    g = torch.Generator(device=device).manual_seed(1)
    tokens = shape["seq"] * shape["micro_batch"]
    sources = [
        (torch.randn(tokens, hidden, generator=g, device=device) * (0.5 + i)).to(dtype).requires_grad_(True)
        for i in range(shape["sources"])
    ]
    query = (0.1 * torch.randn(hidden, generator=g, device=device)).requires_grad_(True)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).requires_grad_(True)
    grad_out = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    result = {}
    for impl in ("triton", "torch"):
        def fwd_bwd(impl=impl):
            for t in (*sources, query, norm_weight):
                t.grad = None
            out = depth_attention(sources, query, norm_weight, impl=impl)
            torch.autograd.backward(out, grad_out)

        result[impl] = bench_common.median_ms(fwd_bwd, warmup, steps, device)
    return {"kernel_ms": result["triton"], "reference_ms": result["torch"]}


def profile_model(args, config, shape: dict, cuda: bool) -> str:
    """The tables of ``tools/profile_tables.report`` for 3 steps after the warm-up."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from tools.gpu_idle import SyncCensus
    from tools.profile_tables import report

    active, warmup = 3, args.warmup if args.warmup is not None else 3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, schedule=schedule(wait=warmup, warmup=1, active=active, repeat=1)) as prof:
        census = SyncCensus(max(warmup - 1, 0), prof) if cuda else prof  # the last unrecorded step's syncs
        step = time_training_step(config, shape, warmup + 1 + active, 0, profiler=census)
    head = f"# Profile: bench_attnres `{args.profile}` model, step {step['step_ms']:.1f} ms under the profiler\n"
    return head + "\n" + report(prof, active, cuda, census.sites if cuda else None)


def run(args) -> dict:
    from megatron_ext import speed_patches
    from megatron_ext.parallel import initialize_parallel

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU code-path check")
    steps = args.steps or (12 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    model, shape = (GPU_MODEL, GPU_SHAPE) if cuda else (SMOKE_MODEL, SMOKE_SHAPE)
    bench_common.init_process_group(cuda)
    standard_config = make_config(model, bf16=cuda, attn_res=False)
    initialize_parallel(standard_config, seed=1234)
    if args.profile:
        config = standard_config if args.profile == "standard" else make_config(
            model, bf16=cuda, attn_res=True, inplace_source_grads=args.inplace_source_grads, fuse_norm=args.fuse_norm,
            pair_backward=args.pair_backward)
        return {"profile": profile_model(args, config, shape, cuda)}
    gc_on = not args.automatic_gc
    attn_res_config = make_config(model, bf16=cuda, attn_res=True, inplace_source_grads=args.inplace_source_grads,
                                  fuse_norm=args.fuse_norm, pair_backward=args.pair_backward)
    unpaired_config = dataclasses.replace(attn_res_config, attn_res_pair_backward=False)
    more = {"attnres_unpaired": unpaired_config} if args.ab_pair else {}
    interleaved = time_interleaved({"standard": standard_config, "attnres": attn_res_config, **more}, shape,
                                   warmup, args.rounds or (10 if cuda else 2), args.steps_per_round or (4 if cuda else 1),
                                   manual_gc=gc_on)
    standard = time_training_step(standard_config, shape, steps, warmup, manual_gc=gc_on)
    attn_res = time_training_step(attn_res_config, shape, steps, warmup, manual_gc=gc_on)
    dtype = torch.bfloat16 if cuda else torch.float32
    kernel = time_depth_attention(shape, model["hidden_size"], dtype, steps, warmup, cuda)
    return {
        "standard_step_ms": interleaved["standard"]["step_ms"],
        "attnres_step_ms": interleaved["attnres"]["step_ms"],
        "overhead_round_median": interleaved["ratio_median"]["attnres"] - 1,
        # host time of a step until step() returned: near the step time, the host sets the pace
        "host_ms": {name: interleaved[name]["host_ms"] for name in ("standard", "attnres", *more)},
        "round_ms": {name: interleaved[name]["round_ms"] for name in ("standard", "attnres", *more)},
        **({"attnres_unpaired_step_ms": interleaved["attnres_unpaired"]["step_ms"],
            "overhead_round_median_unpaired": interleaved["ratio_median"]["attnres_unpaired"] - 1} if more else {}),
        "sequential": {"standard_step_ms": standard["step_ms"], "attnres_step_ms": attn_res["step_ms"]},
        "standard_optimizer_ms": standard["optimizer_ms"],
        "attnres_optimizer_ms": attn_res["optimizer_ms"],
        "standard_peak_mem_gb": standard["peak_mem_gb"],
        "attnres_peak_mem_gb": attn_res["peak_mem_gb"],
        **kernel,
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "model": model, **shape, "attn_res_num_blocks": ATTN_RES_BLOCKS, "dtype": str(dtype),
            "mlp": "dense SwiGLU", "steps": steps, "warmup": warmup, "smoke": not cuda,
            "rounds": len(interleaved["standard"]["round_ms"]),
            "steps_per_round": args.steps_per_round or (4 if cuda else 1),
            "attn_res_inplace_source_grads": args.inplace_source_grads, "attn_res_fuse_norm": args.fuse_norm,
            "attn_res_pair_backward": attn_res_config.attn_res_pair_backward, "manual_gc": gc_on,
            "adamw_small_tensor_numel": speed_patches.SMALL_TENSOR_NUMEL,
        },
    }


def print_table(r: dict) -> None:
    sequential = r["sequential"]
    rows = [
        ("training step, standard residuals", f"{r['standard_step_ms']:.2f} ms", f"{r['standard_peak_mem_gb']:.2f} GB"),
        ("training step, Block AttnRes N=8", f"{r['attnres_step_ms']:.2f} ms", f"{r['attnres_peak_mem_gb']:.2f} GB"),
        ("  host time of a step (interleaved): standard / AttnRes", f"{r['host_ms']['standard']:.2f} ms",
         f"{r['host_ms']['attnres']:.2f} ms"),
        ("  each alone, one after the other: standard / AttnRes", f"{sequential['standard_step_ms']:.2f} ms",
         f"{sequential['attnres_step_ms']:.2f} ms"),
        ("  optimizer.step() alone, standard / AttnRes", f"{r['standard_optimizer_ms']:.2f} ms",
         f"{r['attnres_optimizer_ms']:.2f} ms"),
        *([("  AttnRes without the paired backward (interleaved)", f"{r['attnres_unpaired_step_ms']:.2f} ms",
            f"{r['overhead_round_median_unpaired']:+.1%}")] if "attnres_unpaired_step_ms" in r else []),
        ("depth attention fwd+bwd, Triton", f"{r['kernel_ms']:.3f} ms", ""),
        ("depth attention fwd+bwd, PyTorch", f"{r['reference_ms']:.3f} ms", ""),
    ]
    print(f"{r['device']}  {r['date']}")
    for name, time_col, mem_col in rows:
        print(f"{name:<52} {time_col:>12} {mem_col:>10}")
    overhead = r["attnres_step_ms"] / r["standard_step_ms"] - 1
    print(f"AttnRes step overhead: {overhead:+.1%} (medians of the interleaved steps; median of the "
          f"{len(r['round_ms']['standard'])} rounds' ratios {r['overhead_round_median']:+.1%})")


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if "profile" in result:
        print(result["profile"])
        if args.out:
            Path(args.out).write_text(result["profile"])
        return result
    print_table(result)
    bench_common.finish_run(result, args.out or (None if args.smoke else DEFAULT_OUT))
    return result


if __name__ == "__main__":
    main()
