"""Training logs: a Megatron-style progress line, TensorBoard scalars, and ``metrics.jsonl``.

TensorBoard tags follow Megatron-LM's ``training_log``: ``lm loss``, ``learning-rate``,
``grad-norm``, ``batch-size``, ``iteration-time`` (seconds), ``throughput`` (TFLOP/s/GPU),
each scalar also ``<tag> vs samples`` against consumed samples; validation writes
``lm loss validation`` and ``lm loss validation ppl``. Extra scalars (e.g. ``moe/maxvio``)
are written under their own names. ``metrics.jsonl`` gets one JSON object per logged
iteration (``iteration``, ``consumed_samples``, ``lm_loss``, ``lr``, ``grad_norm``,
``tokens_per_sec``, ``iteration_time_ms``, ``mfu``, ``mem_gb`` plus the extras), flushed and
fsynced line by line so a crash loses nothing already logged.

Create one ``MetricsLogger`` per process; pass ``enabled=False`` on ranks that should not
write (Megatron logs from the last rank, which holds the loss under pipeline parallelism).
A run resumed from a checkpoint passes its iteration and consumed samples: what was logged
after them is removed first (``metrics_rewind``), so the iterations run again appear once.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from typing import Optional

import numpy as np
import torch

# Per-iteration scalars: (metrics.jsonl key, TensorBoard tag).
_SCALAR_TAGS = (
    ("lm_loss", "lm loss"),
    ("lr", "learning-rate"),
    ("grad_norm", "grad-norm"),
    ("batch_size", "batch-size"),
    ("iteration_time_s", "iteration-time"),
    ("tflops_per_gpu", "throughput"),
    ("tokens_per_sec", "tokens-per-sec"),
    ("mem_gb", "mem-max-allocated-gigabytes"),
)


def mfu(flops_per_token: float, tokens_per_sec: float, peak_tflops: float, num_gpus: int = 1) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved model FLOP/s over ``num_gpus`` x peak.

    ``flops_per_token`` counts forward + backward (about 6 x parameters + attention terms).
    """
    if peak_tflops <= 0 or num_gpus <= 0:
        raise ValueError(f"peak_tflops and num_gpus must be > 0, got {peak_tflops}, {num_gpus}")
    return flops_per_token * tokens_per_sec / (peak_tflops * 1e12 * num_gpus)


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated on this device, or this process's peak RSS on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform != "darwin" else kb / 2**30


def format_progress_line(iteration: int, train_iters: int, metrics: dict) -> str:
    """`` iteration       10/     100 | consumed samples: ... | ...`` like Megatron-LM."""
    parts = [f" iteration {iteration:8d}/{train_iters:8d}"]
    fields = (
        ("consumed_samples", "consumed samples", "{:12d}"),
        ("iteration_time_ms", "elapsed time per iteration (ms)", "{:.1f}"),
        ("lr", "learning rate", "{:.3E}"),
        ("batch_size", "global batch size", "{:5d}"),
        ("lm_loss", "lm loss", "{:.6E}"),
        ("grad_norm", "grad norm", "{:.3f}"),
        ("tokens_per_sec", "tokens/s", "{:.0f}"),
    )
    for key, label, fmt in fields:
        if metrics.get(key) is not None:
            parts.append(f" {label}: {fmt.format(metrics[key])}")
    if metrics.get("mfu") is not None:
        parts.append(f" MFU: {100 * metrics['mfu']:.1f}%")
    if metrics.get("mem_gb") is not None:
        parts.append(f" mem: {metrics['mem_gb']:.2f} GB")
    return " |".join(parts) + " |"


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


