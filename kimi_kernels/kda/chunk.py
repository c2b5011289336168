"""Chunked KDA: launches of the Triton kernels and the autograd.Function that ties them together.

Every input is handled in packed form [T_total, H, D]: a batch [B, T] becomes B sequences of length T
(cu_seqlens = 0, T, 2T, ...), so varlen and batched inputs share one code path. Chunks (64 tokens)
restart at every sequence start; the host computes each chunk's first token and length once.
"""

import functools
from types import MappingProxyType

import torch
import triton

from kimi_kernels.device import sm_count
from kimi_kernels.kda.gate import GATE_GIVEN, gate_cumsum_kernel
from kimi_kernels.kda.inter_bwd import inter_bwd_kernel
from kimi_kernels.kda.intra import intra_fwd_kernel
from kimi_kernels.kda.l2norm import EPS as L2_EPS, l2norm_bwd_kernel
from kimi_kernels.kda.intra_bwd import gate_bwd_kernel, intra_bwd_dqk_kernel, intra_bwd_dv_kernel
from kimi_kernels.kda.state import state_bwd_kernel, state_fwd_kernel

CHUNK = 64


def _launch(**choices) -> MappingProxyType:
    """One kernel's launch table (tile constexprs, num_warps, num_stages): read-only, fixed at import."""
    return MappingProxyType(choices)


# Launch tables (V tile BV, num_warps, num_stages), fixed here. 4 warps everywhere: a
# one-knob sweep on the H200 (docs/bench/kda-sweep-h200.json, B4 T8192 H32 D128) measured each 4-warp table
# faster than the 8-warp one it replaced (the forward state walk's wider tiles then spilled at 4 warps; with its
# products in bf16 none spills, tests/kernels/test_kda_compile.py).
# intra_fwd: every [64, K] operand taken KS = 32 channels at a time (products, w, kgl) fits 128 registers without
# spills (ptxas, sm_90, Triton 3.6 and 3.8): four CTAs an SM where the whole-K tiles needed 255 and allowed two.
# num_stages=1: the K-slice loads are short and the pipeliner's shared buffers (76 KB at 3) would cap the CTAs;
# step 1's K-slice loop alone at two stages (PRODUCT_STAGES): its next slice's tiles go through shared memory by
# cp.async (26 KB a CTA, still four an SM) and ptxas spills 8 bytes at 128 registers instead of 20-24 (Triton 3.6)
INTRA_FWD_CONFIG = _launch(BV=32, num_warps=4, num_stages=1, maxnreg=128, PRODUCT_STAGES=2)
# The state walks: one program per (V tile, sequence, head), each walks its sequence's chunks in order, one
# chunk step after another (latency-bound). The narrowest tile that still fits the programs in one wave on the
# SMs, else the widest (state_config): more walkers win until they no longer run at once (H200, per shape:
# docs/bench/kda-sweep-walk-h200.json, docs/bench/kda-sweep-16k-state-h200.json).
STATE_CONFIGS = (_launch(BV=16, num_warps=4), _launch(BV=32, num_warps=4), _launch(BV=64, num_warps=4))
# The forward walk also loads qg and Mqk to write o: at three stages the pipeliner's buffers (155 KB at BV 64, Triton
# 3.8) leave one CTA an SM, and B4 H32's 256 programs would run in two waves; one stage (82 KB) keeps two an SM
STATE_FWD_STAGES = MappingProxyType({16: 3, 32: 3, 64: 1})
# gate cumsum with q's L2 norm and QG, and k's L2 norm (memory-bound, docs/kda.md): one warp per (chunk, COLS
# columns = 2 heads of 128, one part), the rows inside each thread, blocks of RB rows of f and q (RB_NORM rows of
# k) loaded one block ahead. The register cap keeps at least 16 programs an SM (ptxas, sm_90, no spills under
# Triton 3.6 and 3.8, tests/kernels/test_kda_compile.py); RB = 4 spills ~450 bytes under it since the gate part
# also loads q. num_stages=1: the loops' own one-block-ahead loads are the pipeline (Triton 3.8 compiles the same
# code at 3; another version's pipeliner could move them through shared memory)
GATE_CONFIG = _launch(COLS=256, RB=2, RB_NORM=8, num_warps=1, num_stages=1, maxnreg=128)
# num_stages=1 and 168 registers: three CTAs an SM for 28-32 bytes of spill (ptxas, sm_90, Triton 3.6 / 3.8), where
# 3 stages took 214 registers and ran two. (16-wide V tiles would fit 159 without spills, but their 16-deep dots
# are what Triton 3.6 miscompiles on sm_90: see _block_k.)
DV_CONFIG = _launch(BV=32, num_warps=4, num_stages=1, maxnreg=168)
# inter_bwd at 4 warps: 255 registers (32 bytes of spill under Triton 3.6), so two CTAs an SM where 8 warps at 235
# registers ran one, and one program's load and barrier chain no longer idles the SM
INTER_BWD_CONFIG = _launch(BK=64, BV=32, num_warps=4)  # one (64-wide K tile, chunk, head) per program
# one 16-row block of a chunk per program; latency-bound (intra_bwd.py): 128 registers keep 4 CTAs on an SM. ptxas
# takes 168 uncapped with Triton 3.6 (the GPU machine's) and spills 16-20 bytes at 128; 52 with Triton 3.8
# (tests/kernels/test_kda_compile.py)
DQK_CONFIG = _launch(num_warps=4, num_stages=1, maxnreg=128)
# gate backward: as the gate cumsum, blocks of 2 rows (4 spill 272 B under the cap)
GATE_BWD_CONFIG = _launch(COLS=256, RB=2, num_warps=1, num_stages=1, maxnreg=128)
BKT = 32  # K tile of the dq/dk/dg kernels (never 16: see _block_k)
KS = 32  # K slice of intra_fwd_kernel's operands (see INTRA_FWD_CONFIG)
L2_ROWS = 32  # rows per program of the L2-norm backward


