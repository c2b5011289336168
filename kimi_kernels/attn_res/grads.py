"""In-place gradient sums for depth sources read by many depth-attention calls.

Under Block AttnRes the embedding and every finished block sum are read by every later
sublayer's depth attention (up to 2 L + 1 calls). Left to autograd, each call returns one
gradient tensor per source and autograd adds them up: one extra read of two tensors and one
write per call and source, plus a gradient buffer per call kept alive meanwhile. With a
:class:`SourceGrad`, the calls' backwards instead add their contribution straight into one
buffer (the Triton kernel reads the old value and writes the sum; the first contribution in
backward order is a plain write), and the gradient reaches autograd once:

    tracked, source_grad = track_source_grad(block)   # identity in forward
    depth_attention([..., tracked, ...], w, gamma, source_grads=[..., source_grad, ...])

``tracked``'s backward (it runs after every consumer's backward, since they all read it)
returns the buffer, plus whatever gradient other consumers (a pipeline send, a sum) passed
through autograd. Calls that read ``tracked`` without naming its ``SourceGrad`` are ordinary
autograd consumers and still correct.
"""

from __future__ import annotations

import torch

__all__ = ["SourceGrad", "track_source_grad"]


def _graph_task() -> int:
    return torch._C._current_graph_task_id()


class SourceGrad:
    """The gradient of one source, summed in place over the backward pass that is running.

    A sum left over from another backward pass (one that never reached the source itself,
    e.g. ``torch.autograd.grad`` for parameters only with ``retain_graph=True``) is dropped,
    not added to.
    """

    __slots__ = ("_grad", "_task", "pending")

    def __init__(self):
        self._grad = None
        self._task = None
        self.pending = None  # a pair.DepthPair whose first call still owes this source a grad

    def current(self) -> torch.Tensor | None:
        """The sum so far in this backward pass, or ``None`` before the first contribution."""
        if self._grad is not None and self._task != _graph_task():
            self._grad = None
        return self._grad

    def set(self, grad: torch.Tensor) -> None:
        """Make ``grad`` (a tensor this object now owns) the sum so far."""
        self._grad = grad
        self._task = _graph_task()

    def add_(self, grad: torch.Tensor) -> None:
        """Add one contribution (for implementations that compute it as a separate tensor)."""
        current = self.current()
        if current is None:
            self.set(grad.clone() if grad._base is not None else grad)
        else:
            current.add_(grad)

    def take(self) -> torch.Tensor | None:
        if self.pending is not None and self.pending.pending_in_this_pass():
            raise RuntimeError(
                "a depth-attention call deferred its grad for this source to the call paired with it "
                "(kimi_kernels/attn_res/pair.py), whose backward has not run in this backward pass"
            )
        grad = self.current()
        self._grad = None
        return grad


class _TrackSource(torch.autograd.Function):
    """Identity; its backward hands on the in-place sum (plus any ordinary incoming grad)."""

    @staticmethod
    def forward(ctx, source, source_grad):
        ctx.source_grad = source_grad
        ctx.shape = source.shape
        ctx.set_materialize_grads(False)
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        summed = ctx.source_grad.take()
        if summed is None:
            return grad, None
        summed = summed.view(ctx.shape)
        if grad is not None:
            summed.add_(grad)
        return summed, None


def track_source_grad(source: torch.Tensor) -> tuple[torch.Tensor, SourceGrad]:
    """``(tracked, source_grad)``: pass ``tracked`` as the source and ``source_grad`` with it."""
    source_grad = SourceGrad()
    return _TrackSource.apply(source, source_grad), source_grad
