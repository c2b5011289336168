"""End-to-end training throughput: stock Megatron-Core against our model (issues 8 and 29).

Times the full training step (zero grads, forward + backward of one microbatch through
Megatron's schedule, Megatron AdamW step, and our router-bias update where a balancer has one)
of each variant, median over ``--steps`` (>= 10 on the GPU) after ``--warmup``, and reports
tokens/s, model TFLOP/s per GPU, MFU against two named peaks and peak memory. Dimensions (GPU): 8 layers,
hidden 2048, 16 heads (head dim 128), 64 experts, top-8, expert FFN 1024 (SwiGLU), vocabulary 32768,
micro-batch 2, bf16.

Rows (``--variants``, default all, in this order):

* ``stock``: Megatron-Core's ``GPTModel`` from ``get_gpt_layer_local_spec`` (RMSNorm,
  ``SequentialMLP`` experts, ``TopKRouter`` with aux loss 1e-2, all-to-all dispatcher, RoPE),
  core attention ``DotProductAttention``, sequence 4096, Megatron-Core's optimizer as it comes without
  TE/Apex (torch AdamW, foreach; its own grad-norm and clipping stand-ins, fp32 gradient buffer). Out of
  memory is recorded as the row's error (no fallback);
* ``stock_sdpa``: the same with our SDPA core attention module (``megatron_ext.layers.attention.SDPAttention``):
  the strongest stock model without Transformer Engine;
* ``ours_base``: our model, full attention on every layer, our MoE layer, plain top-k;
* ``ours_full``: KDA 3:1 (``KKKA``), quantile balancing in both modes (``qb_both``, capacity
  factor 1.25), Block AttnRes (N = 8);
* ``ours_base_16k`` / ``ours_full_16k``: the same at sequence 16384, micro-batch
  ``--long-micro-batch`` (default 1: at 2 the static ~63 GB of weights, grads and AdamW state plus
  4x the 4k activations would not fit in one H200's 139 GB).

The ours rows run what training runs: a row is a few config keys (``config_keys`` in its JSON, launch/train.py's
YAML names) and its ``HybridConfig`` is built by launch/train.py's own config loading (``load_config`` with its
``model_section``, then ``validate_layout``), so every key a row does not set has training's default (e.g. the
capacity routing on one GPU reads nothing back and replays its rounds from CUDA graphs, lossless; with EP
ranks or on the CPU it reads the host between rounds). Their optimizer is ``build_optimizer``'s default fast step
(training's), their gradient buffer ``--main-grad-dtype`` (default ``auto``, training's default: bf16 where
nothing accumulates, i.e. on one GPU), their update goes through training's NaN guard (``NonFiniteGuard``, on by
default in training: one host read of the loss and the grad norm per step, before the update). Stock rows call
Megatron's ``optimizer.step()`` (its clipping reads the grad norm).

A/B rows, not in the default list: ``NAME[+OPTION...]``, each option adding config keys (``+step-graph`` on any
ours row, the others on ours_full rows):

* ``+host-reads``: the capacity routing eager, reading the host between rounds (``moe_qb_host_reads: true``,
  ``moe_qb_cuda_graph: false``: the default on EP groups and the CPU; the same routing as the default);
* ``+torch-rounds``: one-rank routing rounds as PyTorch ops instead of the Triton kernels
  (``moe_qb_rounds_impl: torch``);
* ``+no-attnres``: standard residuals instead of Block AttnRes (``attn_res: false``: the technique's overhead);
* ``+qb-bias``: the dual bias alone, no capacity routing (``moe_balancer: qb_bias``: the capacity mode's cost);
* ``+rounds-6``: six overflow rounds instead of every one that can matter (``moe_qb_device_rounds: 6``: what the
  rounds past the sixth cost; a pair they would have moved is dropped, and counted);
* ``+step-graph``: the forward and backward replayed from one CUDA graph (``cuda_graph_step: true``; GPU only).

They combine (``ours_full_16k+host-reads+no-attnres``). A name may repeat:
``--variants ours_full_16k,ours_full_16k+host-reads,ours_full_16k,ours_full_16k+host-reads`` is an ABAB comparison in
one process. Kernel launch choices are compared across commits (they are not switches).

``--repeat N`` runs the whole list N times in turn (rows of one round apart in time, so drift hits every row alike);
``rows`` then holds one row per name, its median run (the middle one by step time, the lower middle for an even
count, failed runs left out), with ``step_ms_runs`` (every run's step time, None where it failed), and ``runs`` every
timed row in order with its ``round``: the figures a README quotes where runs vary. The JSON is written after
every round (``repeat``: the rounds it holds), so a time limit or a crash keeps the rounds done. ``--commit``
records the commit the tree is at (the device's copy of a tree may carry stale git metadata).

Fields of a row (JSON; the printed table shows the starred ones):

* ``name``*, ``gpus``*, ``seq``*, ``micro_batch``* (mb); stock rows ``attention`` (their core attention); ours rows
  ``config_keys`` and ``attn_res``, capacity rows also ``qb_host_reads`` / ``qb_cuda_graph`` (as resolved for the
  row's device);
* ``step_ms``*: median step time (CUDA events around the whole step; max over ranks);
* ``optimizer_ms``* (optim ms): median time of the ``optimizer.step()`` inside those same timed steps (Megatron's
  optimizer for stock, our fast step for ours), CUDA events around it read after the steps (no added sync; on
  the CPU ``perf_counter``; ours rows include the NaN guard's host read); max over ranks;
* ``tokens_per_sec``*, ``tflops``* (model TFLOP/s per GPU), ``flops_per_token``;
* ``mfu``* (MFU meas.): ``tflops`` over the bf16 matmul peak measured in the same run (8192^3, median;
  ``peak_tflops_measured`` in the header); ``mfu_datasheet``* (MFU 989): ``tflops`` over
  ``H200_DATASHEET_BF16_TFLOPS`` = 989 TFLOP/s (H200 SXM dense bf16, NVIDIA datasheet; ``peak_tflops_datasheet``
  in the header);
* ``peak_gb``*, ``main_grad_dtype``* (grads), ``manual_gc``;
* ``dropped``* / ``rerouted``*: only on rows whose balancer has capacity routing (qb_capacity, qb_both: the
  ours_full rows); absent (``-`` in the table) means no capacity routing. (token, slot) pairs summed over the
  timed steps, every MoE layer and the global batch, read through training's metrics code
  (``megatron_ext/moe/metrics.py``, ``moe/dropped`` / ``moe/rerouted``): the routers' step sums are reset after
  the warm-up and accumulate over the timed steps (the benchmark does not reset them per step as training does),
  then are read once after timing, so no host read or collective enters the timed steps;
* ``error``: why a row failed (its measured fields are null); after a failure that left the CUDA context unusable
  (a broken graph capture, a device fault: a small kernel is tried after every failed row) the later rows are
  not run and say so (``not run: the CUDA context failed after row ...``); ``cleanup_error`` where freeing a row's
  memory failed or its model outlived the row; ``scaling_efficiency`` on multi-GPU rows.

Model FLOPs per token come from ``megatron_ext/flops.py`` for every row (the stock rows are counted
with ``ours_base``'s config: same layers, same formula); docs/e2e.md writes the formula out.
Each variant builds its model after a fresh Megatron parallel state and frees everything after
(model, optimizer, parallel state, CUDA cache) so each peak is its own; a failing variant is
recorded with its error and the others still run (unless the CUDA context is gone: see ``error``).

    python tools/bench_e2e.py                                  # one GPU -> docs/bench/e2e-h200.json
    torchrun --nproc-per-node 2 tools/bench_e2e.py             # EP2 rows (gpus: 2), merged into it
    python tools/bench_e2e.py merge A.json B.json --commit C --out docs/bench/e2e-h200.json   # calls of one commit
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
from tools import bench_common, bench_training  # noqa: E402
from tools.e2e_results import (  # noqa: E402
    DATASHEET_PEAK_NAME, H200_DATASHEET_BF16_TFLOPS, format_table, median_rows, merge_calls, write_json,
)
from tools.e2e_rows import (  # noqa: E402
    CAPACITY_FACTOR, GPU_SIZES, ROW_OPTIONS, SMOKE_SIZES, STOCK_ATTENTION, STOCK_AUX_LOSS, VARIANTS, split_variant,
    capacity_layout, variant_problem, variant_setup, variant_shape,
)

DEFAULT_OUT = "docs/bench/e2e-h200.json"
PROFILE_ACTIVE_STEPS = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated rows, NAME[+OPTION...]: NAME one of " + ", ".join(VARIANTS)
                        + "; OPTION (step-graph on ours rows, the rest on ours_full rows) one of " + ", ".join(ROW_OPTIONS)
                        + "; default: every NAME, no options")
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny sizes, gloo: checks the code path")
    p.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT}; none for --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    p.add_argument("--long-micro-batch", type=int, default=None, help="micro-batch of the 16k rows (default 1)")
    p.add_argument("--main-grad-dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="gradient buffer of the ours_* rows (wrap_ddp's main_grad_dtype; stock keeps fp32): auto = "
                        "bf16 on one GPU (one micro-batch, nothing accumulates), fp32 otherwise")
    p.add_argument("--automatic-gc", action="store_true",
                   help="leave Python's collector on during the steps of every row (default: off, as in training's "
                        "manual_gc; a full collection took ~240 ms)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the rows; >1: each row's median run (default 1)")
    p.add_argument("--commit", default=None, help="the commit to record in the JSON (e.g. git rev-parse --short HEAD)")
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
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    args.variants = [v for v in args.variants.split(",") if v]
    for name in args.variants + ([args.profile] if args.profile else []):
        problem = variant_problem(name, cuda=not args.smoke)
        if problem:
            p.error(f"variant {name!r}: {problem}")
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
    from megatron_ext.parallel import destroy_parallel, registered_groups

    world = dist.get_world_size()
    row = row_head(name, args)
    seq, micro_batch = row["seq"], row["micro_batch"]
    stock = "attention" in row
    groups_before = registered_groups()
    try:
        bench_common.init_expert_parallel(seed=1234)
        setup = variant_setup(name, args, cuda)
        row.update(config_fields(setup, cuda))
        steps, warmup = (args.warmup + 1 + PROFILE_ACTIVE_STEPS, 0) if profiler else (args.steps, args.warmup)
        timing = bench_training.time_training_step(
            setup.build, setup.config, args.sizes["vocab"], seq, micro_batch, warmup, steps,
            after_step=setup.after_step, profiler=profiler, fast_step=not stock,
            main_grad_dtype="fp32" if stock else args.main_grad_dtype, manual_gc=not args.automatic_gc,
            counters=setup.counters, nan_guard=not stock, step_graph=setup.step_graph)
        row.update(measured_fields(timing, setup, world, args.peak_tflops), manual_gc=not args.automatic_gc)
        if not row.pop("model_freed"):  # the next rows would run beside its memory
            row["cleanup_error"] = "the model outlived its row (something still references it)"
    except Exception as exc:  # keep the other variants' rows; say why this one is missing
        if dist.get_rank() == 0:
            traceback.print_exc()
        row.update({key: None for key in MEASURED_KEYS}, error=f"{type(exc).__name__}: {exc}"[:400])
    finally:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().clear()  # Megatron's global per-layer aux-loss values
        destroy_parallel(groups_before)  # the next row builds them again
        try:  # after a CUDA error the synchronize in here raises too: the row says so, the JSON still comes
            device = torch.device("cuda") if cuda else torch.device("cpu")
            bench_training.free_device_memory(device)
            row["left_after_row"] = bench_training.device_memory_left(device)
        except Exception as exc:
            row["cleanup_error"] = f"{type(exc).__name__}: {exc}"[:400]
    return row


def row_head(name: str, args) -> dict:
    """A row's name, GPU count and shape (and a stock row's core attention)."""
    seq, micro_batch = variant_shape(name, args.sizes)
    base = split_variant(name)[0]
    row = {"name": name, "gpus": dist.get_world_size(), "seq": seq, "micro_batch": micro_batch}
    if base in STOCK_ATTENTION:
        row["attention"] = STOCK_ATTENTION[base]
    return row


def cuda_context_error() -> str | None:
    """After a failed row: None when the GPU still runs a kernel, else why not. A failed CUDA graph capture or a
    device-side fault can leave the context unusable, and every later row would then fail for that reason."""
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize()
        (torch.ones(1, device="cuda") + 1).cpu()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


MEASURED_KEYS = ("step_ms", "optimizer_ms", "tokens_per_sec", "tflops", "mfu", "mfu_datasheet", "peak_gb")


def config_fields(setup, cuda: bool) -> dict:
    """What an ours row's config is: the keys it sets and, for capacity routing, the routing layout."""
    from megatron.core import parallel_state as ps

    if setup.config_keys is None:
        return {}
    fields = {"config_keys": setup.config_keys, "attn_res": setup.config.attn_res}
    if setup.counters is not None:
        fields.update(capacity_layout(setup.config, cuda, ps.get_expert_model_parallel_group()))
    return fields


