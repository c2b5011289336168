"""Two-level state walks, for few sequence-heads (opt-in: ``chunk.STATE_SEGMENTS``, ``chunk.STATE_BWD_SEGMENTS``).

The one-level walk (``state.state_fwd_kernel``) runs one program per (V tile, sequence, head) through all of
a sequence's chunks in order. At the end-to-end layer's shape (B1 T16384 H16) that is 32-64 programs on 132
SMs, each ~256 chunk steps long, and each step is latency-bound (~3.5 us on an H200): the walk is the
longest kernel of the forward. Per chunk the walk is affine in the state,

    S_next = M_c S + B_c,   M_c = diag(exp(Gl)) - kgl^T w,   B_c = kgl^T u0,

so a sequence splits into ``segments`` runs of chunks walked in parallel:

1. every segment walks from S = 0 and, in K more columns, from S = I with ``u0 = 0`` (the same kernel over
   V + K columns): column block ``[:V]`` gives the segment-local states and ``u``, block ``[V:]`` the products
   ``X_c = M_{c-1} ... M_first`` and ``u^I_c = -w_c X_c``; the walk's final state gives the segment's ``E``
   (local end state) and ``X_end``;
2. in segment order, ``start_{g+1} = X_end_g start_g + E_g`` from the sequence's initial state (fp32, a few
   small batched matmuls);
3. in parallel over chunks (:func:`correct_kernel`): ``S_c = S_c^local + X_c start``, ``u_c = u_c^local +
   u^I_c start``.

The same states and ``u`` up to rounding (each segment's local and identity parts are stored in the walk's
dtype, as the one-level walk stores its states), so the output kernel and the backward are unchanged. A
sequence with fewer chunks than ``segments`` gets empty segments: their walk stores its initial [0 | I],
i.e. ``E = 0``, ``X_end = I``, an identity step. Cost: twice the walked columns (V + K instead of V) over
``segments`` times shorter chains, a [T, H, V + K] copy of ``u0`` and the correction (2 T H K V + chunks H
2 K^2 V FLOPs). The backward's reverse walk (``dS_prev = M_c^T dS + B'_c``, storing ``dS`` and ``du``) is split
the same way (:func:`state_bwd_two_level`), its segments chained from the last one.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.kda.state import load_chunk, state_bwd_kernel, state_fwd_kernel, state_offsets, store_chunk

# The correction's tiles: X_c [K, K] and the start state [K, BV] in fp32 registers. At K = 128, ptxas (sm_90):
# 180 registers and no spills at BV 64 over 8 warps; 4 warps spill 120 bytes at BV 64 (254 registers at BV 32).
CORRECT_CONFIG = dict(BV=64, num_warps=8)


def segment_layout(meta, segments: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(``seg_chunks`` [num_seqs * segments + 1]: first chunk of each segment, as the walk's ``seq_chunks``;
    ``chunk_segment`` [num_chunks]: each chunk's segment), built once per chunk layout and segment count."""
    return _segment_layout(meta.seq_chunks_host, segments, device)


