"""Pieces the benchmark scripts share: process group, timing, synthetic batches, a training step.

* :func:`init_process_group` - one process (world 1) or torchrun's world; nccl on the GPU,
  gloo (with ``megatron_ext.cpu_compat``) on the CPU;
* :func:`init_expert_parallel` - Megatron's groups with EP = world size (TP = PP = 1) and seeds (torn down by
  ``megatron_ext.parallel.destroy_parallel`` in a process that builds them again);
* :func:`median_ms` - median time of a step over iterations after a warm-up, max over ranks;
  :func:`local_median_ms` the same in one process (kernel benchmarks), both timing each call with
  :func:`call_ms`;
* :func:`write_kernel_report` - the JSON a kernel benchmark writes (op, device, date, versions, rows);
  :func:`finish_run` writes a training benchmark's result and leaves the process group;
* :func:`synthetic_batch` - one random-token microbatch in the ``megatron_ext.data`` format;
* :func:`time_training_step` - forward + backward (Megatron schedule) + AdamW of a model built by
  a callable: median step time and peak memory, everything freed afterwards;
  :func:`time_interleaved_training_steps` the step times of several models timed in alternating rounds.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import statistics
import time
import weakref
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


def synthetic_batch(vocab_size: int, seq: int, micro_batch: int, device, seed: int = 0) -> dict:
    """One microbatch of uniform random tokens: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, vocab_size, (micro_batch, seq + 1), generator=g)
    return {
        "tokens": window[:, :-1].contiguous().to(device),
        "labels": window[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(micro_batch, seq, device=device),
        "position_ids": torch.arange(seq, device=device).expand(micro_batch, seq).contiguous(),
    }


def free_device_memory(device: torch.device) -> None:
    """Drop unreachable tensors and the caching allocator's free blocks; reset the peak counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def device_memory_left(device: torch.device) -> dict | None:
    """What a finished row leaves on the GPU, in GB: the process's device memory in use and the caching allocator's
    share of it. Their difference (CUDA context, library workspaces, graph executables, communicators) should not
    grow from row to row; None off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"device_used_gb": (total - free) / 1e9, "torch_reserved_gb": torch.cuda.memory_reserved(device) / 1e9}


def drop_dispatcher_graphs(chunks: list) -> None:
    """Clear the ``probs`` Megatron's token dispatchers keep from the last forward, autograd graph included.

    That graph reaches the DDP gradient hooks, whose closures hold the model: a cycle through C++ autograd nodes
    that Python's collector cannot free, so without this every stock row kept its model, gradients and optimizer
    state until the process ended (the 2026-12-06 H200 call: the third stock row of a ``--repeat`` ran out of
    memory)."""
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if getattr(dispatcher, "probs", None) is not None:
                dispatcher.probs = None


def training_step_fn(chunks: list, optimizer, vocab_size: int, seq: int, micro_batch: int,
                     after_step: Callable[[list], None] | None = None, profiler=None,
                     optimizer_timer: RegionTimer | None = None, nan_guard: bool = False,
                     graph_stream=None) -> Callable[[], None]:
    """One training step of built chunks on a fixed synthetic microbatch (this rank's own tokens: under EP
    every rank routes a different batch, as in training): zero the grads, forward + backward through
    Megatron's schedule, ``optimizer.step()`` (inside ``optimizer_timer`` when given), ``after_step(chunks)``,
    ``profiler.step()``. ``nan_guard``: the update goes through training's ``NonFiniteGuard`` (launch/train.py's
    default ``check_for_nan_in_loss_and_grad``: one host read of the loss and the grad norm before the update).
    ``graph_stream``: the forward and backward through training's ``StepGraph`` on that stream, the one the chunks'
    DDP was built on (``cuda_graph_step``: two eager steps, then captured and replayed; the warm-up must cover
    three steps); None: eager."""
    from megatron.core import parallel_state as ps

    from megatron_ext.training.nonfinite_guard import NonFiniteGuard
    from megatron_ext.training.step import forward_backward
    from megatron_ext.training.step_graph import StepGraph

    model_device = next(chunks[0].parameters()).device
    batch = [synthetic_batch(vocab_size, seq, micro_batch, model_device, seed=dist.get_rank())]
    timed_update = optimizer_timer if optimizer_timer is not None else contextlib.nullcontext()
    guard = NonFiniteGuard(optimizer, loss_group=ps.get_pipeline_model_parallel_group()) if nan_guard else None
    graphed = StepGraph(chunks, seq, micro_batch, stream=graph_stream) if graph_stream is not None else None

    def step():
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        # as launch/train.py: the loss stays on the device (the guard reads it with the grad norm)
        loss = graphed(batch) if graphed else forward_backward(chunks, batch, seq, micro_batch, read_loss=False)
        with timed_update:
            if guard is None:
                optimizer.step()
            else:
                applied, _ = guard.step(loss)
                if not applied:
                    raise RuntimeError(f"non-finite loss or grad norm in a benchmark step: loss {guard.last_loss}, "
                                       f"grad norm {guard.last_grad_norm}")
        if after_step is not None:
            after_step(chunks)
        if profiler is not None:
            profiler.step()

    return step


