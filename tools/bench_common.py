"""Pieces the benchmark scripts share: process group, timing, reports.

* :func:`init_process_group` - one process (world 1) or torchrun's world; nccl on the GPU,
  gloo (with ``megatron_ext.cpu_compat``) on the CPU;
* :func:`init_expert_parallel` - Megatron's groups with EP = world size (TP = PP = 1) and seeds (torn down by
  ``megatron_ext.parallel.destroy_parallel`` in a process that builds them again);
* :func:`median_ms` - median time of a step over iterations after a warm-up, max over ranks;
  :func:`local_median_ms` the same in one process (kernel benchmarks), both timing each call with
  :func:`call_ms`;
* :func:`write_kernel_report` - the JSON a kernel benchmark writes (op, device, date, versions, rows);
  :func:`finish_run` writes a training benchmark's result and leaves the process group.

The training step the benchmarks time (synthetic batches, the step as training runs it, its timing): bench_training.py.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def init_process_group(cuda: bool) -> tuple[int, int]:
    """Join (or create) the default process group; return ``(rank, world_size)``."""
    if not cuda:
        from megatron_ext import cpu_compat

        cpu_compat.install()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a plain one-process run: any free port
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        dist.init_process_group("nccl" if cuda else "gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    return dist.get_rank(), dist.get_world_size()


def init_expert_parallel(seed: int = 1234) -> None:
    """Megatron's process groups with EP = world size, expert TP = 1, and every RNG seeded.

    Megatron's layers initialise under its model- and expert-parallel RNG streams, so those are
    seeded too (``model_parallel_cuda_manual_seed``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size(),
                                 expert_tensor_parallel_size=1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def this_rank_device() -> torch.device:
    """This rank's CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def median_ms(step: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Median wall time of ``step()`` in ms (CUDA events on the GPU), max over ranks.

    Ranks are aligned by a barrier before each timed call, so a rank never times its wait for a
    slower peer from the previous iteration."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(call_ms(step, device.type == "cuda"))
    return max_over_ranks(statistics.median(times), device)


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of all ranks (a collective: every rank calls it)."""
    worst = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


class RegionTimer:
    """Times each pass through ``with timer:`` without a host sync: CUDA events on the GPU (read only by
    :meth:`median_ms`, after the steps), ``perf_counter`` on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list = []  # (start, end) per pass: events or seconds
        self._start = None

    def __enter__(self):
        self._start = self._mark()
        return self

    def __exit__(self, *exc):
        self.marks.append((self._start, self._mark()))
        return False

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def clear(self) -> None:
        self.marks.clear()

    def median_ms(self) -> float:
        """Median ms of the passes since the last :meth:`clear` (waits for the last event on the GPU)."""
        if self.cuda:
            self.marks[-1][1].synchronize()
            return statistics.median(start.elapsed_time(end) for start, end in self.marks)
        return statistics.median(1000 * (end - start) for start, end in self.marks)


def call_ms(fn: Callable[[], object], cuda: bool) -> float:
    """One call of ``fn`` in ms: CUDA events around it on the GPU, wall clock otherwise."""
    return call_and_host_ms(fn, cuda)[0]


def call_and_host_ms(fn: Callable[[], object], cuda: bool) -> tuple[float, float]:
    """(:func:`call_ms`, the host's ms until ``fn`` returned). On the GPU a host time close to the call's
    means the host set the pace (the GPU waited for launches); well under it, the GPU did."""
    start_host = time.perf_counter()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        host_ms = 1000 * (time.perf_counter() - start_host)
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host_ms
    fn()
    host_ms = 1000 * (time.perf_counter() - start_host)
    return host_ms, host_ms


def local_median_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool) -> float:
    """Median of :func:`call_ms` over ``iters`` calls after ``warmup``, in this process only."""
    for _ in range(warmup):
        fn()
    return statistics.median(call_ms(fn, cuda) for _ in range(iters))


def write_kernel_report(path: str, op: str, cuda: bool, timing: str, results: list, **extra) -> None:
    """``{"op", "device", "date", "torch", "triton", "timing", "results", **extra}`` as JSON at ``path``."""
    import datetime
    import json
    from pathlib import Path

    import triton

    report = {
        "op": op,
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter, smoke)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "timing": timing, "results": results, **extra,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def finish_run(result: dict, out: str | None) -> None:
    """Write ``result`` as JSON at ``out`` (when given; parent folders made) and leave the process group."""
    import json
    from pathlib import Path

    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    if dist.is_initialized():
        dist.destroy_process_group()