@functools.lru_cache(maxsize=32)
def _segment_layout(seq_chunks: tuple[int, ...], segments: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.kda.chunk import _to_device  # chunk imports this module

    bounds, owner = [0], []
    for s, (c0, c1) in enumerate(zip(seq_chunks[:-1], seq_chunks[1:])):
        per = -(-(c1 - c0) // segments)  # ceil; the last segments may be short or empty
        for g in range(segments):
            bounds.append(c0 + min((g + 1) * per, c1 - c0))
            owner.extend([s * segments + g] * (bounds[-1] - bounds[-2]))
    return _to_device(bounds, device), _to_device(owner, device)


@triton.jit
def correct_kernel(hbufx, Ux, starts, chunk_segment, hbuf, U, chunk_start, chunk_len,
                   H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One (V tile, chunk, head): the chunk's state and ``u`` from its segment-local parts and the segment's
    start state. fp32 operands (tf32 on the GPU): the start state is fp32 and the products go on to the
    output kernel and the backward."""
    vb, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    seg = tl.load(chunk_segment + c)
    v0 = vb * BV
    offs_start, mask_s = state_offsets(seg, h, v0, H, K, V, BK, BV)
    start = tl.load(starts + offs_start, mask=mask_s, other=0.0)
    # hbufx rows are [K, V + K]: the local state in columns [:V], X_c in [V:]
    d = tl.arange(0, BK)
    row = ((c * H + h) * K + d)[:, None] * (V + K)
    e = v0 + tl.arange(0, BV)
    local = tl.load(hbufx + row + e[None, :], mask=(d < K)[:, None] & (e < V)[None, :], other=0.0).to(tl.float32)
    x = tl.load(hbufx + row + V + d[None, :], mask=(d < K)[:, None] & (d < K)[None, :], other=0.0).to(tl.float32)
    offs_c, _ = state_offsets(c, h, v0, H, K, V, BK, BV)
    tl.store(hbuf + offs_c, (local + tl.dot(x, start)).to(hbuf.dtype.element_ty), mask=mask_s)
    u_local = load_chunk(Ux, t0, n, h, H, V + K, v0, BV)  # columns past V are masked at the store
    u_identity = load_chunk(Ux, t0, n, h, H, V + K, V, BK)
    store_chunk(U, u_local + tl.dot(u_identity, start), t0, n, h, H, V, v0, BV)


def _zero_padded(x: torch.Tensor, K: int) -> torch.Tensor:
    """[T, H, V] -> [T, H, V + K], the identity part's input columns zero."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], K)], dim=-1)


def _zero_and_identity(num_segs: int, H: int, K: int, V: int, device) -> torch.Tensor:
    """Every segment's walk starts from [0 | I] (fp32 [num_segs, H, K, V + K])."""
    init = torch.zeros(num_segs, H, K, V + K, dtype=torch.float32, device=device)
    init[..., V:] = torch.eye(K, dtype=torch.float32, device=device)
    return init


def _stitch(ends, first, meta, segments, V, reverse):
    """The state entering each segment ([num_segs, H, K, V] fp32; in walk order, backwards when ``reverse``),
    chained from ``first`` (the sequences' initial state, or None: zero) through the segments' ``ends``
    ([num_segs, H, K, V + K]: local end state, then the segment's product), and the state after the last."""
    ends = ends.view(meta.num_seqs, segments, *ends.shape[1:])
    state = (first.float() if first is not None
             else torch.zeros(*ends.shape[:1], *ends.shape[2:-1], V, dtype=torch.float32, device=ends.device))
    entering = torch.empty(*ends.shape[:-1], V, dtype=torch.float32, device=ends.device)
    for g in reversed(range(segments)) if reverse else range(segments):
        entering[:, g] = state
        state = torch.matmul(ends[:, g, ..., V:], state) + ends[:, g, ..., :V]
    return entering.flatten(0, 1), state


def _correct(statex, ux, entering, chunk_segment, meta, K, V, BK):
    """Per chunk: state and u from their local and identity parts and the segment's entering state."""
    H = ux.shape[1]
    states = torch.empty(meta.num_chunks, H, K, V, dtype=statex.dtype, device=statex.device)
    u = torch.empty(*ux.shape[:-1], V, dtype=ux.dtype, device=ux.device)
    correct_kernel[(triton.cdiv(V, CORRECT_CONFIG["BV"]), meta.num_chunks, H)](
        statex, ux, entering, chunk_segment, states, u, meta.chunk_start, meta.chunk_len, H, K=K, V=V, BK=BK,
        **CORRECT_CONFIG)
    return states, u


def state_fwd_two_level(k, W, U0, G, h0, meta, segments: int, opts: dict, state_config, store_final: bool):
    """``state_fwd_kernel``'s results (per-chunk states ``hbuf``, ``U``, the final state or None) by the
    two-level walk above. ``opts``: the walk's shape constants (H, K, V, BK, DOT_BF16); ``state_config``:
    ``chunk.state_config``."""
    T, H, K = k.shape
    V = U0.shape[-1]
    dev, dt = k.device, U0.dtype
    num_segs = meta.num_seqs * segments
    seg_chunks, chunk_segment = segment_layout(meta, segments, dev)
    U0x = _zero_padded(U0, K)
    hbufx = torch.empty(meta.num_chunks, H, K, V + K, dtype=dt, device=dev)
    Ux = torch.empty_like(U0x)
    ends = torch.empty(num_segs, H, K, V + K, dtype=torch.float32, device=dev)
    cfg = state_config(num_segs, H, V + K, dev)
    state_fwd_kernel[(triton.cdiv(V + K, cfg["BV"]), num_segs * H)](
        k, W, U0x, G, _zero_and_identity(num_segs, H, K, V, dev), hbufx, Ux, ends, seg_chunks, meta.chunk_start,
        meta.chunk_len, HAS_H0=True, STORE_FINAL=True, **{**opts, "V": V + K}, **cfg)
    entering, final = _stitch(ends, h0, meta, segments, V, reverse=False)
    hbuf, U = _correct(hbufx, Ux, entering, chunk_segment, meta, K, V, opts["BK"])
    return hbuf, U, (final if store_final else None)


def state_bwd_two_level(q, k, W, G, Mqk, do, dht, meta, segments: int, scale, opts: dict, state_config,
                        need_dh0: bool):
    """``state_bwd_kernel``'s results (per-chunk ``dhbuf``, ``dU``, ``dh0`` or None) by the two-level walk: the
    reverse walk is affine in dS too (``dS_prev = M_c^T dS + B'_c``), so the segments walk backwards from
    [0 | I] with the identity columns' ``dO`` zero, are chained from the last segment, and corrected as the
    forward is."""
    T, H, K = q.shape
    V = do.shape[-1]
    dev = q.device
    num_segs = meta.num_seqs * segments
    seg_chunks, chunk_segment = segment_layout(meta, segments, dev)
    dOx = _zero_padded(do, K)
    dhbufx = torch.empty(meta.num_chunks, H, K, V + K, dtype=W.dtype, device=dev)
    dUx = torch.empty(T, H, V + K, dtype=W.dtype, device=dev)
    ends = torch.empty(num_segs, H, K, V + K, dtype=torch.float32, device=dev)
    cfg = state_config(num_segs, H, V + K, dev)
    state_bwd_kernel[(triton.cdiv(V + K, cfg["BV"]), num_segs * H)](
        q, k, W, G, Mqk, dOx, _zero_and_identity(num_segs, H, K, V, dev), dhbufx, dUx, ends, seg_chunks,
        meta.chunk_start, meta.chunk_len, scale, HAS_DHT=True, HAS_H0=True, **{**opts, "V": V + K}, **cfg)
    entering, dh0 = _stitch(ends, dht, meta, segments, V, reverse=True)
    dhbuf, dU = _correct(dhbufx, dUx, entering, chunk_segment, meta, K, V, opts["BK"])
    return dhbuf, dU, (dh0 if need_dh0 else None)
