"""Chunked KDA: launches of the Triton kernels and the autograd.Function that ties them together.

Every input is handled in packed form [T_total, H, D]: a batch [B, T] becomes B sequences of length T
(cu_seqlens = 0, T, 2T, ...), so varlen and batched inputs share one code path. Chunks (64 tokens)
restart at every sequence start; the host computes each chunk's first token and length once.
"""

import torch
import torch.nn.functional as F
import triton

from kernels.kda.gate import GATE_GIVEN, gate_cumsum_kernel
from kernels.kda.intra import intra_fwd_kernel
from kernels.kda.intra_bwd import intra_bwd_kernel
from kernels.kda.state import output_kernel, state_bwd_kernel, state_fwd_kernel

CHUNK = 64
BV = 64


class ChunkMeta:
    """Chunk layout of packed sequences: first token and length per chunk, first chunk per sequence."""

    def __init__(self, cu_seqlens: list[int], device):
        starts, lens, seq_chunks = [], [], [0]
        for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            for t0 in range(bos, eos, CHUNK):
                starts.append(t0)
                lens.append(min(CHUNK, eos - t0))
            seq_chunks.append(len(starts))
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        self.chunk_start, self.chunk_len, self.seq_chunks = as_tensor(starts), as_tensor(lens), as_tensor(seq_chunks)
        self.num_chunks, self.num_seqs = len(starts), len(cu_seqlens) - 1


def _block_k(K):
    return max(16, triton.next_power_of_2(K))


def gate_cumsum(f, A_log, dt_bias, lower_bound, gate, meta):
    """Chunk-local cumsum of the (optionally activated) gate, fp32 [T, H, K]."""
    T, H, K = f.shape
    G = torch.empty(T, H, K, dtype=torch.float32, device=f.device)
    gate_cumsum_kernel[(meta.num_chunks, H)](
        f, A_log if A_log is not None else f, dt_bias if dt_bias is not None else f, G,
        meta.chunk_start, meta.chunk_len, float(lower_bound or 0.0), H=H, K=K, BK=_block_k(K), GATE=gate,
        HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None)
    return G


