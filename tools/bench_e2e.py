"""End-to-end training throughput: stock Megatron-Core against our model (issue 8).

Times the full training step (zero grads, forward + backward of one microbatch through
Megatron's schedule, Megatron AdamW step, and our router-bias update where a balancer has one)
of each variant, median over ``--steps`` (>= 10 on the GPU) after ``--warmup``, and reports
tokens/s, model TFLOP/s per GPU, MFU against the bf16 matmul peak measured in the same run
(8192^3, median) and peak memory. Dimensions (GPU): 8 layers, hidden 2048, 16 heads (head dim
128), 64 experts, top-8, expert FFN 1024 (SwiGLU), vocabulary 32768, micro-batch 2, bf16.

Variants (``--variants``, default all):

* ``stock``: Megatron-Core's ``GPTModel`` from ``get_gpt_layer_local_spec`` (RMSNorm,
  ``SequentialMLP`` experts, ``TopKRouter`` with aux loss 1e-2, all-to-all dispatcher, RoPE),
  core attention ``DotProductAttention`` (``--stock-attention sdpa``: ours, SDPA), sequence 4096,
  Megatron-Core's optimizer as it comes without TE/Apex (torch AdamW, foreach; its own grad-norm and
  clipping stand-ins, fp32 gradient buffer; ours run ``fast_step``: see ``megatron_ext.parallel.build_optimizer``,
  and ``--main-grad-dtype``, default ``auto``: bf16 gradients where nothing accumulates, i.e. on one GPU);
* ``ours_base``: our model, full attention on every layer, our MoE layer, plain top-k;
* ``ours_full``: KDA 3:1 (``KKKA``), quantile balancing in both modes (``qb_both``, capacity
  factor 1.25), Block AttnRes (N = 8);
* ``ours_base_16k`` / ``ours_full_16k``: the same at sequence 16384, micro-batch
  ``--long-micro-batch`` (default 1: at 2 the static ~63 GB of weights, grads and AdamW state plus
  4x the 4k activations would not fit in one H200's 139 GB);
* A/B rows, not in the default list, ``NAME[+OPTION...]`` on an ours_full row: ``+eager``
  (HybridConfig's capacity-routing defaults, host reads on and no CUDA graphs, whatever ``--qb-cuda-graph``
  says), ``+torch-rounds`` (one-rank routing rounds as PyTorch ops instead of the Triton kernels,
  ``moe_qb_rounds_impl: torch``), ``+no-attnres`` (standard residuals instead of Block AttnRes: the
  technique's overhead on this model); they combine (``ours_full_16k+eager+no-attnres``). A name may repeat:
  ``--variants ours_full_16k,ours_full_16k+torch-rounds,ours_full_16k,ours_full_16k+torch-rounds`` is an ABAB
  comparison in one process. Kernel launch choices are compared across commits (they are not switches).

The ours_full rows' capacity routing (``--qb-cuda-graph``, default ``auto``): on one GPU it runs without host
reads and is replayed from CUDA graphs (``moe_qb_host_reads: false``, ``moe_qb_cuda_graph: true``: the
fastest layout measured, 214.8 vs 242.6/250.8 ms at 16k on 2026-12-02); on two GPUs, HybridConfig's defaults.

Model FLOPs per token come from ``megatron_ext/flops.py`` for every row (the stock row is counted
with ``ours_base``'s config: same layers, same formula); docs/e2e.md writes the formula out.
Each variant builds its model after a fresh Megatron parallel state and frees everything after
(model, optimizer, parallel state, CUDA cache) so each peak is its own; a failing variant is
recorded with its error and the others still run.

    python tools/bench_e2e.py                                  # one GPU -> docs/bench/e2e-h200.json
    torchrun --nproc-per-node 2 tools/bench_e2e.py             # EP2 rows (gpus: 2), merged into it
    python tools/bench_e2e.py --profile ours_full              # top-20 kernels -> docs/profile-ours_full.md
    python tools/bench_e2e.py --smoke --out /tmp/e2e.json      # CPU, tiny, fp32, gloo: code path only
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import bench_common  # noqa: E402
from tools.e2e_rows import (  # noqa: E402
    CAPACITY_FACTOR, GPU_SIZES, SMOKE_SIZES, STOCK_AUX_LOSS, VARIANTS, split_variant, variant_problem,
    variant_setup, variant_shape,
)

DEFAULT_OUT = "docs/bench/e2e-h200.json"
PROFILE_ACTIVE_STEPS = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny sizes, gloo: checks the code path")
    p.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT}; none for --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    p.add_argument("--long-micro-batch", type=int, default=None, help="micro-batch of the 16k rows (default 1)")
    p.add_argument("--stock-attention", choices=("dpa", "sdpa"), default="dpa",
                   help="stock core attention: Megatron's DotProductAttention or our SDPA module")
    p.add_argument("--main-grad-dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="gradient buffer of the ours_* rows (wrap_ddp's main_grad_dtype; stock keeps fp32): auto = "
                        "bf16 on one GPU (one micro-batch, nothing accumulates), fp32 otherwise")
    p.add_argument("--qb-device-rounds", type=int, default=None,
                   help="moe_qb_device_rounds of the ours_full rows (default: HybridConfig's)")
    p.add_argument("--qb-host-reads", choices=("on", "off"), default=None,
                   help="moe_qb_host_reads of the ours_full rows (default: HybridConfig's); off: capacity routing "
                        "without host syncs, 1 + moe_qb_device_rounds rounds")
    p.add_argument("--qb-cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="the ours_full rows' capacity routing replayed from CUDA graphs (moe_qb_cuda_graph; implies "
                        "--qb-host-reads off); auto (default): on with one GPU, off with more")
    p.add_argument("--automatic-gc", action="store_true",
                   help="leave Python's collector on during the steps of every row (default: off, as in training's "
                        "manual_gc; a full collection took ~240 ms)")
    p.add_argument("--profile", default=None, metavar="NAME",
                   help="instead of timing: profile a few steps of NAME, write its top-20 kernels as markdown")
    p.add_argument("--profile-out", default=None, help="markdown path (default docs/profile-NAME.md)")
    p.add_argument("--profile-trace", default=None, help="also export the Chrome trace here")
    args = p.parse_args(argv)
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    args.sizes = {**sizes, "long_micro_batch": args.long_micro_batch or sizes["long_micro_batch"]}
    args.steps = args.steps or sizes["steps"]
    args.warmup = sizes["warmup"] if args.warmup is None else args.warmup
    if not args.smoke and args.steps < 10:
        p.error("--steps must be >= 10 for GPU timings")
    args.variants = [v for v in args.variants.split(",") if v]
    args.qb_host_reads = None if args.qb_host_reads is None else args.qb_host_reads == "on"
    if args.qb_cuda_graph == "on":
        if args.qb_host_reads:
            p.error("--qb-cuda-graph needs --qb-host-reads off (a CUDA graph cannot read the device)")
        args.qb_host_reads = False
    for name in args.variants + ([args.profile] if args.profile else []):
        problem = variant_problem(name)
        if problem:
            p.error(f"variant {name!r}: {problem}")
    if args.smoke and args.qb_cuda_graph == "on":
        p.error("--qb-cuda-graph on needs a CUDA GPU (CUDA graphs), not --smoke")
    if args.out is None and not args.smoke and args.profile is None:
        args.out = DEFAULT_OUT
    return args


# --- Measurements --------------------------------------------------------------------------------
def bf16_matmul_peak_tflops(n: int, cuda: bool) -> float:
    """Median TFLOP/s of an ``n x n @ n x n`` matmul (bf16 on the GPU, fp32 on the CPU)."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = bench_common.median_ms(lambda: torch.matmul(a, b), warmup=5, iters=20, device=device)
    return 2 * n**3 / (ms / 1e3) / 1e12


