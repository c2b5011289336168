"""The user's job on the GPU, through the public CLI and the shipped configs only (run by tools/gpu/acceptance.sh).

Steps (``--steps``, comma-separated; each has its own time limit and records ``name``, ``passed`` and figures):

* ``resume`` - ``configs/h200.yaml`` trains RESUME_ITERS iterations saving every SAVE_INTERVAL (run B) and is
  SIGKILLed past iteration KILL_AFTER, as a node failure would end it; run C resumes from the last checkpoint. B's
  iterations past that checkpoint are the uninterrupted run of the same iterations: C's first one (a forward pass
  of the loaded weights on the same batch; only reduction order may differ) within FIRST_TOLERANCE, the next
  JUDGED_UPDATES (the loaded optimizer state's updates as well) within TOLERANCE, relative; the rest are recorded,
  not judged. bf16 steps do not repeat bit for bit on the GPU and their differences grow step by step: two runs
  resumed from one checkpoint (sigterm's T against C, no resume between them) differed by <= 0.09% over the first
  two updates and by 0.77% within six on the H200, B against C by 0.02%, 0.09%, then 1.07% at the fourth; two runs
  from scratch by 34% at iteration 12 (a loss spike one of them took). A wrong data position moves the first
  iteration by far more than FIRST_TOLERANCE (two batches differ by ~15%), lost moments or a wrong step count the
  first updates by more than TOLERANCE;
* ``sigterm`` - run T, started by ``launch/torchrun.sh`` from B's checkpoint without interval saves, gets SIGTERM
  once it has logged SIGTERM_AFTER (as SLURM's ``--signal`` reaches the batch script) and must save the iteration
  it stands at and exit 0; run T2 resumes from that save and must log from the next iteration to the end with
  finite losses. T against run C (the same checkpoint, uninterrupted): its first iteration within FIRST_TOLERANCE
  and its next JUDGED_UPDATES within TOLERANCE. T2 against C is recorded, not judged: T stands ~8 iterations past
  C's checkpoint by then, where the two runs' drift is no longer bf16 rounding (4% at iteration 18 at 34880a5,
  T2 8.3% off C at its first iteration); that a signal's save resumes bit for bit is
  tests/training/test_faults.py's (CPU, deterministic). Needs ``resume`` run before it on this machine: in the same
  call, or in an earlier call while the machine is still held (its run C and checkpoint stay on disk; ``resume``
  alone can take 330 s of a call's 600);
* ``balancers`` (one step ``balancer-<name>`` each) - each balancer trains BALANCER_ITERS iterations of ``configs/h200.yaml``: tokens/s (median of
  the logged windows after the first), MaxVio, dropped and rerouted pairs;
* ``step-graph`` - ``configs/h200.yaml`` trained GRAPH_ITERS iterations eager (run E, ``--no-cuda-graph-step``) and
  with ``--cuda-graph-step`` (run G, the config's own setting: two eager steps, then one graph replayed): G's
  losses against E's by the resume rule (iteration 2, the last eager one, within FIRST_TOLERANCE; the first
  replays within TOLERANCE) and both runs' tokens/s (median of the iterations of the second half): what
  ``cuda_graph_step`` gives the shipped config;
* ``tensorboard`` - run C's TensorBoard run (a resumed run) holds a loss point per logged iteration, the scalars,
  the per-rank histograms and the load heatmap;
* ``gpu-tests`` / ``fla-test`` - ``pytest -m gpu`` over the suite without / with only fla's comparison test (fla
  autotunes for minutes);
* ``ep2`` - on two GPUs: run B's one-GPU checkpoint loads under EP2 and continues with run B's losses (bf16
  rounding differs between layouts: within EP2_TOLERANCE); before ``sigterm``, which makes room by removing it.

A checkpoint of this model with its optimizer state is ~46 GB (3.3B parameters: bf16 weights, fp32 main weights
and two moments) and the H200 machine has 64 GB of disk, so the steps keep one checkpoint at a time, in a tmpfs
(``/dev/shm``) when it has room: the steps check what a checkpoint holds and how a resume continues, not the disk.
Each run records when its first and last iteration were logged (start-up and save/load times follow from them);
how a run is started, signalled and read back: ``tools/gpu/acceptance_runs.py``. The report is written after every
step; a SIGTERM (a device call's time limit) records the running step as interrupted, kills its training run
(which has its own session, so the signal would not reach it and it would train on beside the next call's runs
on a warm machine) and exits 143 without starting the rest.

``--config`` and ``--extra`` exist for a dry run of the script itself on the CPU (e.g. ``--config configs/tiny.yaml
--extra="--expert-model-parallel-size 1"``); the GPU run uses the defaults.

``python tools/gpu/acceptance.py merge A.json B.json --out C.json`` joins the JSON of two calls of one commit
(``--mixed-commits``: of two commits, each step naming its own).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from megatron_ext.moe.balancers import BALANCERS, CAPACITY_BALANCERS  # noqa: E402
from tools.gpu.acceptance_runs import (  # noqa: E402
    DEFAULT_CONFIG, Job, checkpoint_root, records, timing, train,
)

RESUME_ITERS, SAVE_INTERVAL, KILL_AFTER, SIGTERM_AFTER = 30, 10, 16, 11
FIRST_TOLERANCE, TOLERANCE = 1e-3, 1e-2
JUDGED_UPDATES = 2  # iterations after a resume's first that are judged; later ones carry the GPU's growing noise
BALANCER_ITERS, BALANCER_LOG_INTERVAL = 30, 5
CAPACITY = ("--moe-expert-capacity-factor", "1.25")  # as issue 29 measured them
BALANCER_FLAGS = {"aux_loss": ("--moe-aux-loss-coeff", "1e-2"), **{b: CAPACITY for b in CAPACITY_BALANCERS}}
GRAPH_ITERS = 30  # past COMMON's 20 warm-up iterations (train.py refuses a warm-up as long as the run)
EP2_TOLERANCE = 2e-2  # relative: bf16 sums in another order over 10 steps


def max_rel_diff(a: dict[int, dict], b: dict[int, dict], iterations) -> float:
    return max(abs(a[i]["lm_loss"] - b[i]["lm_loss"]) / abs(a[i]["lm_loss"]) for i in iterations)


def judge_losses(reference: dict[int, dict], resumed: dict[int, dict], post: list[int],
                 first_tolerance: float = TOLERANCE) -> dict:
    """A resumed run's losses at ``post`` (the iterations after its checkpoint) against a reference run's: the
    first within ``first_tolerance``, the next JUDGED_UPDATES within TOLERANCE, relative; the rest recorded only
    (``unjudged_max_rel_diff``)."""
    missing = [i for i in post if i not in reference or i not in resumed]
    if not post or missing:
        return {"passed": False, "why": f"missing iterations {missing or 'after the checkpoint'}"}
    judged, unjudged = post[1:1 + JUDGED_UPDATES], post[1 + JUDGED_UPDATES:]
    first = max_rel_diff(reference, resumed, post[:1])
    later = max_rel_diff(reference, resumed, judged) if judged else 0.0
    return {"passed": first <= first_tolerance and later <= TOLERANCE, "first_rel_diff": first,
            "later_max_rel_diff": later, "tolerances": [first_tolerance, TOLERANCE],
            "judged_iterations": post[:1 + JUDGED_UPDATES],
            "unjudged_max_rel_diff": max_rel_diff(reference, resumed, unjudged) if unjudged else None,
            "losses_reference": [reference[i]["lm_loss"] for i in post],
            "losses_resumed": [resumed[i]["lm_loss"] for i in post]}


def last_checkpoint(ckpt: Path) -> int:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text()) if tracker.exists() else 0


def disk_gb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9, 2)


def step_resume(job: Job) -> dict:
    ckpt = job.checkpoints / "B"
    shutil.rmtree(job.checkpoints, ignore_errors=True)  # one checkpoint at a time
    b = train(job, "B", "--train-iters", str(RESUME_ITERS), "--save", str(ckpt),
              "--save-interval", str(SAVE_INTERVAL), "--log-interval", "1", kill_after=KILL_AFTER)
    saved = last_checkpoint(ckpt)
    post = list(range(saved + 1, max(b["records"], default=0) + 1))  # what B logged past its checkpoint
    if not saved or len(post) < 1 + JUDGED_UPDATES or any(i not in b["records"] for i in post):
        return {"passed": False, "why": f"interrupted run: saved at {saved}, logged {sorted(b['records'])}",
                "tail": b["tail"]}
    # the same schedule (train_iters fixes the LR decay), to its end: a killed run loses its unflushed metrics
    c = train(job, "C", "--train-iters", str(RESUME_ITERS), "--load", str(ckpt), "--save", "",
              "--log-interval", "1")
    if c["rc"] != 0:
        return {"passed": False, "why": "resume failed", "tail": c["tail"]}
    return {**judge_losses(b["records"], c["records"], post, FIRST_TOLERANCE), "resumed_from": saved,
            "killed_rc": b["rc"], "killed_at_iteration": max(b["records"]),
            "tokens_per_sec": window_figures(c["records"])["tokens_per_sec"],
            "checkpoint_gb": disk_gb(ckpt), "checkpoint_dir": str(job.checkpoints),
            "timing": dict(zip("BC", timing(b, c)))}


def step_sigterm(job: Job) -> dict:
    reference, loaded = records(job.work / "C"), job.checkpoints / "B"
    resumed_from = last_checkpoint(loaded)
    if not resumed_from or resumed_from + 1 not in reference:
        return {"passed": False, "why": "needs the resume step's checkpoint and run C (this call or an earlier one "
                                        "on this machine)"}
    ckpt = job.checkpoints / "T"
    # B's checkpoint is read by the time T logs: removed then, one checkpoint in the tmpfs at a time
    t = train(job, "T", "--train-iters", str(RESUME_ITERS), "--load", str(loaded), "--save", str(ckpt),
              "--save-interval", "100", "--log-interval", "1", kill_after=SIGTERM_AFTER, sig=signal.SIGTERM,
              on_first_log=lambda: shutil.rmtree(loaded, ignore_errors=True))
    saved, stood_at = last_checkpoint(ckpt), max(t["records"], default=0)
    if t["rc"] != 0 or saved < SIGTERM_AFTER or saved != stood_at:
        return {"passed": False, "why": f"SIGTERM: rc {t['rc']}, saved at {saved}, last logged {stood_at}",
                "tail": t["tail"]}
    r = train(job, "T2", "--train-iters", str(RESUME_ITERS), "--load", str(ckpt), "--save", "",
              "--log-interval", "1")
    shutil.rmtree(ckpt, ignore_errors=True)
    if r["rc"] != 0:
        return {"passed": False, "why": "resume after SIGTERM failed", "tail": r["tail"]}
    before = judge_losses(reference, t["records"], list(range(resumed_from + 1, saved + 1)), FIRST_TOLERANCE)
    continued = sorted(r["records"]) == list(range(saved + 1, RESUME_ITERS + 1)) and all(
        math.isfinite(rec["lm_loss"]) for rec in r["records"].values())
    shared = sorted(i for i in r["records"] if i in reference)
    # recorded, not judged (T2 continues T, not C); the losses say whether a distance is drift or a step change
    after = {"continued_to_the_end": continued,
             "max_rel_diff_to_C": max_rel_diff(reference, r["records"], shared) if shared else None,
             "iterations": shared, "losses_C": [reference[i]["lm_loss"] for i in shared],
             "losses_T2": [r["records"][i]["lm_loss"] for i in shared]}
    return {"passed": before["passed"] and continued, "saved_at_iteration": saved,
            "before_signal": before, "after_resume": after, "signal_to_exit_s": t["signal_to_exit_s"],
            "timing": dict(zip(("T", "T2"), timing(t, r)))}


def window_figures(recs: dict[int, dict]) -> dict:
    logged = [recs[i] for i in sorted(recs)]
    speeds = [r["tokens_per_sec"] for r in logged[1:]]  # the first window holds compilation and warm-up
    last = logged[-1]
    return {"tokens_per_sec": statistics.median(speeds) if speeds else None,
            "maxvio_mean": last.get("moe/maxvio/mean"), "maxvio_max": last.get("moe/maxvio/max"),
            "ep_load_factor_max": last.get("moe/ep_load_factor/max"),
            "dropped": sum(r.get("moe/dropped", 0) for r in logged),
            "rerouted": sum(r.get("moe/rerouted", 0) for r in logged),
            "lm_loss_last": last["lm_loss"], "mfu_percent": last.get("mfu_percent")}


def step_balancer(balancer: str, job: Job) -> dict:
    run = train(job, f"bal-{balancer}", "--moe-balancer", balancer, *BALANCER_FLAGS.get(balancer, ()), "--train-iters", str(BALANCER_ITERS),
                "--log-interval", str(BALANCER_LOG_INTERVAL), "--save", "")
    ok = run["rc"] == 0 and len(run["records"]) == BALANCER_ITERS // BALANCER_LOG_INTERVAL and all(
        math.isfinite(r["lm_loss"]) for r in run["records"].values())
    return {"passed": ok, **(window_figures(run["records"]) if run["records"] else {"tail": run["tail"]}),
            "iterations": BALANCER_ITERS, **timing(run)[0]}


def step_step_graph(job: Job) -> dict:
    runs = {}
    for name, flags in (("E", ("--no-cuda-graph-step",)), ("G", ("--cuda-graph-step",))):
        runs[name] = train(job, f"graph-{name}", *flags, "--train-iters", str(GRAPH_ITERS), "--log-interval", "1",
                           "--save", "")
        if runs[name]["rc"] != 0 or len(runs[name]["records"]) != GRAPH_ITERS:
            return {"passed": False, "why": f"run {name} failed", "tail": runs[name]["tail"]}
    eager, graph = runs["E"]["records"], runs["G"]["records"]
    speed = {name: statistics.median(r["tokens_per_sec"] for i, r in run["records"].items() if i > GRAPH_ITERS // 2)
             for name, run in runs.items()}
    return {**judge_losses(eager, graph, list(range(2, GRAPH_ITERS + 1)), FIRST_TOLERANCE),
            "tokens_per_sec_eager": speed["E"], "tokens_per_sec_graph": speed["G"],
            "graph_vs_eager": speed["G"] / speed["E"], "timing": dict(zip("EG", timing(runs["E"], runs["G"])))}


def step_tensorboard(job: Job) -> dict:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    tb, logged = job.work / "C" / "tb", records(job.work / "C")
    if not tb.exists() or not logged:
        return {"passed": False, "why": "needs the resume step's run C in the same call"}
    mux = EventMultiplexer().AddRunsFromDirectory(str(tb))
    mux.Reload()
    tags = {run: mux.GetAccumulator(run).Tags() for run in mux.Runs()}
    scalars = {t for v in tags.values() for t in v.get("scalars", [])}
    histograms = {t for v in tags.values() for t in v.get("histograms", [])}
    images = {t for v in tags.values() for t in v.get("images", [])}
    loss_points = sum(len(mux.GetAccumulator(run).Scalars("lm loss")) for run, v in tags.items()
                      if "lm loss" in v.get("scalars", []))
    checks = {"lm_loss_points": loss_points == len(logged),
              "moe_scalars": any(t.startswith("moe/maxvio") for t in scalars),
              "per_rank_histograms": any(t.startswith("moe/tokens_per_expert/rank_") for t in histograms),
              "heatmap": any("heatmap" in t for t in images)}
    failed = [name for name, ok in checks.items() if not ok]
    return {"passed": not failed, **({"why": f"missing: {', '.join(failed)}; "} if failed else {}), "checks": checks, "runs": sorted(tags), "scalar_tags": len(scalars),
            "histogram_tags": len(histograms), "image_tags": sorted(images)}


def pytest_step(*args: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *args]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        tail, rc = (proc.stdout + proc.stderr)[-4000:], proc.returncode
    except subprocess.TimeoutExpired as exc:
        tail, rc = str(exc.stdout or "")[-4000:], "timeout"
    summary = [line for line in tail.splitlines() if " passed" in line or " failed" in line]
    return {"passed": rc == 0, "rc": rc, "summary": summary[-1] if summary else None,
            "seconds": round(time.monotonic() - start, 1), **({} if rc == 0 else {"tail": tail})}


FLA_TEST = "tests/kernels/test_kda.py::test_bf16_on_gpu_matches_fla"


def step_ep2(job: Job) -> dict:
    import torch

    if torch.cuda.device_count() < 2:
        return {"passed": None, "skipped": "one GPU on this machine"}
    reference, ckpt = records(job.work / "B"), job.checkpoints / "B"
    resumed_from = last_checkpoint(ckpt)
    post = [i for i in range(resumed_from + 1, KILL_AFTER + 1) if i in reference]
    if not resumed_from or not post:
        return {"passed": False, "why": "needs the resume step's run B and its checkpoint in the same call"}
    run = train(job, "EP2", "--train-iters", str(RESUME_ITERS), "--load", str(ckpt), "--save", "",
                "--expert-model-parallel-size", "2", "--no-cuda-graph-step", "--log-interval", "1", nproc=2)
    if run["rc"] != 0 or any(i not in run["records"] for i in post):
        return {"passed": False, "why": "EP2 resume failed", "tail": run["tail"]}
    diff = max_rel_diff(reference, run["records"], post)
    return {"passed": diff <= EP2_TOLERANCE, "resumed_from": resumed_from, "max_rel_diff": diff,
            "tolerance": EP2_TOLERANCE, "tokens_per_sec": window_figures(run["records"])["tokens_per_sec"]}


STEP_GROUPS = {"balancers": [f"balancer-{b}" for b in BALANCERS]}
STEPS = {
    "resume": step_resume,
    "ep2": step_ep2,
    "sigterm": step_sigterm,  # after ep2: it removes B's checkpoint
    **{f"balancer-{b}": functools.partial(step_balancer, b) for b in BALANCERS},
    "step-graph": step_step_graph,
    "tensorboard": step_tensorboard,
    # 371 s alone on the H200; the limit leaves room for a call that shares the GPU with another job
    "gpu-tests": lambda job: pytest_step("tests", "--deselect", FLA_TEST, timeout=570),
    "fla-test": lambda job: pytest_step(FLA_TEST, timeout=420),
}


def device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"


def summary_line(name: str, result: dict) -> str:
    state = {True: "passed", False: "FAILED", None: "skipped"}[result.get("passed")]
    figures = {k: v for k, v in result.items()
               if isinstance(v, (int, float, str)) and k not in ("name", "passed", "why", "tail")}
    text = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in list(figures.items())[:6])
    why = f"{result['why']}; " if result.get("why") else ""
    return f"{name:<22} {state:<8} {why}{text}"


def step_names(steps: str) -> list[str]:
    """``--steps``: names of STEPS or of STEP_GROUPS, comma-separated, checked before anything runs."""
    names = [n for part in steps.split(",") for n in STEP_GROUPS.get(part, [part])]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        raise SystemExit(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join([*STEPS, *STEP_GROUPS])}")
    return names


class Interrupted(BaseException):
    """SIGTERM reached the steps (e.g. the device call's time limit): not a step's own failure."""


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def run_steps(args) -> int:
    """Each step in turn, the report written after every one. A SIGTERM ends the running step (its training run
    killed), records it as interrupted, writes the report and returns 143 without running the rest."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run_steps(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_steps(args) -> int:
    out = Path(args.out)
    work = Path(args.work)
    job = Job(work=work, checkpoints=checkpoint_root(work), config=Path(args.config).resolve(),
              extra=tuple(args.extra.split()))
    report = {"commit": args.commit, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": device(), "config": str(job.config.relative_to(ROOT)), "extra_flags": list(job.extra),
              "steps": []}
    for name in step_names(args.steps):
        print(f"=== {name} {time.strftime('%H:%M:%S')}", flush=True)
        start = time.monotonic()
        interrupted = False
        try:
            result = STEPS[name](job)
        except Exception as exc:  # a step's crash is its failure; the others still run
            result = {"passed": False, "why": f"{type(exc).__name__}: {exc}"}
        except Interrupted as exc:
            interrupted = True
            result = {"passed": False, "why": f"interrupted by {exc} (the call's time limit?); later steps not run"}
        result = {"name": name, **result, "step_seconds": round(time.monotonic() - start, 1)}
        report["steps"].append(result)
        out.write_text(json.dumps(report, indent=1))  # after every step: nothing lost if the call is cut
        print(summary_line(name, result), flush=True)
        if interrupted:
            return 128 + signal.SIGTERM
    print("\n".join(summary_line(r["name"], r) for r in report["steps"]))
    return 0 if all(r.get("passed") is not False for r in report["steps"]) else 1


def merge(paths: list[str], out: str, mixed_commits: bool = False) -> int:
    """Join the JSON of several calls; a later call's step replaces an earlier one of the same name. Calls of
    different commits join only with ``mixed_commits`` (each step then names its commit; the top-level commit is
    the last call's), for a step left from an earlier commit whose change did not touch what it checks."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    commits = {r["commit"] for r in reports}
    if len(commits) != 1 and not mixed_commits:
        raise SystemExit(f"the calls ran different commits: {sorted(commits)} (--mixed-commits joins them)")
    merged = {**reports[-1], "steps": [], "calls": [{"date": r["date"], "device": r["device"], "commit": r["commit"],
                                                    "steps": [s["name"] for s in r["steps"]]} for r in reports]}
    for report in reports:
        merged["steps"] = [s for s in merged["steps"] if s["name"] not in {t["name"] for t in report["steps"]}]
        merged["steps"] += [{**s, "commit": report["commit"]} for s in report["steps"]]
    Path(out).write_text(json.dumps(merged, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="with 'merge' first: the JSON files to join")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--out", default="acceptance.json")
    parser.add_argument("--work", default="/tmp/acceptance", help="run directories (logs; checkpoints unless in tmpfs)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the training config (a CPU dry run: tiny.yaml)")
    parser.add_argument("--extra", default="", help="flags added to every launch/train.py run (a CPU dry run)")
    parser.add_argument("--commit", default=os.environ.get("ACCEPTANCE_COMMIT", "unknown"))
    parser.add_argument("--mixed-commits", action="store_true", help="with 'merge': join calls of different commits")
    args = parser.parse_args()
    if args.paths[:1] == ["merge"]:
        return merge(args.paths[1:], args.out, args.mixed_commits)
    return run_steps(args)


if __name__ == "__main__":
    sys.exit(main())
