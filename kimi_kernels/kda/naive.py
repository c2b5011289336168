"""Plain-PyTorch fp32 references for KDA (Kimi Delta Attention).

Per head, with state S in R^{K x V}:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
Tensors are [B, T, H, D]; with ``cu_seqlens`` B must be 1 and the sequences are packed along T.
"""

import torch
import torch.nn.functional as F

from kimi_kernels.kda.l2norm import EPS as L2_EPS

CHUNK = 64


def kda_gate_softplus(f, A_log, dt_bias=None):
    """g = -exp(A_log) * softplus(f + dt_bias); f is [..., H, K], A_log [H], dt_bias [H*K]."""
    H, K = f.shape[-2:]
    x = f.float() + (dt_bias.float().view(H, K) if dt_bias is not None else 0.0)
    return -A_log.float().exp().view(H, 1) * F.softplus(x)


def kda_gate_lower_bound(f, A_log=None, dt_bias=None, lower_bound=-5.0):
    """g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), in (lower_bound, 0); A_log None means 1."""
    H, K = f.shape[-2:]
    x = f.float() + (dt_bias.float().view(H, K) if dt_bias is not None else 0.0)
    if A_log is not None:
        x = A_log.float().exp().view(H, 1) * x
    return lower_bound * torch.sigmoid(x)


def _sequences(T, cu_seqlens, B):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:  # the kernels' eps (kimi_kernels/kda/l2norm.py); F.normalize's default is 1e-12
        q, k = F.normalize(q, dim=-1, eps=L2_EPS), F.normalize(k, dim=-1, eps=L2_EPS)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm=False):
    """Token-by-token recurrence (the definition). Returns (o [B,T,H,V] fp32, final state [N,H,K,V] or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=q.device)
    finals = []
    for n, (b, bos, eos) in enumerate(_sequences(T, cu_seqlens, B)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].float()
        for t in range(bos, eos):
            kt, bt = k[b, t], beta[b, t].view(H, 1)
            S = S * g[b, t].exp().unsqueeze(-1)                         # Diag(alpha_t) S
            residual = v[b, t] - torch.einsum("hk,hkv->hv", kt, S)       # v_t - S^T k_t
            S = S + torch.einsum("hk,hv->hkv", kt, bt * residual)
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t], S)
        finals.append(S)
    return o, (torch.stack(finals) if output_final_state else None)


def _chunk_step(q, k, v, g, beta, S):
    """One chunk for all heads: q,k [H,L,K], v [H,L,V], g [H,L,K], beta [H,L], S [H,K,V]."""
    L = q.shape[1]
    G = g.cumsum(1)
    diff = G.unsqueeze(2) - G.unsqueeze(1)                                  # [H, L(t), L(s), K]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp(torch.where(causal[None, :, :, None], diff, float("-inf")))
    strict = causal & ~torch.eye(L, dtype=torch.bool, device=q.device)
    A_qk = torch.einsum("htk,hsk,htsk->hts", q, k, decay)                  # incl. diagonal
    A_kk = torch.einsum("htk,hsk,htsk->hts", k, k, decay) * strict * beta.unsqueeze(-1)
    eye = torch.eye(L, device=q.device).expand(q.shape[0], L, L)
    A_inv = torch.linalg.solve_triangular(eye + A_kk, eye, upper=False, unitriangular=True)
    w = A_inv @ (beta.unsqueeze(-1) * k * G.exp())
    u = A_inv @ (beta.unsqueeze(-1) * v) - w @ S
    o = (q * G.exp()) @ S + A_qk @ u
    G_last = G[:, -1:]
    S = S * G_last.transpose(1, 2).exp() + (k * (G_last - G).exp()).transpose(1, 2) @ u
    return o, S


def naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, use_qk_l2norm=False, chunk_size=CHUNK):
    """Chunked (WY / UT-transform) form with plain torch ops; chunks restart at every sequence start."""
    B, T, H, K = q.shape
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    outs = [[] for _ in range(B)]
    finals = []
    for n, (b, bos, eos) in enumerate(_sequences(T, cu_seqlens, B)):
        S = q.new_zeros(H, K, v.shape[-1]) if initial_state is None else initial_state[n].float()
        for t0 in range(bos, eos, chunk_size):
            sl = slice(t0, min(t0 + chunk_size, eos))
            o, S = _chunk_step(*(x[b, sl].transpose(0, 1) for x in (q, k, v, g, beta)), S)
            outs[b].append(o.transpose(0, 1))
        finals.append(S)
    o = torch.stack([torch.cat(x, 0) for x in outs])
    return o, (torch.stack(finals) if output_final_state else None)