class MetricsLogger:
    """Progress lines, TensorBoard and ``metrics.jsonl`` for one training run."""

    def __init__(self, train_iters: int, tensorboard_dir: Optional[str] = None,
                 metrics_dir: Optional[str] = None, enabled: bool = True, print_fn=print,
                 resumed_iteration: Optional[int] = None, resumed_samples: Optional[int] = None):
        self.train_iters = train_iters
        self.enabled = enabled
        self.print_fn = print_fn
        self.writer = None
        self._jsonl = None
        if not enabled:
            return
        if resumed_iteration is not None:
            from megatron_ext.training.metrics_rewind import rewind_metrics_jsonl, rewind_tensorboard

            if tensorboard_dir is not None and os.path.isdir(tensorboard_dir):
                rewind_tensorboard(tensorboard_dir, resumed_iteration, resumed_samples or 0)
            if metrics_dir is not None:
                rewind_metrics_jsonl(os.path.join(metrics_dir, "metrics.jsonl"), resumed_iteration)
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)
        if metrics_dir is not None:
            os.makedirs(metrics_dir, exist_ok=True)
            self._jsonl = open(os.path.join(metrics_dir, "metrics.jsonl"), "a", buffering=1)

    def log_iteration(self, iteration: int, *, consumed_samples: int, lm_loss: float, lr: float,
                      grad_norm: Optional[float], batch_size: int, iteration_time_s: float,
                      tokens_per_sec: float, flops_per_token: Optional[float] = None,
                      peak_tflops: Optional[float] = None, num_gpus: int = 1,
                      extra: Optional[dict] = None) -> dict:
        """Log one iteration (averages over the log interval are the caller's choice).

        MFU and ``throughput`` need ``flops_per_token``; MFU also ``peak_tflops`` (GPU only:
        pass None on the CPU). ``extra`` scalars go to TensorBoard and jsonl under their keys.
        Returns the record written to ``metrics.jsonl``.
        """
        record = {
            "iteration": iteration, "consumed_samples": consumed_samples,
            "lm_loss": _plain(lm_loss), "lr": _plain(lr), "grad_norm": _plain(grad_norm),
            "batch_size": batch_size, "iteration_time_s": iteration_time_s,
            "iteration_time_ms": 1000.0 * iteration_time_s, "tokens_per_sec": tokens_per_sec,
            "tflops_per_gpu": (None if flops_per_token is None
                               else flops_per_token * tokens_per_sec / 1e12 / num_gpus),
            "mfu": (None if flops_per_token is None or peak_tflops is None
                    else mfu(flops_per_token, tokens_per_sec, peak_tflops, num_gpus)),
            "mem_gb": peak_memory_gb(),
        }
        for key, value in (extra or {}).items():
            record[key] = _plain(value)
        if not self.enabled:
            return record
        self.print_fn(format_progress_line(iteration, self.train_iters, record))
        if self.writer is not None:
            for key, tag in _SCALAR_TAGS:
                if record.get(key) is not None:
                    self.writer.add_scalar(tag, record[key], iteration)
                    self.writer.add_scalar(f"{tag} vs samples", record[key], consumed_samples)
            for key in extra or {}:
                if isinstance(record[key], (int, float)):
                    self.writer.add_scalar(key, record[key], iteration)
        self._write_jsonl(record)
        return record

    def log_validation(self, iteration: int, lm_loss: float, consumed_samples: int) -> None:
        """Validation loss and perplexity (line, TensorBoard, jsonl with ``split: valid``)."""
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, lm_loss))
        self.print_fn(f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
                      f"lm loss PPL: {ppl:.6E} |")
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", lm_loss, iteration)
            self.writer.add_scalar("lm loss validation vs samples", lm_loss, consumed_samples)
            self.writer.add_scalar("lm loss validation ppl", ppl, iteration)
        self._write_jsonl({"iteration": iteration, "split": "valid", "lm_loss": lm_loss, "ppl": ppl})

    def add_histogram(self, tag: str, values, iteration: int, bins="auto") -> None:
        """E.g. tokens received per expert on this rank."""
        if self.writer is not None:
            self.writer.add_histogram(tag, torch.as_tensor(_plain(values)), iteration, bins=bins)

    def add_scalar(self, tag: str, value: float, iteration: int) -> None:
        """A scalar outside ``log_iteration`` (e.g. a rank's own expert load in its per-rank run)."""
        if self.writer is not None:
            self.writer.add_scalar(tag, _plain(value), iteration)

    def add_bar_histogram(self, tag: str, heights, iteration: int) -> None:
        """Heights ``[n]`` as a histogram with one unit-wide bucket per index ``0 .. n-1`` (e.g.
        tokens per expert id): the HISTOGRAMS tab draws them as bars over the index, and the event
        keeps the exact heights (``bucket``) for tools that read it back."""
        if self.writer is None:
            return
        h = np.asarray(_plain(heights), dtype=np.float64)
        x = np.arange(h.size, dtype=np.float64)
        self.writer.add_histogram_raw(tag, min=-0.5, max=h.size - 0.5, num=float(h.sum()), sum=float((x * h).sum()),
                                      sum_squares=float((x * x * h).sum()), bucket_limits=x + 0.5,
                                      bucket_counts=h, global_step=iteration)

    def add_image(self, tag: str, image, iteration: int, dataformats: str = "HWC") -> None:
        """An image array (uint8 or float in [0, 1]), e.g. ``megatron_ext.moe.load_figures``' rendered figure."""
        if self.writer is not None:
            self.writer.add_image(tag, np.asarray(image), iteration, dataformats=dataformats)

    def _write_jsonl(self, record: dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
