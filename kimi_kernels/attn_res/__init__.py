"""Block AttnRes depth attention: the softmax-over-depth mix every sublayer's input comes from.

    out[t] = sum_i a_i[t] v_i[t],   a[t] = softmax_i( w . RMSNorm_gamma(v_i[t]) )

(DESIGN.md section 4; fp32 logits, one head, no scale; docs/attn_res.md has the details.)
With ``out_norm_weight`` the op returns ``RMSNorm(out)`` instead (the consumer's norm fused in:
the Triton kernels then never write or read a separate normalised pass).

Entry point: :func:`depth_attention`. Implementations:

* ``"triton"``: fused kernel (``fused.py``): one read of the sources in forward and one in
  backward; saves the inputs, its own output and ``(2 n + 1)`` fp32 numbers per token.
* ``"torch"``: plain-PyTorch maths (``naive.py``) behind a custom autograd.Function that saves
  only the inputs and recomputes everything in backward.

* ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise.

Sources read by many calls can have their gradients summed in place (``grads.py``:
``track_source_grad`` / ``SourceGrad``, the ``source_grads`` argument). Two calls sharing their
leading tracked sources can share one backward pass over them (``pair.py``: ``DepthPair``, the
``pair`` argument).
:func:`depth_attention_unchecked` is the same op without the input checks, for a caller that
checked once (the model's ``DepthMixer``): it saves the per-call host work.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kimi_kernels.attn_res.grads import SourceGrad, track_source_grad
from kimi_kernels.attn_res.pair import DepthPair
from kimi_kernels.attn_res.naive import (
    depth_attention_norm_reference,
    depth_attention_recompute,
    depth_attention_reference,
)

__all__ = [
    "depth_attention", "depth_attention_reference", "depth_attention_norm_reference",
    "track_source_grad", "SourceGrad", "DepthPair",
    "depth_attention_unchecked", "resolve_impl", "IMPLEMENTATIONS", "SUPPORTED_DTYPES",
]

IMPLEMENTATIONS = ("auto", "triton", "torch")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SOURCES = 64  # the kernel unrolls over n at compile time; the model uses n ~ 1..20
MAX_HIDDEN_TRITON = 32768  # the kernel keeps whole rows (h padded to a power of two) in registers


def depth_attention(
    sources: torch.Tensor | Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-6,
    impl: str = "auto",
    source_grads: Sequence[SourceGrad | None] | None = None,
    out_norm_weight: torch.Tensor | None = None,
    out_norm_eps: float = 1e-6,
    pair=None,
) -> torch.Tensor:
    """Softmax-weighted mix of n sources over depth, one weight per (token, source).

    Args:
        sources: either a sequence of n tensors ``[s, b, h]`` (embedding, finished block sums,
            partial sum: pass them as they are, nothing is stacked or copied), or one stacked
            tensor ``[n, s, b, h]``. Any leading token dims work (``[..., h]``); all sources
            share shape, dtype (bf16/fp16/fp32) and device. Non-contiguous sources are copied.
        query: the sublayer's pseudo-query ``w``, shape ``[h]`` (an fp32 parameter,
            initialised to zero so training starts from the uniform average).
        norm_weight: the RMSNorm weight ``gamma`` applied to the sources, shape ``[h]``.
        eps: RMSNorm epsilon.
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` (see module docstring).
        source_grads: optional, with a list of sources only: one :class:`SourceGrad` or
            ``None`` per source. A source given with a ``SourceGrad`` (from
            :func:`track_source_grad`) gets its gradient added into that one buffer in
            backward instead of returned to autograd (``grads.py``).
        out_norm_weight: optional ``[h]`` weight of an RMSNorm applied to the output (the
            consumer's norm, fused into the op): returns
            ``out * rsqrt(mean(out^2) + out_norm_eps) * out_norm_weight`` instead of ``out``.
        out_norm_eps: that norm's epsilon.
        pair: optional, with a list of sources only: ``DepthPair.first`` or ``.second`` of a
            :class:`DepthPair` linking this call with another that reads the same leading
            (tracked) sources; their backwards then read those sources once (``pair.py``).
            Ignored by the ``torch`` implementation.

    Returns:
        ``[s, b, h]`` (one source's shape) in the sources' dtype; accumulation is fp32.
        Gradients flow to every source, ``query``, ``norm_weight`` and ``out_norm_weight``
        (in their dtypes).
    """
    stacked, flat = _validate(sources, query, norm_weight, impl, out_norm_weight)
    if source_grads is not None:
        source_grads = tuple(source_grads)
        if stacked or len(source_grads) != len(flat):
            raise ValueError("source_grads needs a list of sources and one entry (SourceGrad or None) per source")
        if not all(g is None or isinstance(g, SourceGrad) for g in source_grads):
            raise ValueError("source_grads entries must be SourceGrad or None")
        if not any(g is not None for g in source_grads):
            source_grads = None
    impl = resolve_impl(impl, flat[0])
    eps, out_norm_eps = float(eps), float(out_norm_eps)
    if stacked:
        if impl == "triton":
            return _fused_function().apply(
                query, norm_weight, out_norm_weight, None, None, eps, out_norm_eps, True, None, None, flat[0]
            )
        return depth_attention_recompute(flat[0], query, norm_weight, eps, None, out_norm_weight, out_norm_eps)
    return depth_attention_unchecked(
        flat, query, norm_weight, eps, impl, source_grads, out_norm_weight, out_norm_eps, pair
    )


def depth_attention_unchecked(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    impl: str,
    source_grads: Sequence[SourceGrad | None] | None = None,
    out_norm_weight: torch.Tensor | None = None,
    out_norm_eps: float = 1e-6,
    pair=None,
) -> torch.Tensor:
    """:func:`depth_attention` without its checks, for callers that made them once.

    The caller guarantees what :func:`depth_attention` checks: ``sources`` a list of n
    contiguous tensors of one shape ``[..., h]``, dtype and device (1 <= n <= 64),
    ``query``/``norm_weight`` of shape ``[h]`` on that device, ``eps`` a float, ``impl`` already
    resolved by :func:`resolve_impl` (``"triton"`` or ``"torch"``) and ``source_grads`` ``None``
    or one ``SourceGrad``/``None`` per source, ``out_norm_weight`` ``None`` or ``[h]`` on that
    device, ``out_norm_eps`` a float. ``DepthMixer`` calls it after one checked call.
    """
    if impl == "triton":
        partner = (pair.pair.second_query, pair.pair.second_norm_weight) if pair is not None and pair.index == 0 else (
            None, None)
        return _fused_function().apply(
            query, norm_weight, out_norm_weight, *partner, eps, out_norm_eps, False, source_grads, pair, *sources
        )
    return depth_attention_recompute(sources, query, norm_weight, eps, source_grads, out_norm_weight, out_norm_eps)


def resolve_impl(impl: str, source: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for ``impl`` and a (checked) source; raises where the
    Triton kernel cannot run it."""
    if impl == "auto":
        return "triton" if source.is_cuda else "torch"
    if impl == "triton":
        if not source.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"impl='triton' needs CUDA tensors (got {source.device}) or TRITON_INTERPRET=1 set before "
                "triton is imported; use impl='torch' or 'auto' on the CPU"
            )
        if source.shape[-1] > MAX_HIDDEN_TRITON:
            raise ValueError(f"impl='triton' supports h <= {MAX_HIDDEN_TRITON}, got h={source.shape[-1]}")
    return impl


_FUSED = None


def _fused_function():
    global _FUSED
    if _FUSED is None:  # triton imported on first use
        from kimi_kernels.attn_res.function import FusedDepthAttention

        _FUSED = FusedDepthAttention
    return _FUSED


def _validate(sources, query, norm_weight, impl, out_norm_weight=None):
    """Returns (stacked, [the stacked tensor] or the n sources), each made contiguous."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2 or sources.shape[0] < 1:
            raise ValueError(
                f"sources as one tensor must be stacked [n, ..., h] with n >= 1, got shape {tuple(sources.shape)}"
            )
        members = [sources[0]]
    else:
        members = list(sources)
        if not members or not all(isinstance(t, torch.Tensor) for t in members):
            raise ValueError("sources must be a tensor [n, ..., h] or a non-empty sequence of tensors [..., h]")
    first = members[0]
    if first.dim() < 1:
        raise ValueError("each source must have a hidden dim: shape [..., h]")
    hidden = first.shape[-1]
    for idx, t in enumerate(members):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"sources[{idx}] is {tuple(t.shape)} {t.dtype} on {t.device}; all sources must match "
                f"sources[0] ({tuple(first.shape)} {first.dtype} on {first.device})"
            )
    if first.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"sources dtype must be one of {SUPPORTED_DTYPES}, got {first.dtype}")
    params = (("query", query), ("norm_weight", norm_weight), ("out_norm_weight", out_norm_weight))
    for name, param in params:
        if param is None and name == "out_norm_weight":
            continue
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{name} must be a tensor of shape [h] = [{hidden}]")
        if param.shape != (hidden,):
            raise ValueError(f"{name} must have shape [h] = [{hidden}], got {tuple(param.shape)}")
        if param.device != first.device:
            raise ValueError(f"{name} is on {param.device} but the sources are on {first.device}")
    if isinstance(sources, torch.Tensor):
        _check_source_count(sources.shape[0])
        return True, [sources.contiguous()]
    _check_source_count(len(members))
    return False, [t.contiguous() for t in members]


def _check_source_count(n: int) -> None:
    if not 1 <= n <= MAX_SOURCES:
        raise ValueError(f"number of sources must be in [1, {MAX_SOURCES}], got {n}")
