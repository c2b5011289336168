"""One backward pass over the sources two depth-attention calls share (``DepthPair``).

Under Block AttnRes the attention and the MLP sublayer of one layer mix the same finished
blocks: the MLP's sources are the attention's plus the partial sum that the attention sublayer
just produced. Their backwards run one after the other (MLP mixer, the attention sublayer, the
attention mixer), and each read every shared block and read-modify-wrote its in-place grad
(``grads.py``). Paired, the later-in-backward call does both:

* the second call's (the MLP mixer's) backward computes only the grads of its own sources that
  the first call does not read (the partial sum: it needs only that source, ``dy``, ``out`` and
  ``lse``; ``subset`` kernel) and its output-norm weight grad, and leaves what the shared blocks
  need in the link: the gradient of its mix (its output norm's backward done, rounded to the
  sources' dtype), that gradient's softmax sum ``c`` (fp32 per token; ``handoff``), its ``lse``,
  query and norm weights;
* the first call's (the attention mixer's) backward reads each shared block once and adds both
  calls' grads into its in-place grad in one store (``PAIRED`` kernel), and returns the second
  call's query and key-norm weight grads as well (the second mixer's parameters are inputs of the
  first call for that).

Per layer with m shared blocks (the second call's output saved in fp32: two units) this moves
``2 m + 9 + m_acc`` [T, h] tensors instead of ``4 m + 7 + 2 m_acc`` (m_acc: shared blocks whose grad
is accumulated, i.e. read back).

Pairing needs the shared sources tracked (``track_source_grad``: their grads never go through
autograd, so it does not matter which node writes them), the same key-norm ``eps`` and both calls
with the fused output norm (the second call's output is then saved in fp32, for a precise softmax
backward; ``function.py``); the Triton path only. Otherwise each call runs its
own backward as before. The second call's deferred mix gradient is kept from its backward until the
first call's (one layer's attention-sublayer backward): one ``[T, h]`` tensor more at peak.
If the first call's backward never ran in a backward pass in which the second call deferred, the
shared sources' grads would be incomplete: :class:`~kimi_kernels.attn_res.grads.SourceGrad` raises
when such a source's sum is taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kimi_kernels.attn_res.grads import SourceGrad, _graph_task

__all__ = ["DepthPair"]


class _Role:
    __slots__ = ("pair", "index")

    def __init__(self, pair: "DepthPair", index: int):
        self.pair, self.index = pair, index


class _Deferred:
    """The second call's backward inputs for the shared sources (``backward.PairedCall``), its ``g``
    over its other sources, which of its parameter grads are wanted, and the shared ``SourceGrad``s."""

    __slots__ = ("call", "g", "needs", "source_grads", "task")

    def __init__(self, call, g, needs, source_grads):
        self.call, self.g, self.needs, self.source_grads = call, g, needs, source_grads
        self.task = _graph_task()


class DepthPair:
    """Links two depth-attention calls for a shared backward: pass ``pair.first`` to the call that
    runs first in forward (the attention mixer) and ``pair.second`` to the one after it that reads
    the same leading sources (the MLP mixer). ``second_query`` / ``second_norm_weight`` are the
    second call's ``query`` and ``norm_weight``: the first call's backward returns their grads."""

    def __init__(self, second_query: torch.Tensor, second_norm_weight: torch.Tensor):
        self.second_query, self.second_norm_weight = second_query, second_norm_weight
        self.first, self.second = _Role(self, 0), _Role(self, 1)
        self._first_call = None  # (sources, source_grads, eps, norm_out) of the first call's forward
        self._deferred: _Deferred | None = None

    # -- forward ---------------------------------------------------------------------------
    def record_first(self, sources: Sequence[torch.Tensor], source_grads, eps: float, norm_out: bool) -> None:
        self._first_call = (tuple(sources), tuple(source_grads) if source_grads else None, eps, norm_out)

    def shared_count(self, sources: Sequence[torch.Tensor], source_grads, eps: float, norm_out: bool) -> int:
        """Leading sources the second call shares with the recorded first call (same tensors, the
        same ``SourceGrad`` on both); at most ``len(sources) - 1``. Forgets the first call."""
        first, self._first_call = self._first_call, None
        if first is None or source_grads is None or first[1] is None or first[2:] != (eps, norm_out):
            return 0
        count = 0
        for a, b, ga, gb in zip(first[0], sources, first[1], source_grads):
            if a is not b or ga is None or ga is not gb or count == len(sources) - 1:
                break
            count += 1
        return count

    # -- backward --------------------------------------------------------------------------
    def defer(self, call, g: torch.Tensor, needs: tuple[bool, bool], source_grads: Sequence[SourceGrad]) -> None:
        self._deferred = _Deferred(call, g, needs, tuple(source_grads))
        for source_grad in source_grads:
            source_grad.pending = self

    def take(self) -> _Deferred | None:
        """The second call's deferred work from this backward pass, or ``None``."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return None
        for source_grad in deferred.source_grads:
            source_grad.pending = None
        return deferred if deferred.task == _graph_task() else None

    def pending_in_this_pass(self) -> bool:
        return self._deferred is not None and self._deferred.task == _graph_task()
