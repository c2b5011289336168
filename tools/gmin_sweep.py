"""The g_min sweep: one small hybrid model per decay-gate setting, same data and budget, then loss vs length.

    python tools/gmin_sweep.py --config configs/gmin-sweep.yaml --out-dir runs/gmin-sweep \\
        --data-path data/text --steps 150 --time-budget 540 --json sweep.json --plot sweep.png

Settings (``--settings``, comma-separated, in run order): ``gmin-3``, ``gmin-5``, ``gmin-8``, ``gmin-12`` (any
``gmin-<X>``: the lower-bounded gate g = -X * sigmoid(...)), ``softplus`` (the unbounded gate) and ``rope-full``
(the reference for extrapolation: every layer full attention, with RoPE). All share ``--config`` (the KDA 3:1
hybrid, NoPE) and its data; each trains through the user's path, ``launch/train.py`` under torchrun (one
subprocess per setting, ``--nproc`` processes), saving its final weights, and is evaluated by
``tools/eval_lengths.py`` at ``--multiples`` of the training length on the held-out split.

Per setting the JSON holds: steps done, training loss (mean of the last logged values) and its curve, tokens/s,
held-out loss at the training length, loss vs length (and over the positions past the training length), the
kernel path the bound selects (dense diagonal tiles for g_min >= -5; the per-position diagonal path below -5,
where the dense tiles would overflow fp32, and for softplus), the kernel's forward+backward time at the sweep's
shape (CUDA only: ``chunk_kda`` bf16 with the in-kernel gate; on the CPU the field says why it is missing), and
every bf16 overflow / NaN met: logged non-finite losses or grad norms, steps the trainer's non-finite guard did
not apply, non-finite held-out losses.

Time: ``--time-budget`` seconds for the whole sweep. A setting may run until the time left only just covers the
settings after it at the typical duration so far (``--min-setting-seconds`` until two have finished); a training
job still running then gets SIGTERM (the trainer saves and exits; docs/training.md), so the sweep always evaluates
what it has and writes its JSON and plot (rewritten after every setting). Settings cut short say so in ``status``
and ``steps``: compare only equal step counts. ``--steps`` sets train_iters for every setting (the lead's knob). Flags after
``--`` go to every launch/train.py (e.g. ``-- --micro-batch-size 8``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.eval_lengths import UsageError  # noqa: E402
from tools.gmin_report import plot_sweep, table, write_outputs  # noqa: E402
from tools.gmin_settings import kernel_path, parse_setting, time_kernel  # noqa: E402

DEFAULT_SETTINGS = "gmin-5,gmin-3,gmin-8,gmin-12,softplus,rope-full"
SETTING_KEYS = ("name", "gate", "g_min", "kernel_path", "overrides", "status", "steps", "train_loss",
                "train_curve", "tokens_per_s", "train_seconds", "heldout_loss_train_length", "lengths",
                "kernel_ms", "nonfinite", "eval_seconds")
SKIPPED_LINE = re.compile(r"the update was not applied")


def read_yaml(path: str) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise UsageError(f"--config: {path} does not exist")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise UsageError(f"--config: {path} is not a YAML mapping")
    return values


# --------------------------------------------------------------------------- one setting


def _terminate(proc: subprocess.Popen, grace: float, log) -> None:
    if proc.poll() is not None:
        return
    log("    time share over: SIGTERM to the training job (it finishes the step, saves and exits)")
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its workers, as SLURM sends it
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log("    training job did not exit: SIGKILL")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def train_setting(setting: dict, args, run_dir: str, deadline: float, log) -> dict:
    """launch/train.py for one setting until done or ``deadline``; returns the training fields."""
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.join(ROOT, "launch", "train.py"), "--config", args.config, *setting["overrides"],
           "--metrics-dir", run_dir, "--save", os.path.join(run_dir, "checkpoints"), "--no-save-optim",
           "--tensorboard-dir", ""]
    if args.steps:
        cmd += ["--train-iters", str(args.steps)]
    if args.data_path:
        cmd += ["--data-path", *args.data_path]
    cmd += args.train_args
    log(f"    {' '.join(cmd[3:])}")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    # a checkpoint left by an earlier sweep in this directory would be evaluated as this run's
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    start = time.monotonic()
    with open(os.path.join(run_dir, "train.log"), "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        last_report = start
        while proc.poll() is None:
            if time.monotonic() >= deadline:
                _terminate(proc, args.term_grace, log)
                break
            time.sleep(1.0)
            if time.monotonic() - last_report >= args.progress_interval:
                last_report = time.monotonic()
                records = _train_records(metrics)
                if records:
                    r = records[-1]
                    log(f"    iteration {r['iteration']}: lm loss {r['lm_loss']:.4f}, "
                        f"{r.get('tokens_per_sec') or 0:.0f} tokens/s, {time.monotonic() - start:.0f}s")
        rc = proc.wait()
    seconds = time.monotonic() - start
    with open(os.path.join(run_dir, "train.log"), errors="replace") as f:
        text = f.read()
    records = _train_records(metrics)
    losses = [r["lm_loss"] for r in records]
    finite = [x for x in losses if math.isfinite(x)]
    nonfinite = dict(
        logged_nonfinite_loss=sum(not math.isfinite(x) for x in losses),
        logged_nonfinite_grad_norm=sum(not math.isfinite(r.get("grad_norm", 0.0)) for r in records),
        skipped_steps=len(SKIPPED_LINE.findall(text)),
    )
    tps = [r["tokens_per_sec"] for r in records[1:] if r.get("tokens_per_sec")] or \
        [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    from megatron_ext.training.checkpointing import complete_checkpoints

    saved = bool(complete_checkpoints(os.path.join(run_dir, "checkpoints")))
    if "stopped after iteration" in text:
        status = "cut by the time budget (SIGTERM)" + ("; saved" if saved else "; NOT saved")
    elif rc == 0 and "> done" in text:
        status = "done"
    else:
        status = f"train exit {rc}" + ("" if saved else ", no checkpoint")
    if rc != 0 and "stopped after iteration" not in text:
        tail = "\n".join(line for line in text.strip().splitlines()[-5:])
        log(f"    trainer failed (exit {rc}):\n{tail}")
    return dict(status=status, saved=saved, steps=records[-1]["iteration"] if records else 0,
                train_loss=statistics.fmean(finite[-3:]) if finite else None,
                train_curve=[[r["iteration"], r["lm_loss"]] for r in records],
                tokens_per_s=round(statistics.median(tps), 1) if tps else None, train_seconds=round(seconds, 1),
                nonfinite=nonfinite, returncode=rc)


def _train_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if rec.get("split") != "valid" and "lm_loss" in rec:
                out.append(rec)
    return out


def eval_setting(setting: dict, args, run_dir: str, timeout: float, log) -> dict:
    out = os.path.join(run_dir, "lengths.json")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "eval_lengths.py"), os.path.join(run_dir, "checkpoints"),
           "--multiples", args.multiples, "--tokens", str(args.eval_tokens), "--label", setting["name"], "--out", out]
    if args.data_path:
        cmd += ["--data-path", *args.data_path]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        return dict(eval_error=f"eval_lengths ran past its {timeout:.0f}s share", eval_seconds=round(timeout, 1))
    for line in proc.stdout.splitlines():
        if line.startswith("  length"):
            log("  " + line)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        log(f"    eval_lengths failed (exit {proc.returncode}):\n{tail}")
        return dict(eval_error=f"eval_lengths exit {proc.returncode}: {tail[-400:]}",
                    eval_seconds=round(time.monotonic() - start, 1))
    with open(out) as f:
        result = json.load(f)
    rows = result["rows"]
    first = next((r for r in rows if r.get("multiple") == 1.0), rows[0] if rows else None)
    return dict(lengths=rows, heldout_loss_train_length=first["loss"] if first else None,
                eval_dtype=result["dtype"], eval_data=result["data"], eval_iteration=result["iteration"],
                heldout_nonfinite=sum(r.get("nonfinite") or 0 for r in rows),
                eval_seconds=round(time.monotonic() - start, 1))


# --------------------------------------------------------------------------- the sweep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gmin-sweep.yaml"),
                   help="shared training YAML (default configs/gmin-sweep.yaml; configs/gmin-sweep-tiny.yaml on CPU)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "gmin-sweep"), help="one run directory per setting")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated, in run order (default "
                   f"{DEFAULT_SETTINGS})")
    p.add_argument("--steps", type=int, default=None, help="train_iters for every setting (default: the config's)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole sweep (default: none)")
    p.add_argument("--data-path", nargs="+", default=None, help="indexed data prefixes (default: the config's)")
    p.add_argument("--multiples", default="1,2,4,8,16", help="eval lengths as multiples of seq_length")
    p.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens per length (eval_lengths --tokens)")
    p.add_argument("--eval-reserve", type=float, default=None,
                   help="seconds of each setting's share kept for its evaluation (default 25 on CUDA, 30 on CPU; "
                   "after an evaluation its measured time + 5 s when larger)")
    p.add_argument("--nproc", type=int, default=1, help="torchrun processes per training job (default 1)")
    p.add_argument("--no-kernel-timing", action="store_true", help="skip the chunk_kda timing")
    p.add_argument("--json", default=None, help="summary JSON (default OUT_DIR/gmin-sweep.json)")
    p.add_argument("--plot", default=None, help="PNG: training curves and loss vs length (default next to --json)")
    p.add_argument("--min-setting-seconds", type=float, default=None,
                   help="time kept for each setting still to run until two have finished (default 60 on CUDA, 30 "
                   "on CPU); later the median duration of the finished ones after the first")
    p.add_argument("--term-grace", type=float, default=30.0, help="seconds a SIGTERMed trainer gets to save")
    p.add_argument("--progress-interval", type=float, default=20.0, help="seconds between progress lines")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only redraw --plot from a finished sweep's JSON (e.g. where the GPU had no matplotlib)")
    return p


def run(args, log=print) -> dict:
    import torch

    start = time.monotonic()
    deadline = start + args.time_budget if args.time_budget else float("inf")
    if args.time_budget is not None and args.time_budget <= 0:
        raise UsageError(f"--time-budget={args.time_budget}: must be > 0 seconds")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps={args.steps}: must be >= 1")
    if args.nproc < 1:
        raise UsageError(f"--nproc={args.nproc}: must be >= 1")
    if args.eval_tokens < 1:
        raise UsageError(f"--eval-tokens={args.eval_tokens}: must be >= 1")
    args.config = os.path.abspath(args.config)
    config = read_yaml(args.config)
    settings = [parse_setting(n.strip()) for n in args.settings.split(",") if n.strip()]
    if not settings:
        raise UsageError("--settings: empty")
    names = [s["name"] for s in settings]
    if len(set(names)) != len(names):
        raise UsageError(f"--settings: {args.settings!r} names a setting twice")
    try:
        multiples = [float(m) for m in args.multiples.split(",")]
        assert multiples and all(m > 0 for m in multiples)
    except (ValueError, AssertionError):
        raise UsageError(f"--multiples={args.multiples!r}: expected positive numbers, e.g. 1,2,4,8,16") from None
    if args.data_path:
        for prefix in args.data_path:
            if not re.fullmatch(r"\d+(\.\d+)?", prefix) and not os.path.isfile(prefix + ".idx"):
                raise UsageError(f"--data-path: {prefix}.idx not found (build it with tools/preprocess_data.py)")
    args.json = args.json or os.path.join(args.out_dir, "gmin-sweep.json")
    args.plot = args.plot or os.path.splitext(args.json)[0] + ".png"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if args.min_setting_seconds is None:
        args.min_setting_seconds = 60.0 if torch.cuda.is_available() else 30.0
    eval_reserve = args.eval_reserve if args.eval_reserve is not None else (25.0 if torch.cuda.is_available() else 30.0)
    seq = int(config.get("seq_length", 128))
    heads = int(config.get("kda_num_heads") or config.get("num_attention_heads"))
    head_dim = int(config.get("kda_head_dim") or config.get("kv_channels")
                   or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    shape = dict(B=int(config.get("micro_batch_size", 1)), T=seq, H=heads, D=head_dim)
    summary = dict(tool="gmin_sweep", config=os.path.relpath(args.config, ROOT), device=device,
                   train_length=seq, steps_asked=args.steps or config.get("train_iters"),
                   tokens_per_step=int(config.get("global_batch_size") or config.get("micro_batch_size", 1)) * seq,
                   data_path=args.data_path or config.get("data_path"), multiples=multiples,
                   time_budget_s=args.time_budget, kernel_shape=shape, settings=[])
    log(f"> gmin sweep: {len(settings)} settings {names} on {device}, config {summary['config']}, "
        f"budget {args.time_budget or 'none'}s")
    for s in settings:
        s["kernel_path"] = kernel_path(s)
    if not args.no_kernel_timing:  # first: the Triton compiles land in the cache the trainers then reuse
        for s in settings:
            if time.monotonic() > deadline - 60:
                s["kernel_ms"] = dict(skipped="time budget")
                continue
            try:
                s["kernel_ms"] = time_kernel(s, shape)
            except Exception as exc:  # a kernel failure is a result of the sweep, not its end
                s["kernel_ms"] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            if "ms" in s["kernel_ms"]:
                log(f"  kernel {s['name']}: {s['kernel_ms']['ms']} ms fwd+bwd at {s['kernel_ms']['shape']} "
                    f"({s['kernel_path']})")
    else:
        for s in settings:
            s["kernel_ms"] = dict(skipped="--no-kernel-timing")
    durations = []  # wall seconds of the finished settings (train + eval)
    for i, s in enumerate(settings):
        left = len(settings) - i
        now = time.monotonic()
        # Each setting may run until the time left only just covers the settings after it, each at the typical
        # duration so far: the median of the finished settings after the first (which also compiled the Triton
        # kernels), --min-setting-seconds before there is one. A setting that finishes its steps early leaves
        # the time to the rest, and the first one is not cut for its compiles.
        later = durations[1:]
        typical = statistics.median(later) if later else args.min_setting_seconds
        budget_here = deadline - now - (left - 1) * typical
        run_dir = os.path.join(args.out_dir, s["name"])
        log(f"> [{i + 1}/{len(settings)}] {s['name']}: {s['kernel_path']}"
            + (f"; up to {budget_here:.0f}s" if math.isfinite(budget_here) else ""))
        if budget_here < eval_reserve + 20:
            s.update(status="not run: time budget spent")
            summary["settings"].append(s)
            write_outputs(summary, args, log)
            continue
        train_deadline = now + budget_here - eval_reserve
        s.update(train_setting(s, args, run_dir, train_deadline, log))
        if s["saved"]:
            eval_timeout = max(deadline - time.monotonic() - 5, 10) if math.isfinite(deadline) else 3600
            s.update(eval_setting(s, args, run_dir, eval_timeout, log))
            eval_reserve = max(eval_reserve, s["eval_seconds"] + 5)
        log(f"  {s['name']}: {s['status']}, {s['steps']} steps, train loss "
            f"{s['train_loss'] if s['train_loss'] is None else round(s['train_loss'], 4)}, held-out "
            f"{s.get('heldout_loss_train_length')}, non-finite {s['nonfinite']}")
        durations.append(time.monotonic() - now)
        summary["settings"].append(s)
        summary["elapsed_s"] = round(time.monotonic() - start, 1)
        write_outputs(summary, args, log)
    summary["elapsed_s"] = round(time.monotonic() - start, 1)
    write_outputs(summary, args, log)
    log(f"> wrote {args.json} and {args.plot}")
    log(table(summary))
    return summary


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    args.train_args = extra  # after --: more launch/train.py flags for every setting
    try:
        if args.replot:
            if not os.path.isfile(args.replot):
                raise UsageError(f"--replot: {args.replot} does not exist")
            with open(args.replot) as f:
                summary = json.load(f)
            plot_sweep(summary, args.plot or os.path.splitext(args.replot)[0] + ".png")
            print(table(summary))
            return 0
        run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
