"""KDA (Kimi Delta Attention) chunked Triton kernels, following fla 0.6.0's ``chunk_kda`` convention."""

import torch

from kimi_kernels.kda.chunk import ChunkKDAFunction
from kimi_kernels.kda.gate import GATE_GIVEN, GATE_LOWER_BOUND, GATE_SOFTPLUS
from kimi_kernels.kda.naive import kda_gate_lower_bound, kda_gate_softplus, naive_chunk_kda, naive_recurrent_kda
from kimi_kernels.layout import tokens_lie_apart

__all__ = ["chunk_kda", "dense_tiles_ok", "DENSE_TILE_MIN_BOUND", "naive_chunk_kda", "naive_recurrent_kda",
           "kda_gate_softplus", "kda_gate_lower_bound"]

# Lower bounds a lower-bounded gate may take: any finite negative value.
LOWER_BOUND_RANGE = (float("-inf"), 0.0)
# The dense diagonal-tile path (SAFE_GATE) factors exp(G_t - G_s) around the tile's first row, so one factor
# reaches e^{15 |g_min|} inside a 16-token tile: e^75 at -5, finite in fp32/bf16 (overflow past ~e^88.7, i.e.
# |g_min| > 5.9). Bounds below DENSE_TILE_MIN_BOUND take the per-position diagonal path (the softplus gate's),
# which is exact for any gate value and slower; the choice is made once per call from the bound.
DENSE_TILE_MIN_BOUND = -5.0


def dense_tiles_ok(lower_bound) -> bool:
    """Whether a gate bounded below by ``lower_bound`` may take the dense diagonal-tile path (g >= -5)."""
    return lower_bound is not None and lower_bound >= DENSE_TILE_MIN_BOUND


def _check(cond, msg):
    if not cond:
        raise ValueError(msg)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None, A_log=None, dt_bias=None,
              lower_bound=None, safe_gate=None, **unused):
    """KDA over [B, T, H, D] tensors. Returns (o [B, T, H, V], final state [N, H, K, V] fp32 or None).

    g: the log-decay [B, T, H, K] (use_gate_in_kernel=False), or the raw gate input, activated in-kernel as
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) when lower_bound is given, else as
    -exp(A_log) * softplus(g + dt_bias). beta [B, T, H] is already in (0, 1) (fla's convention).
    safe_gate (fla's name): with a precomputed g, True promises g >= -5 so every 16x16 tile takes the dense
    tl.dot path; it defaults to True exactly when a lower-bounded gate with lower_bound >= -5 is computed
    in-kernel. A lower_bound below -5 (allowed: any value < 0) takes the per-position diagonal path, like the
    softplus gate, and refuses safe_gate=True (its tiles would overflow fp32).
    cu_seqlens: packed varlen, B must be 1; sequences never share state.
    """
    _check(q.dim() == 4 and q.shape == k.shape, f"q and k must be [B, T, H, K] of one shape, got {tuple(q.shape)} "
           f"and {tuple(k.shape)}")
    B, T, H, K = q.shape
    _check(v.dim() == 4 and v.shape[:3] == (B, T, H), f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    _check(g.shape == q.shape, f"g must be [B, T, H, K] = {tuple(q.shape)}, got {tuple(g.shape)}")
    _check(beta.shape == (B, T, H), f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    _check(16 <= K <= 256, f"head dim K must be in [16, 256], got {K}")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    _check(q.dtype in dtypes and k.dtype == q.dtype and v.dtype == q.dtype,
           f"q, k, v must share one dtype out of fp32/fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    # fp32/fp16 tiles take fp32 (tf32) dots, which Triton 3.6 miscompiles on sm_90 (illegal memory access in
    # state_bwd_kernel); they stay for the CPU interpreter, where the kernels are tested in fp32.
    _check(not q.is_cuda or q.dtype == torch.bfloat16, f"chunk_kda on CUDA takes bf16 q, k, v, got {q.dtype} "
           "(fp32/fp16 run on CPU under TRITON_INTERPRET=1, or through naive_chunk_kda)")
    if lower_bound is not None:
        lo, hi = LOWER_BOUND_RANGE
        _check(lo < lower_bound < hi, f"lower_bound must be a finite value < {hi}, got {lower_bound}")
    if use_gate_in_kernel:
        _check(A_log is not None or lower_bound is not None, "A_log is required for the softplus gate "
               "(use_gate_in_kernel=True and lower_bound=None)")
        _check(A_log is None or A_log.shape == (H,), f"A_log must be [H] = [{H}], got "
               f"{None if A_log is None else tuple(A_log.shape)}")
        _check(dt_bias is None or dt_bias.numel() == H * K, f"dt_bias must have H*K = {H * K} elements")
        gate = GATE_LOWER_BOUND if lower_bound is not None else GATE_SOFTPLUS
        safe = dense_tiles_ok(lower_bound) if safe_gate is None else bool(safe_gate)
        _check(not safe or lower_bound is not None, "safe_gate=True with use_gate_in_kernel=True needs lower_bound")
        _check(not safe or dense_tiles_ok(lower_bound), f"safe_gate=True needs lower_bound >= "
               f"{DENSE_TILE_MIN_BOUND} (the dense diagonal tiles overflow fp32 below it), got {lower_bound}; "
               "leave safe_gate unset to take the per-position path")
    else:
        gate, safe = GATE_GIVEN, bool(safe_gate)
        A_log = dt_bias = None
    if cu_seqlens is not None:
        _check(B == 1, f"with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        _check(bounds[0] == 0 and bounds[-1] == T and all(a <= b for a, b in zip(bounds, bounds[1:])),
               f"cu_seqlens must rise from 0 to T={T}, got {bounds}")
    else:
        bounds = [b * T for b in range(B + 1)]
    N, V = len(bounds) - 1, v.shape[-1]
    if initial_state is not None:
        _check(initial_state.shape == (N, H, K, V), f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got "
               f"{tuple(initial_state.shape)}")
        initial_state = initial_state.float().contiguous()
    scale = K ** -0.5 if scale is None else float(scale)
    packed = [x.reshape(B * T, H, -1).contiguous() for x in (q, k, v)]
    # g is read where it lies when each token's H x K values are contiguous (e.g. a [T, B, H*K] projection
    # seen as [B, T, H, K]); its gradient comes back in the same layout
    g = g if tokens_lie_apart(g) else g.contiguous()
    o, ht = ChunkKDAFunction.apply(*packed, g, beta.reshape(B * T, H).contiguous(), A_log, dt_bias, scale,
                                   initial_state, output_final_state, use_qk_l2norm_in_kernel, gate,
                                   lower_bound, safe, bounds)
    return o.view(B, T, H, V), ht
