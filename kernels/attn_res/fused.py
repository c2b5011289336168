"""Fused Triton kernels for Block AttnRes depth attention (maths in ``naive.py``): their layout constants and
the forward's launcher here, the backward's launchers in ``backward.py``, the kernels in ``fwd_kernel.py``
(forward), ``preload_bwd.py`` (the default backward and the finish kernel) and ``stream_bwd.py`` (the
streaming backward).

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
# module, e.g. tools/bench_attnres_overhead.py stubs them, and the launchers resolve them here at call time).
from kernels.attn_res.fwd_kernel import _depth_attention_fwd_kernel
from kernels.attn_res.preload_bwd import _depth_attention_bwd_preload_kernel, _depth_attention_finish_kernel  # noqa: F401
from kernels.attn_res.stream_bwd import _depth_attention_bwd_kernel  # noqa: F401


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
# Sources whose row sums share one reduction (1, 2 or 4; fwd_kernel's BATCH), by the call's source count n: {from n:
# sources} (sources_per_reduction), or an int for every n. One cross-warp exchange and barrier for that many sources
# instead of one each: a program's per-token chain is latency-bound. H200 sweep (docs/attn_res.md, "Several sources
# per reduction"): the step's 17 forward calls 1.402 -> 1.258 ms at 4 (1.299 at 2); 4 costs registers (168 at n >= 8,
# three programs per SM instead of four) but no call width gained from 2 consistently.
FORWARD_SOURCES_PER_REDUCTION: int | dict[int, int] = 4
# A register cap for the forward (ptxas maxnreg; None: the compiler's choice), by width as above. H200 sweep, per call
# (docs/attn_res.md): 128 took the calls with 7 to 9 sources 11-20% faster (four programs per SM instead of three;
# offline, Triton 3.8, n = 9 spills 96 bytes, n = 8 none) and the narrower ones 0-10% slower: the step's 17 forward
# calls 1.258 ms uncapped, 1.203 capped everywhere, 1.189 with this table.
FORWARD_MAXNREG: int | None | dict[int, int | None] = {1: None, 7: 128}
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
# Preload kernel: sources whose row sums share one reduction, as FORWARD_SOURCES_PER_REDUCTION (1 in a pair's own pass,
# whose c shares source 0's reduction). H200 sweep, per call: 2 slowed the pair with 2 shared blocks (117 -> 125 us)
# and beat 4 at 3 and 4 sources, 4 won from 5 up (the widest pair 505 -> 325 us): the step's 17 backward calls
# 2.630 -> 2.299 ms with this table (2.382 with 2 for every n, 2.325 with 4).
BACKWARD_SOURCES_PER_REDUCTION: int | dict[int, int] = {1: 1, 3: 2, 5: 4}
# Preload kernel's tile loop as tl.range(num_stages=...) (Triton pipelines the loads as cp.async into shared
# memory: ~140 KB at n = 9, h = 2048 with 2 stages, so one program per SM; 3 stages do not fit); None: off.
BACKWARD_TILE_STAGES: int | None = None
# Preload kernel: hold the loaded 2-byte rows as int32 pairs (one register per two values; ptxas kept bf16 values
# one per 16-bit register and spilled them), where h is even and every such tensor 4-byte aligned.
BACKWARD_PACK_ROWS = True
# Preload kernel's own pass of a pair's second call (SUBSET, one source at the benchmark): a register cap (ptxas
# maxnreg) so that three programs fit an SM (Triton 3.6 on the H200 gave it two without: 74 -> 62 us a call; 128,
# four per SM, 58 us but 32 bytes spilled and more partial rows to sum; docs/attn_res.md); None: the compiler's choice.
BACKWARD_SUBSET_MAXNREG: int | None = 168
# 32 columns per finish program (64 programs at h = 2048): 0.28 vs 0.43 ms over the benchmark's 17 calls with
# 128 (tools/sweep_attnres_kernels.py), now that the 4-warp backward leaves two partial rows per SM.
FINISH_BLOCK, FINISH_BLOCK_P = 32, 16
_resident_programs: dict = {}
_backward_capacities: dict = {}  # (device, kernel specialisation, settings) -> programs per wave


def for_width(setting, n: int):
    """A per-call setting for a call with n sources: ``setting`` itself, or where it is a dict ``{from n: value}``
    the value of its largest key <= n (its smallest key's below that)."""
    if not isinstance(setting, dict):
        return setting
    return setting[max((k for k in setting if k <= n), default=min(setting))]


def sources_per_reduction(setting: int | dict[int, int], n: int) -> int:
    """The sources per row reduction of a call with n sources (``FORWARD_SOURCES_PER_REDUCTION`` or
    ``BACKWARD_SOURCES_PER_REDUCTION``, :func:`for_width`): 1, 2 or 4."""
    value = for_width(setting, n)
    if value not in (1, 2, 4):
        raise ValueError(f"sources per reduction must be 1, 2 or 4, got {value} (from {setting!r})")
    return value


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
                  NEXT_TILE=FORWARD_NEXT_TILE,
                  BATCH=sources_per_reduction(FORWARD_SOURCES_PER_REDUCTION, len(sources))
                  if (FORWARD_PRELOAD or FORWARD_NEXT_TILE) else 1)
    maxnreg = for_width(FORWARD_MAXNREG, len(sources))
    if maxnreg and out.device.type == "cuda":
        kwargs["maxnreg"] = maxnreg  # a compile option
    grid = (tiles,)
    if FORWARD_NEXT_TILE:  # persistent: one wave of programs, each walking tiles pid, pid + programs, ...
        grid = (max(1, min(tiles, _one_wave(out.device, _depth_attention_fwd_kernel, args, kwargs, cfg.num_warps))),)
    _depth_attention_fwd_kernel[grid](*args, num_warps=cfg.num_warps, **kwargs)
    return out, lse, normed, out_rstd