def run_variant(name: str, args, cuda: bool, profiler=None) -> dict:
    """One row: a fresh parallel state, the timed step, everything freed after."""
    from megatron.core import parallel_state as ps

    from megatron_ext.flops import model_flops_per_token

    world = dist.get_world_size()
    seq, micro_batch = variant_shape(name, args.sizes)
    base, options = split_variant(name)
    row = {"name": name, "gpus": world, "seq": seq, "micro_batch": micro_batch}
    if base == "stock":
        row["attention"] = "DotProductAttention" if args.stock_attention == "dpa" else "SDPA"
    try:
        bench_common.init_expert_parallel(seed=1234)
        build, config, after_step, flops_cfg, seq, micro_batch = variant_setup(name, args, cuda)
        if base.startswith("ours_full"):
            row["qb_host_reads"], row["qb_cuda_graph"] = config.moe_qb_host_reads, config.moe_qb_cuda_graph
            row["attn_res"] = config.attn_res
        steps, warmup = (args.warmup + 1 + PROFILE_ACTIVE_STEPS, 0) if profiler else (args.steps, args.warmup)
        timing = bench_common.time_training_step(
            build, config, args.sizes["vocab"], seq, micro_batch, warmup, steps, after_step=after_step,
            profiler=profiler, fast_step=base != "stock",
            main_grad_dtype="fp32" if base == "stock" else args.main_grad_dtype, manual_gc=not args.automatic_gc)
        flops_per_token = model_flops_per_token(flops_cfg, seq)
        tokens_per_sec = world * micro_batch * seq / (timing["step_ms"] / 1e3)
        tflops = flops_per_token * tokens_per_sec / world / 1e12  # per GPU
        row.update(step_ms=timing["step_ms"], tokens_per_sec=tokens_per_sec, tflops=tflops,
                   mfu=tflops / args.peak_tflops, peak_gb=timing["peak_gb"], flops_per_token=flops_per_token,
                   main_grad_dtype=timing["main_grad_dtype"], manual_gc=not args.automatic_gc)
    except Exception as exc:  # keep the other variants' rows; say why this one is missing
        if dist.get_rank() == 0:
            traceback.print_exc()
        row.update(step_ms=None, tokens_per_sec=None, tflops=None, mfu=None, peak_gb=None,
                   error=f"{type(exc).__name__}: {exc}"[:400])
    finally:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().clear()  # Megatron's global per-layer aux-loss values
        ps.destroy_model_parallel()
        bench_common.free_device_memory(torch.device("cuda") if cuda else torch.device("cpu"))
    return row