def measured_fields(timing: dict, setup, world: int, peak_tflops: float) -> dict:
    """Throughput and MFU (against the measured peak and the datasheet's) of one timed row."""
    from megatron_ext.flops import model_flops_per_token

    flops_per_token = model_flops_per_token(setup.flops_config, setup.seq)
    tokens_per_sec = world * setup.micro_batch * setup.seq / (timing["step_ms"] / 1e3)
    tflops = flops_per_token * tokens_per_sec / world / 1e12  # per GPU
    return dict(timing, tokens_per_sec=tokens_per_sec, tflops=tflops, mfu=tflops / peak_tflops,
                mfu_datasheet=tflops / H200_DATASHEET_BF16_TFLOPS, flops_per_token=flops_per_token)


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
def result_of(runs: list[dict], rounds: int, args, cuda: bool) -> dict:
    """The JSON of ``rounds`` rounds of rows (``repeat``: how many; rows are each name's median run)."""
    import megatron.core

    return {"rows": median_rows(runs) if args.repeat > 1 else runs, **({"runs": runs} if args.repeat > 1 else {}),
            "repeat": rounds, "commit": args.commit, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "date": datetime.date.today().isoformat(), "peak_tflops_measured": args.peak_tflops,
            "peak_tflops_datasheet": H200_DATASHEET_BF16_TFLOPS, "peak_datasheet": DATASHEET_PEAK_NAME,
            "dtype": "bf16" if cuda else "fp32", "steps": args.steps, "warmup": args.warmup,
            "model": args.sizes["model"], "vocab": args.sizes["vocab"],
            "capacity_factor": CAPACITY_FACTOR, "stock_aux_loss_coeff": STOCK_AUX_LOSS,
            "flops": "megatron_ext/flops.py, training = 3 x forward; tflops is per GPU; see docs/e2e.md",
            "torch": torch.__version__, "megatron_core": megatron.core.__version__, "smoke": args.smoke}


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
    runs, broken = [], None
    for round_ in range(args.repeat):
        for name in args.variants:
            if broken:  # not run: recorded as such rather than as this row's own failure
                runs.append({**row_head(name, args), **{key: None for key in MEASURED_KEYS}, "error": broken})
            else:
                runs.append(run_variant(name, args, cuda))
                context_error = cuda_context_error() if runs[-1].get("error") else None
                if context_error:
                    broken = f"not run: the CUDA context failed after row {name} ({context_error})"
            if args.repeat > 1:
                runs[-1]["round"] = round_
            if rank == 0:
                left = runs[-1].get("left_after_row")
                log(f"> {name}: " + (runs[-1].get("error") or f"{runs[-1]['step_ms']:.1f} ms/step") + (
                    f" (left after it: {left['device_used_gb']:.2f} GB in use, {left['torch_reserved_gb']:.2f} GB "
                    "of it the allocator's)" if left else ""))
        if rank == 0 and args.out and round_ + 1 < args.repeat:  # a time limit or a crash keeps the rounds done
            write_json(args.out, result_of(runs, round_ + 1, args, cuda))
            log(f"> round {round_ + 1} of {args.repeat} written to {args.out}")
    result = result_of(runs, args.repeat, args, cuda)
    rows = result["rows"]
    if rank == 0:
        if args.out:
            write_json(args.out, result)
            log(f"> wrote {args.out}")
        log(f"MFU meas.: against the bf16 matmul peak measured here, {args.peak_tflops:.1f} TFLOP/s "
            f"({result['device']}); MFU {H200_DATASHEET_BF16_TFLOPS:.0f}: against {H200_DATASHEET_BF16_TFLOPS:.0f} "
            f"TFLOP/s ({DATASHEET_PEAK_NAME})")
        for row in rows if args.repeat > 1 else ():
            log(f"> {row['name']}: median of {args.repeat} rounds, step ms per round "
                + ", ".join("failed" if ms is None else f"{ms:.1f}" for ms in row["step_ms_runs"]))
        log(format_table(rows))
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(prog="bench_e2e.py merge", description=merge_calls.__doc__.split(":")[0])
        p.add_argument("paths", nargs="+", help="the JSON files of the calls, in call order")
        p.add_argument("--commit", required=True, help="the commit every call timed")
        p.add_argument("--out", required=True)
        merge_args = p.parse_args(argv[1:])
        result = merge_calls([json.loads(Path(path).read_text()) for path in merge_args.paths], merge_args.commit)
        Path(merge_args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(format_table(result["rows"]) + f"\n> wrote {merge_args.out}")
        return result
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