def _scoped(step: Callable[[], None], scope: Callable) -> Callable[[], None]:
    def run() -> None:
        with scope():
            step()
    return run


def time_interleaved_training_steps(models: dict[str, tuple], vocab_size: int,
                                    seq: int, micro_batch: int, warmup: int, rounds: int,
                                    steps_per_round: int, manual_gc: bool = True) -> dict:
    """Step times of several models resident at once, timed in alternating rounds (one process, one rank).

    Models built by ``models[name] = (build_chunks, config)`` all stay on the device (a third element, a
    context-manager factory, is entered around each of that model's steps: e.g. a kernel layout); after ``warmup`` steps
    each, every round times ``steps_per_round`` steps of each model, the order reversed every other round,
    so that a drift of the machine (clocks, the host's load) falls on every model alike. Returns
    ``{name: {"step_ms": median of all its steps, "host_ms": median host time of a step (until ``step()``
    returned), "round_ms": [median per round]}}`` plus
    ``"ratio_median"``: ``{name: median over rounds of its round median / the first model's}``."""
    from megatron_ext.training.manual_gc import manual_gc as manual_gc_scope

    device = this_rank_device()
    free_device_memory(device)
    steps = {}
    for name, (build_chunks, config, *scope) in models.items():
        chunks, optimizer = build_training_state(build_chunks, config, micro_batches_per_step=1)
        step = training_step_fn(chunks, optimizer, vocab_size, seq, micro_batch)
        steps[name] = _scoped(step, scope[0]) if scope else step
    times: dict[str, list[list[float]]] = {name: [] for name in steps}
    host_times: dict[str, list[float]] = {name: [] for name in steps}
    try:
        with manual_gc_scope(manual_gc, 0):
            for step in steps.values():
                for _ in range(warmup):
                    step()
            for r in range(rounds):
                for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
                    pairs = [call_and_host_ms(steps[name], device.type == "cuda") for _ in range(steps_per_round)]
                    times[name].append([ms for ms, _ in pairs])
                    host_times[name].extend(host for _, host in pairs)
    finally:
        del steps
        free_device_memory(device)
    first = next(iter(times))
    result: dict = {name: {"step_ms": statistics.median(t for one_round in per_round for t in one_round),
                           "host_ms": statistics.median(host_times[name]),
                           "round_ms": [statistics.median(one_round) for one_round in per_round]}
                    for name, per_round in times.items()}
    result["ratio_median"] = {
        name: statistics.median(a / b for a, b in zip(result[name]["round_ms"], result[first]["round_ms"]))
        for name in times}
    return result


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def build_training_state(build_chunks: Callable[[], list], config, fast_step: bool = True,
                         main_grad_dtype: str = "fp32", micro_batches_per_step: int = 1, stream=None):
    """Model chunks (``Float16Module`` under bf16) -> Megatron DDP -> Megatron AdamW (``fast_step``: see
    ``megatron_ext.parallel.build_optimizer`` and ``wrap_ddp(fresh_main_grads=...)``; ``False``: what
    Megatron-Core does without TE/Apex). ``main_grad_dtype``: ``wrap_ddp``'s (fp32 | bf16 | auto), with
    ``micro_batches_per_step`` (the benchmarks run one); ``stream``: ``wrap_ddp``'s (a step graph's stream)."""
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.parallel import build_optimizer, wrap_ddp

    chunks = build_chunks()
    if config.bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    chunks = wrap_ddp(chunks, config, fresh_main_grads=fast_step, main_grad_dtype=main_grad_dtype,
                      micro_batches_per_step=micro_batches_per_step, stream=stream)
    optimizer = build_optimizer(chunks, lr=1e-4, bf16=config.bf16, fast_step=fast_step)
    return chunks, optimizer