def profile_variant(name: str, args, cuda: bool) -> str:
    """Markdown: the top-20 kernels (CUDA; CPU ops under --smoke) of a few steps of ``name``."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from tools.gpu_idle import SyncCensus

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities,
                 schedule=schedule(wait=args.warmup, warmup=1, active=PROFILE_ACTIVE_STEPS, repeat=1)) as prof:
        # the host syncs of the last unrecorded step (its warnings would slow a recorded one)
        census = SyncCensus(max(args.warmup - 1, 0), prof) if cuda else prof
        row = run_variant(name, args, cuda, profiler=census)
    if "error" in row:
        raise RuntimeError(f"profiling {name} failed: {row['error']}")
    if args.profile_trace:
        prof.export_chrome_trace(args.profile_trace)
    return profile_markdown(prof, name, cuda, row, args.warmup + 1, census.sites if cuda else None)


def profile_markdown(prof, name: str, cuda: bool, row: dict, skipped_steps: int, sync_sites=None) -> str:
    from tools.profile_tables import report

    device = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    head = [f"# Profile: `{name}` ({device}, {datetime.date.today().isoformat()})", "",
            f"`tools/bench_e2e.py --profile {name}`: {PROFILE_ACTIVE_STEPS} training steps after "
            f"{skipped_steps} unrecorded warm-up steps; sequence {row['seq']}, micro-batch {row['micro_batch']}, "
            f"{row['gpus']} GPU(s); step time under the profiler {row['step_ms']:.1f} ms.", ""]
    return "\n".join(head) + "\n" + report(prof, PROFILE_ACTIVE_STEPS, cuda, sync_sites)


# --- Output --------------------------------------------------------------------------------------
def format_table(rows) -> str:
    header = ("name", "gpus", "seq", "mb", "step ms", "tokens/s", "TFLOP/s", "MFU", "peak GB", "grads")
    lines = [" | ".join(f"{h:>13}" for h in header)]
    for r in rows:
        if r.get("error"):
            cells = [r["name"], r["gpus"], r["seq"], r["micro_batch"], "failed: " + r["error"][:60]]
        else:
            cells = [r["name"], r["gpus"], r["seq"], r["micro_batch"], f"{r['step_ms']:.1f}",
                     f"{r['tokens_per_sec']:,.0f}", f"{r['tflops']:.1f}", f"{r['mfu']:.1%}", f"{r['peak_gb']:.2f}",
                     r.get("main_grad_dtype", "")]
        lines.append(" | ".join(f"{c!s:>13}" for c in cells))
    return "\n".join(lines)


def add_scaling_efficiency(rows: list[dict]) -> None:
    """Multi-GPU rows get ``scaling_efficiency`` = tokens/s / (GPUs x tokens/s of the one-GPU row of the same
    name): tokens per GPU are the same in both, so 1.0 is perfect weak scaling."""
    single = {r["name"]: r.get("tokens_per_sec") for r in rows if r.get("gpus") == 1}
    for r in rows:
        base = single.get(r["name"])
        if r.get("gpus", 1) > 1 and base and r.get("tokens_per_sec"):
            r["scaling_efficiency"] = r["tokens_per_sec"] / (r["gpus"] * base)


def write_json(path: str, result: dict) -> None:
    """Write ``result``; rows of another GPU count already in ``path`` are kept (1-GPU + EP2 in one file),
    and multi-GPU rows get their scaling efficiency against the one-GPU rows."""
    out = Path(path)
    if out.exists():
        try:
            old = json.loads(out.read_text())
            kept = [r for r in old.get("rows", []) if r.get("gpus") not in {r2["gpus"] for r2 in result["rows"]}]
            result = {**result, "rows": kept + result["rows"]}
        except (json.JSONDecodeError, AttributeError, KeyError):
            pass  # an unreadable old file is replaced
    add_scaling_efficiency(result["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def run(args, log=print) -> dict | None:
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py needs a CUDA GPU (use --smoke on the CPU)")
    rank, world = bench_common.init_process_group(cuda)
    args.peak_tflops = bf16_matmul_peak_tflops(args.sizes["matmul"], cuda)
    if args.profile:
        table = profile_variant(args.profile, args, cuda)
        path = Path(args.profile_out or f"docs/profile-{args.profile}.md")
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(table)
            log(table + f"\n> wrote {path}")
        return None
    rows = []
    for name in args.variants:
        rows.append(run_variant(name, args, cuda))
        if name == "stock" and "OutOfMemoryError" in rows[-1].get("error", "") and args.stock_attention == "dpa":
            # DotProductAttention materialises the scores; SDPA is the allowed fallback (the row says so).
            args.stock_attention = "sdpa"
            rows[-1] = {**run_variant(name, args, cuda), "dpa_error": rows[-1]["error"]}
        if rank == 0:
            log(f"> {name}: " + (rows[-1].get("error") or f"{rows[-1]['step_ms']:.1f} ms/step"))
    import megatron.core

    result = {"rows": rows, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "date": datetime.date.today().isoformat(), "peak_tflops_measured": args.peak_tflops,
              "dtype": "bf16" if cuda else "fp32", "steps": args.steps, "warmup": args.warmup,
              "model": args.sizes["model"], "vocab": args.sizes["vocab"],
              "capacity_factor": CAPACITY_FACTOR, "stock_aux_loss_coeff": STOCK_AUX_LOSS,
              "qb_device_rounds": args.qb_device_rounds, "qb_host_reads": args.qb_host_reads,
              "qb_cuda_graph": args.qb_cuda_graph,
              "flops": "megatron_ext/flops.py, training = 3 x forward; tflops is per GPU; see docs/e2e.md",
              "torch": torch.__version__, "megatron_core": megatron.core.__version__, "smoke": args.smoke}
    if rank == 0:
        if args.out:
            write_json(args.out, result)
            log(f"> wrote {args.out}")
        log(f"bf16 matmul peak {args.peak_tflops:.1f} TFLOP/s ({result['device']})")
        log(format_table(rows))
    return result


def main(argv=None):
    args = parse_args(argv)
    try:
        return run(args, log=lambda line: print(line, flush=True))
    finally:
        if dist.is_initialized():
            # Every rank done with the GPU before NCCL is torn down: the EP2 run of 2026-12-01 hung in
            # teardown after writing its JSON (rank 0 was still printing while rank 1 destroyed the group).
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
