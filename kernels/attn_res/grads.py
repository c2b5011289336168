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

__all__ = ["SourceGrad", "track_source_grad", "add_to_tracked"]


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

    def deposit(self, grad: torch.Tensor) -> None:
        """Add one contribution computed elsewhere; the first one is taken as the sum itself, without a copy
        (later contributions are then added into ``grad`` in place: the caller must not read it afterwards)."""
        current = self.current()
        if current is None:
            self.set(grad if grad.is_contiguous() else grad.contiguous())
        else:
            current.add_(grad)

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
                "(kernels/attn_res/pair.py), whose backward has not run in this backward pass"
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


class _AddToTracked(torch.autograd.Function):
    """``tracked + output``; the backward deposits the sum's grad into ``tracked``'s :class:`SourceGrad`
    instead of returning it to autograd, and returns the same tensor as ``output``'s grad."""

    @staticmethod
    def forward(ctx, tracked, output, source_grad):
        ctx.source_grad = source_grad
        ctx.set_materialize_grads(False)
        return tracked + output

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.source_grad.deposit(grad)
        return None, grad, None


def add_to_tracked(tracked: torch.Tensor, source_grad: SourceGrad, output: torch.Tensor) -> torch.Tensor:
    """``tracked + output`` for a tracked source whose other readers sum their grads into ``source_grad``.

    Under Block AttnRes a partial sum is read by one depth mix and then added to the next sublayer's
    output. Left to autograd, the mix's backward writes its grad for the partial sum and autograd adds the
    sum's grad to it (one more read of two tensors and a write). The sum's backward runs first (the mix
    feeds the sublayer whose output is added), so here it hands its grad to ``source_grad`` and the mix's
    kernel adds into that buffer as it writes (``grads.py`` module docstring). That buffer is also
    ``output``'s grad: the mix's backward, which writes into it, runs after the sublayer's, which reads it.
    """
    return _AddToTracked.apply(tracked, output, source_grad)


def track_source_grad(source: torch.Tensor) -> tuple[torch.Tensor, SourceGrad]:
    """``(tracked, source_grad)``: pass ``tracked`` as the source and ``source_grad`` with it."""
    source_grad = SourceGrad()
    return _TrackSource.apply(source, source_grad), source_grad
