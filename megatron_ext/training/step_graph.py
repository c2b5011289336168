"""A training step's forward and backward replayed from one CUDA graph (``cuda_graph_step``).

Why: on one GPU the all-techniques model at sequence 4096 is bound by the host's launch rate (about 3,000
launches a step against 1,000 for the base model; docs/e2e.md), so the host, not the GPU, sets the step time.
Captured once, the forward and backward of every microbatch are one graph launch.

What capture needs (:func:`check_step_graph` refuses the layouts that break it, naming the key):

* one process: the step's collectives would need care of their own (the EP all-to-all reads its split sizes
  on the host), so the key needs every parallel size 1;
* no host read and no host-to-device copy inside the step: the capacity routing without host reads (one GPU's
  default; ``moe_qb_host_reads: true`` is refused), the KDA chunk tables cached per shape in the warm-up;
* the same shapes every step: each step's microbatches are copied into the static buffers the graph reads, and
  a step whose microbatches differ in number, keys or shapes is refused.

The first ``warmup`` steps run eagerly (Triton compiles and autotunes, the shape caches fill); the next one
captures the step and replays it; later steps copy their inputs and replay. Warm-up and capture run on one side
stream, as torch's recipe for capturing a backward asks (autograd's nodes keep the stream they ran on), and the
allocator's cache is emptied before the capture, whose private pool then holds the step's activations (else the
warm-up's cached blocks and the pool would both stay reserved). Capture runs no kernel, so the
capturing step's numbers come from its replay. The optimizer step, the NaN guard's host read, the router-bias
update and logging stay outside the graph (they read the gradients and counters the replay leaves in place).
Layers that graph parts of themselves (the capacity routing's CUDA graphs) run those parts eagerly while a
capture is under way, so their kernels land in this graph.
"""

from __future__ import annotations

import time

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.moe.balancers import CAPACITY_BALANCERS
from megatron_ext.training.step import forward_backward

__all__ = ["StepGraph", "CudaStepGraph", "capture_stream", "check_step_graph"]


def check_step_graph(enabled: bool, model_cfg, world_size: int, cuda: bool) -> None:
    """Refuse ``cuda_graph_step: true`` where capture cannot work, naming the key."""
    if not enabled:
        return
    if not cuda:
        raise ConfigError("cuda_graph_step: true needs a CUDA GPU (CUDA graphs); this machine has none")
    if world_size != 1:
        raise ConfigError(f"cuda_graph_step: true runs on one process (world size 1), got world size {world_size}: "
                          "the step's collectives are not captured yet (--no-cuda-graph-step turns it off)")
    if getattr(model_cfg, "num_moe_experts", None) and not getattr(model_cfg, "bf16", False):
        raise ConfigError("cuda_graph_step: true needs bf16 with MoE layers (--bf16): the experts' grouped GEMM "
                          "takes bf16 on CUDA, and the fp32/fp16 per-expert loop reads token counts on the host, "
                          "which a capture cannot")
    if (getattr(model_cfg, "moe_qb_host_reads", None)
            and getattr(model_cfg, "moe_balancer", "none") in CAPACITY_BALANCERS):
        raise ConfigError("cuda_graph_step: true needs moe_qb_host_reads: false or null (a host read inside the "
                          "step cannot be captured)")


def capture_stream(enabled: bool):
    """The side stream a ``cuda_graph_step`` run builds its DDP on and captures on (``None`` when not enabled)."""
    return torch.cuda.Stream() if enabled else None


class CudaStepGraph:
    """One ``torch.cuda.CUDAGraph`` of a function, captured on ``stream``: :meth:`capture` records it (running no
    kernel) and returns its outputs, which every :meth:`replay` rewrites in place."""

    def __init__(self, stream):
        self.graph, self.stream = torch.cuda.CUDAGraph(), stream

    def capture(self, fn):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # thread_local: a data loader's pinning thread may use CUDA meanwhile; only this thread is captured
        with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
            outputs = fn()
        torch.cuda.synchronize()
        return outputs

    def replay(self) -> None:
        self.graph.replay()


class StepGraph:
    """``step(microbatches) -> loss`` (a 0-d device tensor, as ``forward_backward(..., read_loss=False)``): the
    forward and backward of ``chunks`` over ``microbatches`` (dicts of ``[b, s]`` tensors), eager for ``warmup``
    steps, then from one graph (``graph_type``: :class:`CudaStepGraph`; tests pass a stand-in). ``stream``: where
    warm-up and capture run; the stream the chunks' DDP was built on (``wrap_ddp(stream=...)``, see
    :func:`capture_stream`), else the backward's gradient accumulation waits on the default stream and the
    capture fails."""

    def __init__(self, chunks: list, seq_length: int, micro_batch_size: int, warmup: int = 2,
                 graph_type=CudaStepGraph, stream=None, log=None):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (an eager step fills the caches capture needs), got {warmup}")
        self.chunks, self.seq_length, self.micro_batch_size = chunks, seq_length, micro_batch_size
        self.warmup, self.graph_type = warmup, graph_type
        self.device = next(chunks[0].parameters()).device
        if stream is None and self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
        self.stream = stream
        self.static: list[dict] | None = None  # the inputs the graph reads
        self.graph = None
        self.loss: torch.Tensor | None = None  # the graph's output
        self.steps = 0
        self.log = log or (lambda message: None)

    def __call__(self, microbatches: list[dict]) -> torch.Tensor:
        self._load(microbatches)
        self.steps += 1
        if self.steps <= self.warmup:
            return self._on_side_stream(self._forward_backward)
        if self.graph is None:
            start = time.perf_counter()
            self.graph = self.graph_type(self.stream)
            self.loss = self.graph.capture(self._forward_backward)
            # the first steps ran eagerly and this one waited for the capture: say why the step time drops now
            self.log(f"> step graph: forward and backward of {len(microbatches)} microbatch(es) captured at step "
                     f"{self.steps} in {time.perf_counter() - start:.1f} s; replayed from here on")
        self.graph.replay()
        return self.loss.clone()  # the next replay rewrites self.loss

    def _on_side_stream(self, fn) -> torch.Tensor:
        if self.stream is None:
            return fn()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            loss = fn()
        current.wait_stream(self.stream)
        loss.record_stream(current)  # read on the current stream (the NaN check, logging)
        return loss

    def _forward_backward(self) -> torch.Tensor:
        return forward_backward(self.chunks, self.static, self.seq_length, self.micro_batch_size, read_loss=False)

    def _load(self, microbatches: list[dict]) -> None:
        """Copy ``microbatches`` into the static buffers (allocated by the first step)."""
        if self.static is None:
            self.static = [{key: value.to(self.device, copy=True) for key, value in batch.items()}
                           for batch in microbatches]
            return
        if len(microbatches) != len(self.static):
            raise ValueError(f"cuda_graph_step: this step has {len(microbatches)} microbatches, the captured step "
                             f"{len(self.static)}")
        for index, (batch, static) in enumerate(zip(microbatches, self.static)):
            if batch.keys() != static.keys():
                raise ValueError(f"cuda_graph_step: microbatch {index} has keys {sorted(batch)}, the captured step "
                                 f"{sorted(static)}")
            for key, value in batch.items():
                if value.shape != static[key].shape or value.dtype != static[key].dtype:
                    raise ValueError(f"cuda_graph_step: microbatch {index} {key!r} is {value.dtype} "
                                     f"{tuple(value.shape)}, the captured step's {static[key].dtype} "
                                     f"{tuple(static[key].shape)}")
                static[key].copy_(value, non_blocking=True)
