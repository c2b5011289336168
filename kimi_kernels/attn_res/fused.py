"""Fused Triton kernels for Block AttnRes depth attention (maths in ``naive.py``): their launch tables
(:data:`FORWARD_LAUNCH`, :data:`BACKWARD_LAUNCH`) and the forward's launcher here, the backward's launchers in
``backward.py``, the kernels in ``fwd_kernel.py`` (forward) and ``preload_bwd.py`` (the backward and the finish
kernel that adds up its per-program partial sums).

Per token, with ``u = w * gamma`` and ``r_i = rsqrt(mean(v_i^2) + eps)``, the logit is
``logit_i = r_i * (v_i . u)``: the normalised keys are never formed, only dot products per
(token, source) over h, reduced together (one multi-operand reduction per source).

Forward (one program per tile of BLOCK_T tokens, full h in registers, h padded to a power of
two): stream the n sources once with an online softmax, rescaling an fp32 accumulator, so V
is read exactly once; writes ``out`` and ``lse [T]`` (fp32 log-sum-exp of the logits).

Backward (persistent grid of one wave, each program loops over token tiles; a tile's loads are all issued
before its first store), one pass over the sources: ``a_i = exp(logit_i - lse)``, per source ``v . v``,
``v . u`` and ``dout . v`` are reduced together, ``c = sum_i a_i (dout . v_i)`` is summed from them (where a
kernel sees only some of a call's sources, ``c = dout . out`` from the saved output, kept in fp32 for that:
docs/attn_res.md, "Precision of c") and

    dv_i = a_i dout + dlogit_i r_i (u - logit_i r_i v_i / h),   dlogit_i = a_i (dout . v_i - c)

is written, or added to the gradient already in the destination (``ACCUMULATE`` bit i): a
source read by several depth-attention calls gets its gradient summed in place in one buffer
(``grads.SourceGrad``) instead of one tensor per call added up by autograd. ``g = sum_tokens
sum_i dlogit_i r_i v_i`` is accumulated in fp32 registers; each program writes one row of it,
the rows are summed afterwards (two-stage, deterministic for a given device), and
``dw = g * gamma``, ``dgamma = g * w``.

Optional fused output norm (``NORM_OUT``; the sublayer's RMSNorm that consumes the mix): the
forward also writes ``normed = x * s * gamma_o`` with ``x`` the output rounded to its dtype (as
the separate norm would read it) and ``s = rsqrt(mean(x^2) + eps_o)`` (fp32 [T], saved). The
backward then receives ``dy = dL/dnormed`` and first runs the norm's backward on the row in
registers: with ``gy = dy * gamma_o`` and ``p = gy . x``,

    dout = s gy - (s^3 p / h) x,   c = dout . x = eps_o s^3 p   (as x . x = h (1/s^2 - eps_o)),

one reduction instead of two, and ``dgamma_o = sum_tokens dy * x * s`` (fp32 per-program rows,
summed afterwards); then the mix backward as above. ``out`` itself is still written (the norm
backward and ``c`` need it; recovering it from ``normed / gamma_o`` fails where gamma_o = 0).

HBM traffic per token, n sources of h elements: forward n reads + 1 write (+ 1 write with the
norm: ``normed``); backward n + 2 reads (sources, dout, out), n writes, plus one read per
accumulated source (the same with the norm: it reads dy instead of dout). The separate norm
read ``out`` and wrote ``normed`` in forward and read ``out`` and ``dy`` and wrote ``dout`` in
backward, besides the launches (PyTorch's ``rms_norm`` there is several elementwise kernels).

Sources and source gradients are passed as tuples of tensors (one pointer each, unrolled over
the constexpr n), so nothing is ever stacked.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from kimi_kernels.attn_res.fwd_kernel import _depth_attention_fwd_kernel
from kimi_kernels.attn_res.preload_bwd import _depth_attention_bwd_preload_kernel, _depth_attention_finish_kernel  # noqa: F401
from kimi_kernels.device import sm_count


@dataclass(frozen=True)
class ByWidth:
    """A launch choice by the call's source count n: ``steps`` are ``(from n, value)`` pairs in increasing n; a
    call with n sources takes the value of the last step whose n is <= n (the first step's below them all)."""

    steps: tuple[tuple[int, object], ...]

    def __post_init__(self):
        starts = [start for start, _ in self.steps]
        if not starts or starts != sorted(set(starts)):
            raise ValueError(f"ByWidth steps need increasing source counts, got {self.steps!r}")

    def __call__(self, n: int):
        value = self.steps[0][1]
        for start, step_value in self.steps:
            if start <= n:
                value = step_value
        return value


def _check_sources_per_reduction(table: ByWidth) -> None:
    for _, value in table.steps:
        if value not in (1, 2, 4):
            raise ValueError(f"sources per reduction must be 1, 2 or 4, got {value} (in {table!r})")


@dataclass(frozen=True)
class Launch:
    """One call's launch: tiles of BLOCK_T tokens by BLOCK_H (h padded to a power of two), its warps, the sources
    whose row sums share one reduction (the kernels' ``BATCH``) and a register cap (ptxas maxnreg; ``None``: the
    compiler's choice; applied on CUDA only)."""

    block_t: int
    block_h: int
    num_warps: int
    batch: int
    maxnreg: int | None


@dataclass(frozen=True)
class ForwardLaunch:
    """The forward's launch table (:data:`FORWARD_LAUNCH`): about ``tile_elements`` values per token tile (whole
    rows), ``values_per_thread`` per thread, and by the call's width the sources per row reduction and a register
    cap."""

    tile_elements: int
    values_per_thread: int
    sources_per_reduction: ByWidth
    maxnreg: ByWidth

    def __post_init__(self):
        _check_sources_per_reduction(self.sources_per_reduction)

    def for_call(self, hidden: int, n: int) -> Launch:
        tile = tile_shape(hidden, self.tile_elements, self.values_per_thread)
        return Launch(*tile, self.sources_per_reduction(n), self.maxnreg(n))


@dataclass(frozen=True)
class BackwardLaunch:
    """The backward's launch table (:data:`BACKWARD_LAUNCH`): the preload kernel's tile as the forward's, its sources
    per row reduction by width (1 in a pair's second call's own pass, ``handoff``: its ``c`` shares source 0's
    reduction), the register cap of that own pass (``subset``), and the finish kernel's columns and rows per
    step. The grid is always one wave (programs per SM from the compiled kernel's registers and shared memory)."""

    tile_elements: int
    values_per_thread: int
    sources_per_reduction: ByWidth
    subset_maxnreg: int | None
    finish_block: int
    finish_block_p: int

    def __post_init__(self):
        _check_sources_per_reduction(self.sources_per_reduction)

    def for_call(self, hidden: int, n: int, subset: bool = False, handoff: bool = False) -> Launch:
        tile = tile_shape(hidden, self.tile_elements, self.values_per_thread)
        return Launch(*tile, 1 if handoff else self.sources_per_reduction(n),
                      self.subset_maxnreg if subset else None)


@functools.lru_cache(maxsize=None)
def tile_shape(hidden: int, tile_elements: int, per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, warps) for about ``tile_elements`` values per tile (whole rows, at most 16) and about
    ``per_thread`` per thread (at most 16 warps). The unrolled source loop issues the n loads of a tile early (good
    for bandwidth), so registers grow with n x values per thread; tests/kernels/test_attn_res_compile.py bounds
    them (ptxas, sm_90) at n = 9 and h = 2048."""
    block_h = triton.next_power_of_2(hidden)
    block_t = max(1, min(16, tile_elements // block_h))
    num_warps = max(1, min(16, block_t * block_h // (32 * per_thread)))
    return block_t, block_h, num_warps


# The shipped launches, chosen by the H200 measurements in docs/bench/attnres-sweep-h200.json (per-call tables
# in docs/attn_res.md, "Launch tables"): one row over 4 warps (16 values per thread) in both directions; the
# forward reduces 4 sources at once at every width and caps registers at 128 from 7 sources up (four programs per
# SM instead of three; n = 9 spills 96 bytes and is faster all the same); the backward reduces 1 source at a time
# below 3 sources, 2 below 5, 4 from 5 up; a pair's second call's own pass is capped at 168 registers (three
# programs per SM); the finish kernel sums 32 columns by 16 partial rows per step.
FORWARD_LAUNCH = ForwardLaunch(tile_elements=2048, values_per_thread=16, sources_per_reduction=ByWidth(((1, 4),)),
                               maxnreg=ByWidth(((1, None), (7, 128))))
BACKWARD_LAUNCH = BackwardLaunch(tile_elements=2048, values_per_thread=16,
                                 sources_per_reduction=ByWidth(((1, 1), (3, 2), (5, 4))), subset_maxnreg=168,
                                 finish_block=32, finish_block_p=16)
_resident_programs: dict = {}
_backward_capacities: dict = {}  # (device, kernel specialisation, launch) -> programs per wave


def _programs_per_sm(kernel, args, kwargs, num_warps: int, device: torch.device) -> int:
    """Programs of ``kernel`` resident per SM, from its register count (sm_90: 64K registers,
    64 warps, 32 blocks per SM; registers are allocated per warp in units of 256) and its shared memory
    (1 KB more per block is reserved)."""
    key = (kernel, *kwargs.items(), num_warps, args[0][0].dtype, device)
    if key not in _resident_programs:
        try:
            compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps, **kwargs)
            compiled._init_handles()
            per_warp = -(-compiled.n_regs * 32 // 256) * 256
            warps = min(65536 // max(per_warp, 1), 64)
            shared = torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor
            by_shared = shared // (compiled.metadata.shared + 1024)
            _resident_programs[key] = max(1, min(warps // num_warps, 32, by_shared))
        except Exception:  # no register count (e.g. another backend): a conservative guess
            _resident_programs[key] = 2
    return _resident_programs[key]


def _one_wave(device: torch.device, kernel, args, kwargs, num_warps: int) -> int:
    """Programs of ``kernel`` that run at once (per SM from its registers and shared memory): the backward's
    persistent grid is ``min(tiles, one wave)`` (more programs than fit left a second, partial wave)."""
    if device.type != "cuda":
        return 2  # interpreter: still exercises the per-program loop
    per_sm = _programs_per_sm(kernel, args, kwargs, num_warps, device)
    return per_sm * sm_count(device)


def _packable(hidden: int, *tensors) -> bool:
    """Rows of h elements can be loaded as int32 pairs: h even and every 2-byte tensor 4-byte aligned.
    ``tensors``: tensors, sequences of them or ``None``."""
    flat = [t for group in tensors if group is not None
            for t in ((group,) if isinstance(group, torch.Tensor) else group)]
    return hidden % 2 == 0 and all(t.element_size() != 2 or t.data_ptr() % 4 == 0 for t in flat)


def _tokens(source: torch.Tensor) -> tuple[int, int]:
    """(T, h) of a contiguous ``[..., h]`` source: the kernels index it as ``[T, h]``."""
    hidden = source.shape[-1]
    return (source.numel() // hidden if hidden else 0), hidden


def fused_depth_attention_forward(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_norm_weight: torch.Tensor | None = None,
    out_norm_eps: float = 0.0,
    out_dtype: torch.dtype | None = None,
    launch: ForwardLaunch = FORWARD_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``sources``: n contiguous ``[..., h]`` tensors (T tokens); returns (``out`` of their shape
    and dtype (``out_dtype`` if given), ``lse [T]`` fp32, the log of the softmax normaliser, ``normed``,
    ``out_rstd``): with ``out_norm_weight`` also ``normed = RMSNorm(out)`` (the sources' shape and dtype) and
    its ``rstd [T]`` fp32; otherwise those two are ``None``. ``launch``: the launch table (the shipped one; tests
    pass others to reach several tiles per program)."""
    T, H = _tokens(sources[0])
    norm_out = out_norm_weight is not None
    out = torch.empty(sources[0].shape, dtype=out_dtype or sources[0].dtype, device=sources[0].device)
    lse = torch.empty(T, dtype=torch.float32, device=out.device)
    normed = torch.empty_like(sources[0]) if norm_out else None
    out_rstd = torch.empty(T, dtype=torch.float32, device=out.device) if norm_out else None
    if T == 0:
        return out, lse, normed, out_rstd
    cfg = launch.for_call(H, len(sources))
    args = (tuple(sources), query, norm_weight, out, lse,
            out_norm_weight if norm_out else norm_weight, normed if norm_out else out, out_rstd if norm_out else lse,
            T, H, eps, out_norm_eps)
    kwargs = dict(N=len(sources), BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, NORM_OUT=norm_out,
                  PACK=_packable(H, sources), BATCH=cfg.batch)
    if cfg.maxnreg and out.device.type == "cuda":
        kwargs["maxnreg"] = cfg.maxnreg  # a compile option
    _depth_attention_fwd_kernel[(-(-T // cfg.block_t),)](*args, num_warps=cfg.num_warps, **kwargs)
    return out, lse, normed, out_rstd
