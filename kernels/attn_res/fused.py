"""Fused Triton kernels for Block AttnRes depth attention (maths in ``naive.py``): their launchers and
layout constants here, the kernels in ``fwd_kernel.py`` (forward), ``preload_bwd.py`` (the default
backward and the finish kernel) and ``stream_bwd.py`` (the streaming backward).

Per token, with ``u = w * gamma`` and ``r_i = rsqrt(mean(v_i^2) + eps)``, the logit is
``logit_i = r_i * (v_i . u)``: the normalised keys are never formed, only dot products per
(token, source) over h, reduced together (one multi-operand reduction per source).

Forward (one program per tile of BLOCK_T tokens, full h in registers, h padded to a power of
two): stream the n sources once with an online softmax, rescaling an fp32 accumulator, so V
is read exactly once; writes ``out`` and ``lse [T]`` (fp32 log-sum-exp of the logits).

Backward (persistent grid of one wave, each program loops over token tiles), one pass over
the sources: ``c = sum_i a_i (dout . v_i) = dout . out`` comes from the saved output (the
sublayer's norm keeps that tensor alive anyway) and ``a_i = exp(logit_i - lse)``, so per
source ``v . v``, ``v . u`` and ``dout . v`` are reduced together and

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

# The kernels live in their own files; they stay reachable here by name (tools and tests look them up on this
# module, e.g. tools/bench_attnres_overhead.py stubs them, and the launchers below resolve them here).
from kernels.attn_res.fwd_kernel import _depth_attention_fwd_kernel
from kernels.attn_res.preload_bwd import _depth_attention_bwd_preload_kernel, _depth_attention_finish_kernel
from kernels.attn_res.stream_bwd import _depth_attention_bwd_kernel


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one program: BLOCK_T tokens by BLOCK_H (h padded to a power of two)."""

    block_t: int
    block_h: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def launch_config(hidden: int, tile_elements: int, per_thread: int = 8) -> LaunchConfig:
    """About ``tile_elements`` values per tile (whole rows), about ``per_thread`` per thread
    (at most 16 warps).

    The unrolled source loop issues the n loads of a tile early (good for bandwidth), so
    registers grow with n x elements per thread; tests/kernels/test_attn_res_compile.py checks
    that ptxas (sm_90) reports no spills at n = 9 and h = 2048.
    """
    block_h = triton.next_power_of_2(hidden)
    block_t = max(1, min(16, tile_elements // block_h))
    num_warps = max(1, min(16, block_t * block_h // (32 * per_thread)))
    return LaunchConfig(block_t, block_h, num_warps)


def backward_launch_config(hidden: int, norm_out: bool) -> LaunchConfig:
    """The backward's tile. With the fused output norm, fewer values per thread: at n = 9,
    h = 2048 (ptxas sm_90) the norm's extra per-thread row vectors took the 8-per-thread kernel
    from 119 to 150 registers (one 8-warp program per SM instead of two); at 4 per thread
    (16 warps) it needs 90, i.e. the same 16 warps per SM as the kernel without the norm."""
    per_thread = BACKWARD_NORM_VALUES_PER_THREAD if norm_out else 8
    return launch_config(hidden, BACKWARD_TILE_ELEMENTS, per_thread)


# Tile sizes (elements per token tile), read at call time so the benchmark can sweep them.
FORWARD_TILE_ELEMENTS = 2048
BACKWARD_TILE_ELEMENTS = 2048
# Backward programs per SM; None: as many as fit at once (from the compiled kernel's registers),
# so the persistent grid is exactly one wave (more programs than fit left a second, partial wave).
BACKWARD_PROGRAMS_PER_SM: int | None = None
# Layouts from tools/sweep_attnres_kernels.py (docs/bench/attnres-sweep-h200.json): one row over 4 warps (16 values
# per thread) beat 8 and 16 warps in both directions; the per-source row reductions cross fewer warps.
FORWARD_VALUES_PER_THREAD = 16
FORWARD_PRELOAD = True  # issue the n source loads before the first row reduction
FORWARD_FUSE_REDUCTIONS = True  # v.v and v.u as one two-operand reduction (one barrier, not two)
# Forward variants (swept by tools/sweep_attnres_kernels.py; offline sm_90 registers there). PACK_ROWS (default): the
# sources' 2-byte rows loaded and held as int32 pairs (as BACKWARD_PACK_ROWS; where h is even and the sources 4-byte
# aligned); bit-identical results. At the default layout it saves no registers (ptxas already keeps the one-tile
# kernel's loaded words packed, 128 either way at n = 9), but it takes the spills out of the 32-values-per-thread
# layouts and it is what makes NEXT_TILE fit: a persistent grid (one wave, from the compiled kernel's registers)
# whose programs walk the tiles with the next tile's rows in flight while this one is mixed; 1: source i's loaded
# right after this tile's source i is unpacked (into the registers it frees), 2: all n at the tile's top. Those
# rows are loop-carried: unpacked, ptxas holds them one bf16 per register (n = 9, 8 values per thread, NEXT_TILE 2:
# 166 registers packed 128).
FORWARD_PACK_ROWS = True
FORWARD_NEXT_TILE = 0
BACKWARD_FUSE_REDUCTIONS = True  # v.v, v.u, dout.v as one three-operand reduction
BACKWARD_PREFETCH = True  # load source i + 1 before computing (and storing) source i
BACKWARD_NORM_VALUES_PER_THREAD = 4  # backward with the fused output norm (backward_launch_config)
# Which backward kernel: "preload" (a tile's loads before its stores, see BACKWARD_RELOAD; needed for the
# paired / subset backward) or "stream" (the earlier one: one source prefetched ahead). A two-pass backward (per-token
# scalars, then a streaming grad pass) was measured slower and removed (docs/attn_res.md, "Backward, two passes").
BACKWARD_KERNEL = "preload"
# 4 warps at h = 2048 with RELOAD: two programs per SM (n = 9 with the norm: 255 registers, ~48 bytes spilled to
# L1); 16 warps (4 values) took 128 registers for one program per SM and ~20% longer over the benchmark's calls.
BACKWARD_PRELOAD_VALUES_PER_THREAD = 16
# Preload kernel: reload each source (an L2 hit: the tile was just read) and load its old grad next to its
# store instead of holding both in registers from the top: fewer registers (without it 16 values per thread
# spill ~840 bytes).
BACKWARD_RELOAD = True
# Preload kernel, overlap of loads with compute/stores (bits; docstring of preload_bwd's kernel; swept by
# tools/sweep_attnres_kernels.py): 1, each old grad loaded right after its source's reductions instead of next
# to its store; 2, the next tile's rows loaded into the registers this tile frees (cross-tile prefetch); 4, each
# source reloaded one source ahead in the grad pass. 1 with BACKWARD_PACK_ROWS (the default since 2026-12-02): the
# step's 17 backward calls 3.63 -> 3.01 ms in the H200 sweep, 3.32 -> 2.91 ms in the model's profile (docs/attn_res.md,
# "Layout variants").
BACKWARD_PIPELINE = 1
# Preload kernel's tile loop as tl.range(num_stages=...) (Triton pipelines the loads as cp.async into shared
# memory: ~140 KB at n = 9, h = 2048 with 2 stages, so one program per SM; 3 stages do not fit); None: off.
BACKWARD_TILE_STAGES: int | None = None
# Preload kernel: hold the loaded 2-byte rows as int32 pairs (one register per two values; ptxas kept bf16 values
# one per 16-bit register and spilled them), where h is even and every such tensor 4-byte aligned.
BACKWARD_PACK_ROWS = True
_resident_programs: dict = {}
_PROMOTE_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)
_backward_capacities: dict = {}  # (device, kernel specialisation, settings) -> programs per wave


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


def _one_wave(device: torch.device, kernel, args, kwargs, num_warps: int, per_sm: int | None = None) -> int:
    """Programs of ``kernel`` that run at once (``per_sm`` per SM, else from its registers and shared memory);
    a persistent grid (the backward, the forward's NEXT_TILE) is ``min(tiles, one wave)``."""
    if device.type != "cuda":
        return 2  # interpreter: still exercises the per-program loop
    per_sm = per_sm or _programs_per_sm(kernel, args, kwargs, num_warps, device)
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def _packable(hidden: int, *tensors) -> bool:
    """Rows of h elements can be loaded as int32 pairs: h even and every 2-byte tensor 4-byte aligned."""
    flat = [t for group in tensors if group is not None
            for t in ((group.out, group.grad_out) if isinstance(group, PairedCall) else
                      group if isinstance(group, (list, tuple)) else (group,))]
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``sources``: n contiguous ``[..., h]`` tensors (T tokens); returns (``out`` of their shape
    and dtype (``out_dtype`` if given), ``lse [T]`` fp32, the log of the softmax normaliser, ``normed``,
    ``out_rstd``): with ``out_norm_weight`` also ``normed = RMSNorm(out)`` (the sources' shape and dtype) and
    its ``rstd [T]`` fp32; otherwise those two are ``None``."""
    T, H = _tokens(sources[0])
    norm_out = out_norm_weight is not None
    out = torch.empty(sources[0].shape, dtype=out_dtype or sources[0].dtype, device=sources[0].device)
    lse = torch.empty(T, dtype=torch.float32, device=out.device)
    normed = torch.empty_like(sources[0]) if norm_out else None
    out_rstd = torch.empty(T, dtype=torch.float32, device=out.device) if norm_out else None
    if T == 0:
        return out, lse, normed, out_rstd
    cfg = launch_config(H, FORWARD_TILE_ELEMENTS, FORWARD_VALUES_PER_THREAD)
    tiles = -(-T // cfg.block_t)
    args = (tuple(sources), query, norm_weight, out, lse,
            out_norm_weight if norm_out else norm_weight, normed if norm_out else out, out_rstd if norm_out else lse,
            T, H, eps, out_norm_eps)
    kwargs = dict(N=len(sources), BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, FUSE_REDUCTIONS=FORWARD_FUSE_REDUCTIONS,
                  NORM_OUT=norm_out, PRELOAD=FORWARD_PRELOAD, PACK=FORWARD_PACK_ROWS and _packable(H, sources),
                  NEXT_TILE=FORWARD_NEXT_TILE)
    grid = (tiles,)
    if FORWARD_NEXT_TILE:  # persistent: one wave of programs, each walking tiles pid, pid + programs, ...
        grid = (max(1, min(tiles, _one_wave(out.device, _depth_attention_fwd_kernel, args, kwargs, cfg.num_warps))),)
    _depth_attention_fwd_kernel[grid](*args, num_warps=cfg.num_warps, **kwargs)
    return out, lse, normed, out_rstd


@dataclass(frozen=True)
class PairedCall:
    """A second depth-attention call whose first ``count`` sources are the first ``count``
    sources of the call being differentiated (same tensors, same key-norm ``eps``, both with or
    both without the fused output norm): its backward inputs. The paired backward adds its
    gradient for those sources in the same pass (``_depth_attention_bwd_preload_kernel``,
    ``PAIRED``)."""

    count: int
    query: torch.Tensor
    norm_weight: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor
    lse: torch.Tensor
    out_norm_weight: torch.Tensor | None
    out_rstd: torch.Tensor | None
    out_norm_eps: float


@dataclass
class BackwardSums:
    """fp32 ``[h]`` sums of one backward launch: ``g`` (this call's ``sum dlogit r v``; ``dw = g
    gamma``, ``dgamma = g w``), ``g_out_norm`` (``dgamma_o``, with the fused norm) and ``g2`` (the
    paired call's ``g`` over the shared sources). With ``parameter_grads`` the finish kernel wrote
    the grads themselves instead (``grad_query``, ``grad_norm_weight``, ``grad_out_norm_weight``, each
    in its parameter's dtype) and ``g`` / ``g_out_norm`` are ``None``."""

    g: torch.Tensor | None
    g_out_norm: torch.Tensor | None = None
    g2: torch.Tensor | None = None
    grad_query: torch.Tensor | None = None
    grad_norm_weight: torch.Tensor | None = None
    grad_out_norm_weight: torch.Tensor | None = None


# 32 columns per finish program (64 programs at h = 2048): 0.28 vs 0.43 ms over the benchmark's 17 calls with
# 128 (tools/sweep_attnres_kernels.py), now that the 4-warp backward leaves two partial rows per SM.
FINISH_BLOCK, FINISH_BLOCK_P = 32, 16


def fused_depth_attention_backward_sums(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_sources: Sequence[torch.Tensor],
    accumulate: Sequence[bool],
    out_norm_weight: torch.Tensor | None = None,
    out_norm_eps: float = 0.0,
    out_rstd: torch.Tensor | None = None,
    need_out_norm_weight: bool = False,
    subset: bool = False,
    paired: PairedCall | None = None,
    parameter_grads: bool = False,
) -> BackwardSums:
    """Writes (or, where ``accumulate[i]``, adds) each source's grad into ``grad_sources[i]``
    (contiguous, the sources' shape) and returns the fp32 sums (:class:`BackwardSums`). With
    ``out_norm_weight`` (and the forward's ``out_rstd``), ``grad_out`` is the grad of ``normed =
    RMSNorm(out)``. ``subset``: ``sources`` are only some of the call's sources (its ``lse``
    covers all). ``paired``: also the gradient of a second call for the first ``paired.count``
    sources (added into the same grads; its ``g`` over them in ``g2``). ``subset`` and
    ``paired`` need the preload kernel (``BACKWARD_KERNEL``). ``parameter_grads`` (preload kernel, neither
    ``subset`` nor ``paired``): return the parameters' grads in their dtypes, computed by the finish
    kernel, instead of the fp32 sums."""
    T, H = _tokens(sources[0])
    norm_out = out_norm_weight is not None
    device = grad_out.device
    preload = BACKWARD_KERNEL == "preload"
    if (subset or paired is not None) and not preload:
        raise ValueError("subset / paired backward needs fused.BACKWARD_KERNEL = 'preload'")
    if paired is not None and (paired.out_norm_weight is not None) != norm_out:
        raise ValueError("a paired call must have the fused output norm iff this call has it")
    if parameter_grads and (subset or paired is not None or not preload):
        raise ValueError("parameter_grads needs the preload kernel and neither subset nor paired")
    rows = 1 + (norm_out and need_out_norm_weight) + (paired is not None)
    if T == 0:
        zero = torch.zeros(H, dtype=torch.float32, device=device)
        sums = BackwardSums(zero, zero if norm_out else None, zero if paired is not None else None)
        return _as_parameter_grads(sums, query, norm_weight, out_norm_weight) if parameter_grads else sums
    mask = 0
    for i, flag in enumerate(accumulate):
        if flag:
            mask |= 1 << i
    n = len(sources)
    if preload:
        kernel = _depth_attention_bwd_preload_kernel
        cfg = launch_config(H, BACKWARD_TILE_ELEMENTS, BACKWARD_PRELOAD_VALUES_PER_THREAD)
        kwargs = dict(N=n, ACCUMULATE=mask, BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, NORM_OUT=norm_out,
                      SUBSET=subset, PAIRED=0 if paired is None else paired.count,
                      OUT_NORM_GRAD=norm_out and need_out_norm_weight, RELOAD=BACKWARD_RELOAD,
                      PIPELINE=BACKWARD_PIPELINE, STAGES=BACKWARD_TILE_STAGES,
                      PACK=BACKWARD_PACK_ROWS and _packable(H, sources, grad_sources, out, grad_out, paired))
    else:
        kernel = _depth_attention_bwd_kernel
        cfg = backward_launch_config(H, norm_out)
        kwargs = dict(N=n, ACCUMULATE=mask, BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h,
                      FUSE_REDUCTIONS=BACKWARD_FUSE_REDUCTIONS, PREFETCH=BACKWARD_PREFETCH, NORM_OUT=norm_out)
    key = (device, kernel, *kwargs.values(), cfg, sources[0].dtype, out.dtype,
           None if paired is None else paired.out.dtype, BACKWARD_PROGRAMS_PER_SM)
    capacity = _backward_capacities.get(key)
    programs = max(1, min(-(-T // cfg.block_t), capacity or 1))
    # One fp32 buffer for every per-program partial-sum array, [rows, programs, h]: g, then
    # g_out_norm (if computed), then g2 (if paired); the stream kernel always writes g_out_norm.
    rows_alloc = rows if preload else 1 + norm_out
    while True:
        partial = torch.empty((rows_alloc, programs, H), dtype=torch.float32, device=device)
        row_g_out_norm = partial[1] if (norm_out and (need_out_norm_weight or not preload)) else partial[0]
        if preload:
            p2 = paired
            pointers = (
                query if p2 is None else p2.query, norm_weight if p2 is None else p2.norm_weight,
                out if p2 is None else p2.out, grad_out if p2 is None else p2.grad_out, lse if p2 is None else p2.lse,
                (out_norm_weight if norm_out else norm_weight) if p2 is None or not norm_out else p2.out_norm_weight,
                (out_rstd if norm_out else lse) if p2 is None or not norm_out else p2.out_rstd,
                partial[rows - 1] if p2 is not None else partial[0],
            )
            args = [tuple(sources), tuple(grad_sources), query, norm_weight, out, grad_out, lse, partial[0],
                    out_norm_weight if norm_out else norm_weight, out_rstd if norm_out else lse, row_g_out_norm,
                    *pointers, T, H, eps, out_norm_eps, out_norm_eps if p2 is None else p2.out_norm_eps]
        else:
            args = [tuple(sources), tuple(grad_sources), query, norm_weight, out, grad_out, lse, partial[0],
                    out_norm_weight if norm_out else norm_weight, out_rstd if norm_out else lse, row_g_out_norm,
                    T, H, eps, out_norm_eps]
        if capacity is not None:
            break
        # First call with this key: compile, read the register count, size the grid from it.
        capacity = _backward_capacities[key] = _one_wave(device, kernel, args, kwargs, cfg.num_warps,
                                                          BACKWARD_PROGRAMS_PER_SM)
        programs = max(1, min(-(-T // cfg.block_t), capacity))
    kernel[(programs,)](*args, num_warps=cfg.num_warps, **kwargs)
    if not preload:
        sums = partial.sum(dim=1)
        return BackwardSums(sums[0], sums[1] if norm_out else None)
    return _finish_sums(partial, paired is not None, parameter_grads, query, norm_weight, out_norm_weight)


def _finish_sums(partial: torch.Tensor, paired: bool, parameter_grads: bool, query: torch.Tensor,
                norm_weight: torch.Tensor, out_norm_weight: torch.Tensor | None) -> BackwardSums:
    """Adds up a backward's per-program partial rows, ``partial [rows, programs, h]`` fp32 (``g``, then
    ``g_out_norm`` if there are more rows than ``1 + paired``, then ``g2`` if ``paired``), in one launch of the
    finish kernel; with ``parameter_grads`` it writes the parameters' grads instead (:class:`BackwardSums`)."""
    rows, programs, H = partial.shape
    device = partial.device
    grid = (-(-H // FINISH_BLOCK),)
    if parameter_grads:
        grad_query, grad_norm_weight = torch.empty_like(query), torch.empty_like(norm_weight)
        grad_out_norm = torch.empty_like(out_norm_weight) if rows > 1 else grad_query
        _depth_attention_finish_kernel[grid](
            partial, partial, query, norm_weight, grad_query, grad_norm_weight, grad_out_norm, H, P=programs,
            ROWS=rows, BLOCK_P=FINISH_BLOCK_P, BLOCK=FINISH_BLOCK, PARAMETER_GRADS=True, num_warps=4)
        return BackwardSums(None, grad_query=grad_query, grad_norm_weight=grad_norm_weight,
                            grad_out_norm_weight=grad_out_norm if rows > 1 else None)
    sums = torch.empty((rows, H), dtype=torch.float32, device=device)
    _depth_attention_finish_kernel[grid](
        partial, sums, query, norm_weight, partial, partial, partial, H, P=programs,
        ROWS=rows, BLOCK_P=FINISH_BLOCK_P, BLOCK=FINISH_BLOCK, PARAMETER_GRADS=False, num_warps=4)
    return BackwardSums(sums[0], sums[1] if rows - paired > 1 else None, sums[rows - 1] if paired else None)


def _as_parameter_grads(sums: BackwardSums, query, norm_weight, out_norm_weight) -> BackwardSums:
    """The parameter grads from fp32 sums (the ``parameter_grads`` result where no kernel ran)."""
    grad_query, grad_norm_weight = parameter_grads(sums.g, query, norm_weight)
    grad_out_norm = (sums.g_out_norm.to(out_norm_weight.dtype)
                     if sums.g_out_norm is not None and out_norm_weight is not None else None)
    return BackwardSums(None, grad_query=grad_query, grad_norm_weight=grad_norm_weight,
                        grad_out_norm_weight=grad_out_norm)


def fused_depth_attention_backward(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_sources: Sequence[torch.Tensor],
    accumulate: Sequence[bool],
    need_query: bool = True,
    need_norm_weight: bool = True,
    out_norm_weight: torch.Tensor | None = None,
    out_norm_eps: float = 0.0,
    out_rstd: torch.Tensor | None = None,
    need_out_norm_weight: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Writes (or, where ``accumulate[i]``, adds) each source's grad into ``grad_sources[i]``
    (contiguous, the sources' shape); returns (grad query, grad norm_weight, grad
    out_norm_weight), ``None`` where not needed. With ``out_norm_weight`` (and the forward's
    ``out_rstd``), ``grad_out`` is the grad of ``normed = RMSNorm(out)``."""
    in_kernel = BACKWARD_KERNEL == "preload"
    sums = fused_depth_attention_backward_sums(
        sources, query, norm_weight, eps, out, lse, grad_out, grad_sources, accumulate, out_norm_weight,
        out_norm_eps, out_rstd, need_out_norm_weight, parameter_grads=in_kernel,
    )
    if not in_kernel:
        sums = _as_parameter_grads(sums, query, norm_weight, out_norm_weight if need_out_norm_weight else None)
    return (sums.grad_query if need_query else None, sums.grad_norm_weight if need_norm_weight else None,
            sums.grad_out_norm_weight if out_norm_weight is not None and need_out_norm_weight else None)


def parameter_grads(g, query, norm_weight, need_query=True, need_norm_weight=True):
    """(grad query, grad norm_weight) = (g gamma, g w) from the fp32 sum ``g``, each in its
    parameter's dtype (``None`` where not needed)."""
    # g is fp32; an fp32 x (fp32, bf16 or fp16) product is computed in fp32 (type promotion),
    # as with an explicit .float(); cast only where the parameter is not fp32.
    return (
        _product(g, norm_weight, query.dtype) if need_query else None,
        _product(g, query, norm_weight.dtype) if need_norm_weight else None,
    )


def _product(g: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    product = g * (other if other.dtype in _PROMOTE_TO_FP32 else other.float())
    return product if product.dtype == dtype else product.to(dtype)
