"""The training step the benchmarks time, as ``launch/train.py`` runs it.

* :func:`synthetic_batch` - one random-token microbatch in the ``megatron_ext.data`` format;
* :func:`build_training_state` - chunks -> Megatron DDP -> Megatron AdamW (our fast step or Megatron's own);
* :func:`training_step_fn` - one step: zero the grads, forward + backward, the update, after-step hooks;
* :func:`time_training_step` - its median time, the optimizer's share and peak memory, everything freed
  afterwards; :func:`time_interleaved_training_steps` the step times of several models timed in alternating
  rounds;
* :func:`free_device_memory`, :func:`device_memory_left`, :func:`drop_dispatcher_graphs` - what a row leaves.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from tools.bench_common import RegionTimer, call_and_host_ms, max_over_ranks, median_ms, this_rank_device


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