class ChunkMeta:
    """Chunk layout of packed sequences: first token and length per chunk, first chunk per sequence."""

    def __init__(self, cu_seqlens: list[int], device):
        starts, lens, seq_chunks = [], [], [0]
        for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            for t0 in range(bos, eos, CHUNK):
                starts.append(t0)
                lens.append(min(CHUNK, eos - t0))
            seq_chunks.append(len(starts))
        self.chunk_start, self.chunk_len, self.seq_chunks = (_to_device(x, device) for x in (starts, lens, seq_chunks))
        self.seq_chunks_host = tuple(seq_chunks)
        self.num_chunks, self.num_seqs = len(starts), len(cu_seqlens) - 1


@functools.lru_cache(maxsize=32)
def chunk_meta(cu_seqlens: tuple[int, ...], device) -> ChunkMeta:
    """:class:`ChunkMeta`, shared by the calls with the same sequence bounds (read-only tensors): a model's
    KDA layers and steps with fixed-length batches build it once instead of once per layer call (three
    host-to-device copies and a pinned allocation each, on a host-bound step)."""
    return ChunkMeta(list(cu_seqlens), device)


def _to_device(values: list[int], device) -> torch.Tensor:
    """int32 tensor on ``device``. To a GPU through pinned memory without blocking: a copy from pageable
    memory waits for the stream, and every KDA layer's forward builds these (18 host syncs per step in a
    6-KDA-layer model, measured with ``torch.cuda.set_sync_debug_mode``)."""
    host = torch.tensor(values, dtype=torch.int32)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def state_config(num_seqs: int, H: int, V: int, device) -> MappingProxyType:
    """The narrowest V tile (most walkers) whose programs all run at once on the SMs, else the widest."""
    sms = _sm_count(device)
    for config in STATE_CONFIGS:
        if num_seqs * H * triton.cdiv(V, config["BV"]) <= sms:
            return config
    return STATE_CONFIGS[-1]


def _sm_count(device) -> int:
    if torch.device(device).type != "cuda":
        return 1  # the CPU interpreter: any config is correct, take the wide one
    return sm_count(device)


def _block_k(K):
    # At least 32: Triton 3.6 miscompiles the K-tiled backward dots at 16 on sm_90 (out-of-bounds shared
    # reads, found with compute-sanitizer); head dims below 32 run masked in a 32-wide tile.
    return max(32, triton.next_power_of_2(K))