def kda_fwd(q, k, v, G, beta, scale, h0, output_final_state, safe_gate, meta):
    """Returns o, final state (or None) and the tensors the backward reuses."""
    T, H, K = q.shape
    V = v.shape[-1]
    dev, dt = q.device, q.dtype
    opts = dict(H=H, K=K, V=V, BK=_block_k(K), BV=BV, DOT_BF16=dt == torch.bfloat16)
    Mqk = torch.empty(T, H, CHUNK, dtype=dt, device=dev)
    Ainv = torch.empty(T, H, CHUNK, dtype=torch.float32, device=dev)
    W = torch.empty(T, H, K, dtype=dt, device=dev)
    U0 = torch.empty(T, H, V, dtype=dt, device=dev)
    intra_fwd_kernel[(meta.num_chunks, H)](q, k, v, beta, G, Mqk, Ainv, W, U0, meta.chunk_start,
                                           meta.chunk_len, scale, SAFE_GATE=safe_gate, **opts)
    hbuf = torch.empty(meta.num_chunks, H, K, V, dtype=dt, device=dev)
    U = torch.empty_like(U0)
    ht = torch.empty(meta.num_seqs, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    state_fwd_kernel[(triton.cdiv(V, BV), meta.num_seqs * H)](
        k, W, U0, G, h0 if h0 is not None else k, hbuf, U, ht if ht is not None else k, meta.seq_chunks,
        meta.chunk_start, meta.chunk_len, HAS_H0=h0 is not None, STORE_FINAL=ht is not None, **opts)
    o = torch.empty_like(v)
    output_kernel[(triton.cdiv(V, BV), meta.num_chunks, H)](q, G, hbuf, Mqk, U, o, meta.chunk_start,
                                                           meta.chunk_len, scale, **opts)
    return o, ht, (Mqk, Ainv, W, U, hbuf)


def kda_bwd(q, k, v, G, beta, scale, h0, dht, do, saved, f, A_log, dt_bias, lower_bound, gate, safe_gate, meta):
    """Gradients of kda_fwd; dg is w.r.t. the raw gate input when gate != GATE_GIVEN."""
    Mqk, Ainv, W, U, hbuf = saved
    T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    opts = dict(H=H, K=K, V=V, BK=_block_k(K), BV=BV, DOT_BF16=q.dtype == torch.bfloat16)
    dhbuf = torch.empty_like(hbuf)
    dU = torch.empty_like(U)
    dh0 = torch.empty(meta.num_seqs, H, K, V, dtype=torch.float32, device=dev) if h0 is not None else None
    state_bwd_kernel[(triton.cdiv(V, BV), meta.num_seqs * H)](
        q, k, W, G, Mqk, do, dht if dht is not None else q, dhbuf, dU, dh0 if dh0 is not None else q,
        meta.seq_chunks, meta.chunk_start, meta.chunk_len, scale, HAS_DHT=dht is not None,
        HAS_H0=dh0 is not None, **opts)
    f32 = dict(dtype=torch.float32, device=dev)
    dq, dk, dg = (torch.empty(T, H, K, **f32) for _ in range(3))
    dv = torch.empty(T, H, V, **f32)
    dbeta = torch.empty(T, H, **f32)
    dA_terms = torch.empty(T, H, K, **f32) if gate != GATE_GIVEN and A_log is not None else dg
    scratch = torch.empty(2, T, H, CHUNK, **f32)
    intra_bwd_kernel[(meta.num_chunks, H)](
        q, k, v, beta, G, hbuf, dhbuf, U, dU, do, Ainv, f, A_log if A_log is not None else f,
        dt_bias if dt_bias is not None else f, scratch[0], scratch[1], dq, dk, dv, dbeta, dg, dA_terms,
        meta.chunk_start, meta.chunk_len, scale, float(lower_bound or 0.0), SAFE_GATE=safe_gate, GATE=gate,
        HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None, **opts)
    dA_log = dA_terms.sum((0, 2)) if dA_terms is not dg else None
    ddt_bias = dg.sum(0).reshape(H * K) if gate != GATE_GIVEN and dt_bias is not None else None
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def _l2norm(x):
    return F.normalize(x.float(), dim=-1, eps=1e-6).to(x.dtype)


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                use_qk_l2norm, gate, lower_bound, safe_gate, cu_seqlens_list):
        meta = ChunkMeta(cu_seqlens_list, q.device)
        qn, kn = (_l2norm(q), _l2norm(k)) if use_qk_l2norm else (q, k)
        G = gate_cumsum(g, A_log, dt_bias, lower_bound, gate, meta)
        o, ht, saved = kda_fwd(qn, kn, v, G, beta, scale, initial_state, output_final_state, safe_gate, meta)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, *saved)
        ctx.args = (scale, use_qk_l2norm, gate, lower_bound, safe_gate, meta)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, *saved = ctx.saved_tensors
        scale, use_qk_l2norm, gate, lower_bound, safe_gate, meta = ctx.args
        qn, kn = (_l2norm(q), _l2norm(k)) if use_qk_l2norm else (q, k)
        G = gate_cumsum(g, A_log, dt_bias, lower_bound, gate, meta)
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = kda_bwd(
            qn, kn, v, G, beta, scale, h0, dht, do.contiguous(), saved, g, A_log, dt_bias, lower_bound, gate,
            safe_gate, meta)
        if use_qk_l2norm:  # backward of x / |x| in fp32
            with torch.enable_grad():
                xs = [x.detach().float().requires_grad_() for x in (q, k)]
                dq, dk = torch.autograd.grad([F.normalize(x, dim=-1, eps=1e-6) for x in xs], xs, [dq, dk])
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
                dA_log, ddt_bias, None, dh0, None, None, None, None, None, None)