def time_training_step(build_chunks: Callable[[], list], config, vocab_size: int, seq: int,
                       micro_batch: int, warmup: int, steps: int, after_step: Callable[[list], None] | None = None,
                       profiler=None, fast_step: bool = True, main_grad_dtype: str = "fp32",
                       manual_gc: bool = True, counters=None, nan_guard: bool = False,
                       step_graph: bool = False) -> dict:
    """Median ms of one training step and of the ``optimizer.step()`` inside it (``optimizer_ms``: the same timed
    steps, a :class:`RegionTimer` around the update, read after the steps; both max over ranks), the peak
    memory (GB) of this rank and the gradient buffer's dtype
    (``main_grad_dtype``, e.g. ``"bf16"``: what ``main_grad_dtype``, see ``build_training_state``, resolved to;
    fp32 models always have fp32 gradients).

    A step is: zero the grads, forward + backward of one microbatch through Megatron's schedule,
    ``optimizer.step()``, then ``after_step(chunks)`` (e.g. router-bias updates). The peak
    counts weights, gradients, AdamW state and activations; it is reset before the model is built,
    and the model and optimizer are freed before returning (``model_freed``: whether they were).
    ``profiler`` (a started ``torch.profiler.profile``) is stepped after each timed step when given.
    ``manual_gc``: Python's collector off during the steps, as in training (``megatron_ext/training/manual_gc.py``,
    interval 0 here: no collection inside the timed window); False leaves the automatic collector on.
    ``counters``: an object with ``reset(chunks)``, called after the warm-up, and ``read(chunks) -> dict``, called
    after the timed steps (outside the timed region); its dict joins the result (e.g. dropped pairs summed over
    the timed steps).
    ``nan_guard``, ``step_graph``: as training steps (:func:`training_step_fn`); with ``step_graph`` at least three
    warm-up steps (two eager, one capture), else the timed steps would include them.
    """
    from megatron_ext.training.manual_gc import manual_gc as manual_gc_scope
    from megatron_ext.training.step_graph import capture_stream

    device = this_rank_device()
    free_device_memory(device)
    graph_stream = capture_stream(step_graph)
    chunks, optimizer = build_training_state(build_chunks, config, fast_step, main_grad_dtype,
                                             micro_batches_per_step=1, stream=graph_stream)
    grad_dtype = next(p.main_grad.dtype for c in chunks for p in c.parameters() if hasattr(p, "main_grad"))
    model_device = next(chunks[0].parameters()).device
    optimizer_timer = RegionTimer(model_device.type == "cuda")
    if step_graph and warmup < 3:
        raise ValueError(f"step_graph needs at least 3 warm-up steps (two eager, one capture), got {warmup}")
    step = training_step_fn(chunks, optimizer, vocab_size, seq, micro_batch, after_step, profiler, optimizer_timer,
                            nan_guard, graph_stream)

    try:
        with manual_gc_scope(manual_gc, 0):
            for _ in range(warmup):
                step()
            if counters is not None:
                counters.reset(chunks)
            optimizer_timer.clear()
            ms = median_ms(step, 0, steps, model_device)
        optimizer_ms = max_over_ranks(optimizer_timer.median_ms(), model_device)
        counted = counters.read(chunks) if counters is not None else {}
        peak = torch.cuda.max_memory_allocated() / 2**30 if model_device.type == "cuda" else 0.0
    finally:
        drop_dispatcher_graphs(chunks)
        model_ref = weakref.ref(chunks[0])
        del chunks, optimizer, step
        free_device_memory(model_device)
    return {"step_ms": ms, "optimizer_ms": optimizer_ms, "peak_gb": peak,
            "main_grad_dtype": DTYPE_NAMES.get(grad_dtype, str(grad_dtype)), "model_freed": model_ref() is None,
            **counted}