def heads_per_program(config, K) -> int:
    """Heads per program of the gate kernels: COLS columns (launch table) of _block_k(K) each, at least one."""
    return max(1, config["COLS"] // _block_k(K))


def _without_cols(config) -> dict:
    """A gate kernel's launch arguments: its table without COLS (which sets HB, see heads_per_program)."""
    return {key: value for key, value in config.items() if key != "COLS"}


def gate_layout(f) -> tuple[int, int, int]:
    """(sequence length, batch stride, time stride) through which the gate kernels address ``f [B, T, H, K]``
    (a token's H x K values contiguous, see :func:`chunk_kda`)."""
    return f.shape[1], f.stride(0), f.stride(1)


def gate_cumsum(f, A_log, dt_bias, lower_bound, gate, meta, q, k, l2norm, scale):
    """One kernel: the chunk-local cumsum G of the (optionally activated) gate ``f [B, T, H, K]``, fp32 packed
    [B T, H, K]; the output's ``QG = scale qn exp(G)`` (q's dtype); and, when l2norm, the inverse L2 norms
    of q and k per (token, head), fp32 [B T, H] (else None), with qn = q * inv_q (q itself without l2norm)."""
    T, H, K = q.shape
    G = torch.empty(T, H, K, dtype=torch.float32, device=f.device)
    norms = tuple(torch.empty(T, H, dtype=torch.float32, device=f.device) for _ in range(2)) if l2norm else None
    inv_q, inv_k = norms or (G, G)  # G: a placeholder pointer without NORM
    QG = torch.empty_like(q)
    hb = heads_per_program(GATE_CONFIG, K)
    gate_cumsum_kernel[(meta.num_chunks * triton.cdiv(H, hb), 2 if l2norm else 1)](
        f, A_log if A_log is not None else f, dt_bias if dt_bias is not None else f, G, q, k, inv_q, inv_k, QG,
        meta.chunk_start, meta.chunk_len, float(lower_bound or 0.0), L2_EPS, scale, *gate_layout(f), H=H, K=K,
        BK=_block_k(K), HB=hb, GATE=gate, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, NORM=l2norm,
        **_without_cols(GATE_CONFIG))
    return G, QG, norms


def l2norm_bwd(x, dxn):
    """Gradient w.r.t. x of x / max(|x|, eps) per row, in x's dtype."""
    rows, K = x.numel() // x.shape[-1], x.shape[-1]
    dx = torch.empty_like(x)
    l2norm_bwd_kernel[(triton.cdiv(rows, L2_ROWS),)](x, dxn, dx, rows, L2_EPS, K=K, BK=_block_k(K), BR=L2_ROWS)
    return dx


def kda_fwd(q, k, v, G, QG, norms, beta, scale, h0, output_final_state, safe_gate, meta):
    """Returns o, final state (or None) and the tensors the backward reuses. q, k raw; ``norms``: (inv_q, inv_k)
    when they are L2-normalised (QG and norms: see gate_cumsum)."""
    T, H, K = q.shape
    V = v.shape[-1]
    dev, dt = q.device, q.dtype
    opts = dict(H=H, K=K, V=V, BK=_block_k(K), DOT_BF16=dt == torch.bfloat16)
    Mqk = torch.empty(T, H, CHUNK, dtype=dt, device=dev)
    Ainv = torch.empty(T, H, CHUNK, dtype=torch.float32, device=dev)
    W = torch.empty(T, H, K, dtype=dt, device=dev)
    U0 = torch.empty(T, H, V, dtype=dt, device=dev)
    KGL = torch.empty_like(k)  # the walk's kn exp(G_last - G), in the dot dtype
    inv_q, inv_k = norms or (G, G)
    intra_fwd_kernel[(meta.num_chunks, H)](q, k, v, beta, G, inv_q, inv_k, Mqk, Ainv, W, U0, KGL, meta.chunk_start,
                                           meta.chunk_len, scale, SAFE_GATE=safe_gate, KS=min(KS, opts["BK"]),
                                           NORM=norms is not None, **opts, **INTRA_FWD_CONFIG)
    hbuf = torch.empty(meta.num_chunks, H, K, V, dtype=dt, device=dev)
    U = torch.empty_like(U0)
    ht = torch.empty(meta.num_seqs, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    o = torch.empty_like(v)
    state_cfg = state_config(meta.num_seqs, H, V, dev)
    state_fwd_kernel[(triton.cdiv(V, state_cfg["BV"]), meta.num_seqs * H)](
        KGL, W, U0, G, QG, Mqk, h0 if h0 is not None else k, hbuf, U, o, ht if ht is not None else k,
        meta.seq_chunks, meta.chunk_start, meta.chunk_len, HAS_H0=h0 is not None, STORE_FINAL=ht is not None, **opts,
        **state_cfg, num_stages=STATE_FWD_STAGES[state_cfg["BV"]])
    return o, ht, (Mqk, Ainv, W, U, hbuf, QG, KGL)


def kda_bwd(q, k, v, G, norms, beta, scale, h0, dht, do, saved, f, A_log, dt_bias, lower_bound, gate, safe_gate,
            meta, dqk_dtype):
    """Gradients of kda_fwd (q, k raw, ``norms`` as there); dg is w.r.t. the raw gate input when gate !=
    GATE_GIVEN (in f's dtype and layout, like dv in v's dtype). dq and dk are w.r.t. the normalised q, k when
    ``norms`` is given, in dqk_dtype (fp32 when an L2-norm backward follows)."""
    Mqk, Ainv, W, U, hbuf, QG, KGL = saved
    T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    opts = dict(H=H, K=K, V=V, BK=_block_k(K), DOT_BF16=q.dtype == torch.bfloat16)
    inv_q, inv_k = norms or (G, G)  # q, k raw: the kernels that read them scale by the norms (NORM)
    dhbuf = torch.empty_like(hbuf)
    dU = torch.empty_like(U)
    dh0 = torch.empty(meta.num_seqs, H, K, V, dtype=torch.float32, device=dev) if h0 is not None else None
    state_cfg = state_config(meta.num_seqs, H, V, dev)
    state_bwd_kernel[(triton.cdiv(V, state_cfg["BV"]), meta.num_seqs * H)](
        QG, KGL, W, G, Mqk, do, dht if dht is not None else q, dhbuf, dU, dh0 if dh0 is not None else q,
        meta.seq_chunks, meta.chunk_start, meta.chunk_len, HAS_DHT=dht is not None, HAS_H0=dh0 is not None, **opts,
        **state_cfg)
    f32 = dict(dtype=torch.float32, device=dev)
    block_kt = min(BKT, opts["BK"])
    num_kt = triton.cdiv(K, block_kt)
    # dMqk, dL: rounded once to the dot operand type (bf16 for bf16 inputs), read by every K tile
    scratch = torch.empty(2, T, H, CHUNK, dtype=torch.bfloat16 if opts["DOT_BF16"] else torch.float32, device=dev)
    dv = torch.empty(T, H, V, dtype=v.dtype, device=dev)
    inter_bk = min(INTER_BWD_CONFIG["BK"], opts["BK"])
    num_inter = triton.cdiv(K, inter_bk)
    # dbeta partial sums: [0] through v; [1 + j] intra-chunk terms of K tile j; then the state terms per K tile
    dbeta_parts = torch.empty(1 + num_kt + num_inter, T, H, **f32)
    intra_bwd_dv_kernel[(meta.num_chunks, H)](
        v, beta, U, dU, do, Ainv, scratch[0], scratch[1], dv, dbeta_parts, meta.chunk_start, meta.chunk_len, scale,
        H=H, V=V, DOT_BF16=opts["DOT_BF16"], **DV_CONFIG)
    dq = torch.empty(T, H, K, dtype=dqk_dtype, device=dev)
    dk = torch.empty(T, H, K, dtype=dqk_dtype, device=dev)
    dg = torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=dev)  # f's layout (gate_layout)
    has_a = gate != GATE_GIVEN and A_log is not None
    has_bias = gate != GATE_GIVEN and dt_bias is not None
    dA_parts = torch.empty(meta.num_chunks, H, **f32) if has_a else dg
    ddt_parts = torch.empty(meta.num_chunks, H, K, **f32) if has_bias else dg
    d_G = torch.empty(T, H, K, **f32)  # per-token dG before the reverse cumsum
    dlast = torch.empty(meta.num_chunks, H, K, **f32)  # the chunk's last row's share of dG (through Gl)
    # the state terms of dq, dk, dG as fp32 partials; dq, dk themselves when they are fp32 (completed in place)
    pq = dq if dq.dtype == torch.float32 else torch.empty(T, H, K, **f32)
    pk = dk if dk.dtype == torch.float32 else torch.empty(T, H, K, **f32)
    inter_launch = {key: value for key, value in INTER_BWD_CONFIG.items() if key != "BK"}
    inter_bwd_kernel[(num_inter, meta.num_chunks, H)](
        q, k, beta, G, inv_q, inv_k, hbuf, dhbuf, U, dU, do, Ainv, pq, pk, d_G, dlast, dbeta_parts, meta.chunk_start,
        meta.chunk_len, scale, H, T * H, 1 + num_kt, K=K, V=V, BK=inter_bk, DOT_BF16=opts["DOT_BF16"],
        NORM=norms is not None, **inter_launch)
    intra_bwd_dqk_kernel[(num_kt * 4, meta.num_chunks, H)](
        q, k, beta, G, inv_q, inv_k, scratch[0], scratch[1], pq, pk, d_G, dq, dk, d_G, dbeta_parts, meta.chunk_start,
        meta.chunk_len, scale, H, T * H, K=K, BKT=block_kt, SAFE_GATE=safe_gate, DOT_BF16=opts["DOT_BF16"],
        NORM=norms is not None, **DQK_CONFIG)
    hb = heads_per_program(GATE_BWD_CONFIG, K)
    gate_bwd_kernel[(meta.num_chunks * triton.cdiv(H, hb),)](
        d_G, dlast, f, A_log if has_a else f, dt_bias if has_bias else f, dg, dA_parts, ddt_parts,
        meta.chunk_start, meta.chunk_len, float(lower_bound or 0.0), *gate_layout(f), H, K=K, BK=opts["BK"],
        HB=hb, GATE=gate, HAS_A=has_a, HAS_BIAS=has_bias, **_without_cols(GATE_BWD_CONFIG))
    dbeta = dbeta_parts.sum(0).to(beta.dtype)
    dA_log = dA_parts.sum(0) if has_a else None
    ddt_bias = ddt_parts.sum(0).reshape(H * K) if has_bias else None
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                use_qk_l2norm, gate, lower_bound, safe_gate, cu_seqlens_list):
        meta = chunk_meta(tuple(cu_seqlens_list), q.device)
        G, QG, norms = gate_cumsum(g, A_log, dt_bias, lower_bound, gate, meta, q, k, use_qk_l2norm, scale)
        o, ht, saved = kda_fwd(q, k, v, G, QG, norms, beta, scale, initial_state, output_final_state, safe_gate, meta)
        # kept for the backward: G (fp32) and the inverse norms (the gate pass is ~5% of a forward+backward at B4
        # T8192 H32 D128), and in `saved` the walk's operands QG and KGL, 4 bytes per element of q as the
        # normalised q, k took before; the backward kernels, like the forward's, scale raw q, k by the norms
        inv_q, inv_k = norms or (None, None)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, G, inv_q, inv_k, *saved)
        ctx.args = (scale, use_qk_l2norm, gate, lower_bound, safe_gate, meta)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, G, inv_q, inv_k, *saved = ctx.saved_tensors
        scale, use_qk_l2norm, gate, lower_bound, safe_gate, meta = ctx.args
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = kda_bwd(
            q, k, v, G, (inv_q, inv_k) if use_qk_l2norm else None, beta, scale, h0, dht, do.contiguous(), saved, g,
            A_log, dt_bias, lower_bound, gate, safe_gate, meta, torch.float32 if use_qk_l2norm else q.dtype)
        if use_qk_l2norm:
            dq, dk = l2norm_bwd(q, dq), l2norm_bwd(k, dk)
        return (dq, dk, dv, dg, dbeta,
                dA_log, ddt_bias, None, dh0, None, None, None, None, None, None)
