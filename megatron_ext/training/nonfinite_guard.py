"""Skip an optimizer step whose loss or grad norm is NaN or infinite, before it is applied.

Megatron's optimizers skip a step only when a grad scaler (fp16) reports inf/nan; in bf16 and fp32
a NaN gradient goes straight into the weights and Adam's moments, and every later step and checkpoint
is NaN. ``NonFiniteGuard`` sits inside Megatron's ``step``: it takes the grad norm Megatron computes
anyway (for clipping; the same value on every rank) and, before the update (``step_with_ready_grads``),
reads it and the step's loss to the host; when either is not finite it returns "not applied", as
Megatron's own found-inf path does, so weights, moments and the Adam step count stay as they were.

Cost: one host read of two numbers per step, which waits for the backward to finish; the host can
no longer queue the optimizer step while the backward runs, so its launch time shows on the GPU (on
one H200 with configs/h200.yaml no difference beyond the run-to-run spread: docs/training.md). An optimizer
with a ``prepare_step_with_ready_grads`` (the fused AdamW step, ``megatron_ext.speed_patches``) does its host
work for the update before the read, so only the launches remain after it. Under pipeline parallelism, where only the last
stage holds the loss, one more all-reduce of two numbers over the pipeline group brings the decision
and the loss to every stage.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist


class NonFiniteGuard:
    """Wraps ``optimizer`` (a Megatron optimizer, chained or not) once; use ``step(loss)`` in place of
    ``optimizer.step()``. ``loss_group``: the ranks over which the holders of the loss share it (the
    pipeline group); None or a one-rank group when every rank holds it."""

    def __init__(self, optimizer, loss_group=None, enabled: bool = True, max_skipped: int = 0):
        self.optimizer = optimizer
        self.enabled = enabled
        self.max_skipped = max_skipped
        self.skipped = 0
        self.loss_group = loss_group if loss_group is not None and dist.get_world_size(loss_group) > 1 else None
        self.last_loss: Optional[float] = None  # the values of the last skipped step
        self.last_grad_norm: Optional[float] = None
        self._loss = None
        self._grad_norm = None
        if not enabled:
            return
        # Megatron's step computes the norm in get_grad_norm (chained) or clip_grad_norm (one optimizer,
        # clip_grad > 0), then calls step_with_ready_grads: instance attributes shadow the methods.
        for name in ("get_grad_norm", "clip_grad_norm"):
            if hasattr(optimizer, name):
                setattr(optimizer, name, self._recording_norm(getattr(optimizer, name)))
        self._apply_update = optimizer.step_with_ready_grads
        optimizer.step_with_ready_grads = self._step_if_finite

    def _recording_norm(self, compute):
        def record(*args, **kwargs):
            self._grad_norm = compute(*args, **kwargs)
            return self._grad_norm

        return record

    def step(self, loss: Optional[torch.Tensor]):
        """``optimizer.step()`` for a step whose loss is ``loss`` (None on ranks without it). Returns
        ``(applied, grad_norm)``; when not applied, ``last_loss`` / ``last_grad_norm`` hold the values."""
        self._loss, self._grad_norm = loss, None
        try:
            applied, grad_norm, _ = self.optimizer.step()
        finally:
            self._loss = None
        return applied, grad_norm

    def _step_if_finite(self) -> bool:
        norm = self._grad_norm if self._grad_norm is not None else self.optimizer.get_grad_norm()
        device = norm.device if isinstance(norm, torch.Tensor) else torch.device("cpu")
        holds_loss = self._loss is not None
        values = torch.stack([_as_tensor(norm, device), _as_tensor(self._loss if holds_loss else 0.0, device)])
        if self.loss_group is not None:
            # The last stage sends (norm, loss), the others zeros: every stage ends with the last stage's
            # values (the norm is the same on all of them).
            values = values if holds_loss else torch.zeros_like(values)
            dist.all_reduce(values, group=self.loss_group)
        prepare = getattr(self.optimizer, "prepare_step_with_ready_grads", None)
        if prepare is not None:  # the update's host work (the fused AdamW step's lists) while the device computes
            prepare()
        grad_norm, loss = values.tolist()  # the one host read
        if math.isfinite(grad_norm) and math.isfinite(loss):
            return self._apply_update()
        self.last_grad_norm, self.last_loss = grad_norm, loss
        return False

    def count_skipped_step(self, iteration: int, last_saved: Optional[int]) -> str:
        """Count a step ``step`` did not apply and return the line to log; past ``max_skipped`` raise
        ``TooManySkippedSteps`` instead (``last_saved``: the iteration of the last checkpoint, for the message)."""
        self.skipped += 1
        values = f"iteration {iteration}: lm loss {self.last_loss}, grad norm {self.last_grad_norm}"
        if self.skipped > self.max_skipped:
            kept = (f"the last checkpoint, of iteration {last_saved}, is as it was" if last_saved is not None
                    else "no checkpoint saved in this run")
            raise TooManySkippedSteps(f"{values}; stopping after {self.skipped} skipped step(s) "
                                      f"(max_skipped_nonfinite_steps {self.max_skipped}); {kept}")
        return (f"> {values}; the update was not applied ({self.skipped} skipped, "
                f"max_skipped_nonfinite_steps {self.max_skipped})")


def _as_tensor(value, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, torch.float32).reshape(())
    return torch.tensor(float(value), device=device)


class TooManySkippedSteps(RuntimeError):
    """More steps were skipped than ``max_skipped_nonfinite_steps`` allows."""
