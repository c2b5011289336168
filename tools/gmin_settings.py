"""The g_min sweep's settings (``tools/gmin_sweep.py``): what a setting name sets, which KDA kernel path it takes,
and that kernel's forward+backward time on CUDA."""

from __future__ import annotations

import re
import statistics

from tools.eval_lengths import UsageError


def parse_setting(name: str) -> dict:
    """{'name', 'gate', 'g_min', 'overrides'} of one setting name."""
    if name == "softplus":
        return dict(name=name, gate="softplus", g_min=None, overrides=["--kda-gate", "softplus"])
    if name == "rope-full":
        return dict(name=name, gate="none (full attention, RoPE)", g_min=None,
                    overrides=["--attention-pattern", "A", "--position-embedding-type", "rope"])
    match = re.fullmatch(r"gmin-(\d+(?:\.\d+)?)", name)
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--settings: unknown setting {name!r}; use gmin-<X> (X > 0: g_min = -X), softplus or "
                         "rope-full")
    g_min = -float(match.group(1))
    return dict(name=name, gate="lower_bound", g_min=g_min,
                overrides=["--kda-gate", "lower_bound", "--kda-gate-lower-bound", repr(g_min)])


def kernel_path(setting: dict) -> str:
    from kimi_kernels.kda import DENSE_TILE_MIN_BOUND, dense_tiles_ok

    if setting["gate"] == "lower_bound":
        if dense_tiles_ok(setting["g_min"]):
            return "dense diagonal tiles (g_min >= -5)"
        return (f"per-position diagonal tiles: g_min {setting['g_min']:g} < {DENSE_TILE_MIN_BOUND:g}, where the dense "
                "tiles' factor e^(15|g_min|) would overflow fp32")
    if setting["gate"] == "softplus":
        return "per-position diagonal tiles (unbounded gate)"
    return "no KDA layers"


def time_kernel(setting: dict, shape: dict, reps: int = 10) -> dict:
    """Forward+backward of chunk_kda (bf16, in-kernel gate and L2 norm) at ``shape``: {'ms', 'shape'} or
    {'skipped': why}."""
    import torch

    if setting["gate"] not in ("lower_bound", "softplus"):
        return dict(skipped="no KDA layers")
    if not torch.cuda.is_available():
        return dict(skipped="CPU: the kernel is timed on CUDA only")
    from kimi_kernels.kda import chunk_kda

    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v, f = (rnd(B, T, H, D).to(torch.bfloat16).requires_grad_() for _ in range(4))
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    A_log = torch.zeros(H, device="cuda", requires_grad=True)
    dt_bias = torch.zeros(H * D, device="cuda", requires_grad=True)
    do = rnd(B, T, H, D).to(torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
              lower_bound=setting["g_min"])

    def step():
        o, _ = chunk_kda(q, k, v, f, beta, **kw)
        o.backward(do)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return dict(ms=round(statistics.median(times), 3), shape=f"B{B} T{T} H{H} D{D}", reps=reps)
