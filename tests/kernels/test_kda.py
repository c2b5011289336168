"""KDA chunked kernels vs the fp32 references (CPU: Triton interpreter, fp32, in a subprocess
started by ``test_cases_under_interpreter`` (tests/kernels/interpreter.py); GPU: bf16)."""

import pytest
import torch

from kimi_kernels.kda import (chunk_kda, kda_gate_lower_bound, kda_gate_softplus, naive_chunk_kda,
                         naive_recurrent_kda)
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)

NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


def make_inputs(B, T, H, K, V, N=None, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    N = B if N is None else N
    x = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V), g=rnd(B, T, H, K),
             beta=torch.rand(B, T, H, generator=gen) * 0.9 + 0.05, A_log=rnd(H) * 0.5, dt_bias=rnd(H * K),
             h0=rnd(N, H, K, V))
    return {n: t.to(device) for n, t in x.items()}


def run_pair(x, gate, dtype=torch.float32, cu_seqlens=None, l2norm=True, with_h0=True, safe_gate=None,
             lower_bound=-5.0):
    """Our chunk_kda and the fp32 chunked reference on the same inputs; returns outputs and gradients of both."""
    lower_bound = lower_bound if gate == "lower_bound" else None

    def ours(t):
        return chunk_kda(t["q"].to(dtype), t["k"].to(dtype), t["v"].to(dtype), t["g"].to(dtype),
                         t["beta"].to(dtype), initial_state=t["h0"] if with_h0 else None, output_final_state=True,
                         use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate != "given", cu_seqlens=cu_seqlens,
                         A_log=t["A_log"], dt_bias=t["dt_bias"], lower_bound=lower_bound, safe_gate=safe_gate)

    def reference(t):
        if gate == "lower_bound":
            g = kda_gate_lower_bound(t["g"], t["A_log"], t["dt_bias"], lower_bound)
        elif gate == "softplus":
            g = kda_gate_softplus(t["g"], t["A_log"], t["dt_bias"])
        else:
            g = t["g"]
        return naive_chunk_kda(t["q"], t["k"], t["v"], g, t["beta"], initial_state=t["h0"] if with_h0 else None,
                               output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm)

    results = []
    gen = torch.Generator().manual_seed(1)
    for fn in (ours, reference):
        t = {n: v.clone().requires_grad_() for n, v in x.items()}
        o, s = fn(t)
        if not results:
            do = torch.randn(o.shape, generator=gen).to(o.device)
            ds = torch.randn(s.shape, generator=gen).to(o.device)
        ((o.float() * do).sum() + (s * ds).sum()).backward()
        grads = {n: t[n].grad for n in NAMES if t[n].grad is not None}
        results.append((o.float(), s, grads))
    return results


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def assert_match(results, tol, expect_grads, grad_tols=None):
    """Outputs, final state and the gradients ``expect_grads`` within ``tol`` (max-normalised), a gradient named
    in ``grad_tols`` within its own."""
    (o, s, grads), (o_ref, s_ref, grads_ref) = results
    assert rel_err(o, o_ref) < tol, f"output rel err {rel_err(o, o_ref)}"
    assert rel_err(s, s_ref) < tol, f"final state rel err {rel_err(s, s_ref)}"
    assert set(grads) == set(grads_ref) and set(expect_grads) <= set(grads)
    for n in expect_grads:
        assert torch.isfinite(grads[n]).all(), n
        limit = (grad_tols or {}).get(n, tol)
        assert rel_err(grads[n], grads_ref[n]) < limit, f"d{n} rel err {rel_err(grads[n], grads_ref[n])}"


def test_chunked_reference_equals_recurrence():
    x = make_inputs(1, 150, 2, 16, 16, N=3)
    g = kda_gate_lower_bound(x["g"], x["A_log"], x["dt_bias"], -5.0)
    cu = torch.tensor([0, 20, 90, 150])
    args = (x["q"], x["k"], x["v"], g, x["beta"])
    kw = dict(initial_state=x["h0"], output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True)
    o1, s1 = naive_recurrent_kda(*args, **kw)
    o2, s2 = naive_chunk_kda(*args, **kw)
    assert rel_err(o2, o1) < 1e-5 and rel_err(s2, s1) < 1e-5


@interpreter_case
def test_lower_bound_gate_in_kernel_batched():
    """B=2, T=100 (not a multiple of 64), l2norm, in-kernel gate, initial and final state."""
    results = run_pair(make_inputs(2, 100, 2, 16, 32), "lower_bound")
    assert_match(results, 1e-4, NAMES)


def run_with_gate_layout(x, gate, sequence_first, dtype=torch.float32):
    """chunk_kda with g contiguous [B, T, H, K] or as a sequence-first [T, B, H*K] tensor seen batch-first (the
    KDA layer's projection, read in place): output, final state, gradients and the layout of g's gradient."""
    t = {n: v.to(dtype).clone().requires_grad_() for n, v in x.items() if n not in ("A_log", "dt_bias")}
    B, T, H, K = t["g"].shape
    g = t["g"]
    if sequence_first:
        g = g.detach().transpose(0, 1).flatten(2).contiguous().requires_grad_()  # [T, B, H*K], the same values
        t["g_leaf"] = g
        g = g.transpose(0, 1).unflatten(-1, (H, K))
    seen = []
    g.register_hook(lambda grad: seen.append(grad.stride()))
    o, s = chunk_kda(t["q"], t["k"], t["v"], g, t["beta"], initial_state=t["h0"].float(), output_final_state=True,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate != "given", A_log=x["A_log"],
                     dt_bias=x["dt_bias"], lower_bound=-5.0, safe_gate=True if gate == "given" else None)
    gen = torch.Generator().manual_seed(2)
    do, ds = torch.randn(o.shape, generator=gen).to(o.device), torch.randn(s.shape, generator=gen).to(o.device)
    ((o.float() * do).sum() + (s * ds).sum()).backward()
    dg = t["g_leaf"].grad.transpose(0, 1).unflatten(-1, (H, K)) if sequence_first else t["g"].grad
    return (o, s, dg, t["q"].grad, t["k"].grad, t["v"].grad, t["beta"].grad), (seen[0], g.stride())


@interpreter_case
@pytest.mark.parametrize("gate", ["lower_bound", "given"])
def test_sequence_first_gate_is_read_in_place(gate):
    """B=2 over a chunk boundary: the kernels read g through its batch and time strides and write dg in g's
    layout, with results identical to a contiguous g."""
    x = make_inputs(2, 100, 2, 16, 32, seed=9)
    if gate == "given":
        x["g"] = kda_gate_lower_bound(x["g"], None, None, -5.0)
    contiguous, _ = run_with_gate_layout(x, gate, sequence_first=False)
    strided, (grad_stride, view_stride) = run_with_gate_layout(x, gate, sequence_first=True)
    assert grad_stride == view_stride  # dg came back in g's layout: no copy on the way
    for a, b in zip(strided, contiguous):
        assert torch.equal(a, b)


@interpreter_case
def test_softplus_gate_in_kernel():
    """Unbounded gate: the diagonal tiles take the per-position path; A_log large to make decays strong."""
    x = make_inputs(1, 40, 1, 16, 16, seed=3)
    x["A_log"] = x["A_log"] + 1.5
    # dA_log sums -softplus(f + dt_bias) dg over every token and channel of the head, terms that largely cancel:
    # two fp32 summation orders (ours, the reference's) differ by ~1e-4 of its size (8.5e-5 and 1.1e-4 for two
    # blockings of the same gate cumsum); a wrong term moves it by O(1)
    assert_match(run_pair(x, "softplus"), 1e-4, NAMES, grad_tols={"A_log": 3e-4})


@interpreter_case
def test_precomputed_gate_varlen():
    """Packed sequences of 30, 70 (crossing a chunk boundary) and 30 tokens, each with its own state."""
    x = make_inputs(1, 130, 1, 32, 16, N=3, seed=5)
    x["g"] = kda_gate_lower_bound(x["g"], None, None, -5.0)
    cu = torch.tensor([0, 30, 100, 130])
    results = run_pair(x, "given", cu_seqlens=cu, safe_gate=True)
    assert_match(results, 1e-4, ("q", "k", "v", "g", "beta", "h0"))


@interpreter_case
@pytest.mark.parametrize("block_v", [16, 32])
def test_state_walk_v_tiles_agree(block_v, monkeypatch):
    """Each V tile of the state walks (chunk.state_config picks one per shape) gives the widest tile's outputs,
    final states and gradients (dh0 included) and matches the reference: V = 48 (a partial last tile), varlen
    with a one-chunk sequence and a chunk boundary inside the last one."""
    import kimi_kernels.kda.chunk as chunk

    x = make_inputs(1, 200, 2, 32, 48, N=3, seed=8)
    cu = torch.tensor([0, 130, 136, 200])
    # state_config picks the tile from the SM count: 6 sequence-heads walk V = 48 in 18 / 12 / 6 programs of
    # width 16 / 32 / 64, so a device of 18 / 12 SMs takes the narrow tiles, the interpreter's 1 the widest
    sms = {16: 18, 32: 12}[block_v]
    assert chunk.state_config(3, 2, 48, "cpu")["BV"] == 64
    wide = run_pair(x, "lower_bound", cu_seqlens=cu)[0]
    monkeypatch.setattr(chunk, "_sm_count", lambda device: sms)
    assert chunk.state_config(3, 2, 48, "cpu")["BV"] == block_v
    narrow, reference = run_pair(x, "lower_bound", cu_seqlens=cu)
    assert rel_err(narrow[0], wide[0]) < 1e-5 and rel_err(narrow[1], wide[1]) < 1e-5
    assert set(narrow[2]) == set(wide[2]) and all(rel_err(narrow[2][n], wide[2][n]) < 1e-5 for n in wide[2])
    assert_match((narrow, reference), 1e-4, ("q", "k", "v", "beta", "h0"))


def test_state_config_takes_the_narrowest_tile_that_fits_one_wave(monkeypatch):
    """132 SMs (H200): 16 sequence-heads walk in 16-wide V tiles (128 programs), 32 in 32-wide ones, 128 in
    the widest (256 programs: none fits one wave)."""
    import kimi_kernels.kda.chunk as chunk

    monkeypatch.setattr(chunk, "_sm_count", lambda device: 132)
    assert [chunk.state_config(seqs, heads, 128, "cuda")["BV"] for seqs, heads in ((1, 16), (2, 16), (4, 32))] \
        == [16, 32, 64]
    assert chunk.state_config(1, 33, 128, "cuda")["BV"] == 32  # 33 * 8 = 264 programs at 16 > 132


@interpreter_case
def test_l2norm_rows_below_eps():
    """q, k rows with |x| below the norm's eps (1e-6), where x / max(|x|, eps) is x / eps and its backward has no
    radial part (l2norm_bwd_kernel), against the reference with the same eps."""
    x = make_inputs(1, 70, 2, 32, 32, seed=11)
    tiny = torch.rand(70, generator=torch.Generator().manual_seed(3)) < 0.2
    x["q"][0, tiny] *= 1e-8
    x["k"][0, tiny.roll(1)] *= 1e-8
    results = run_pair(x, "lower_bound")
    assert_match(results, 1e-4, NAMES)  # max-normalised: the tiny rows' gradients (~1e6 x) dominate
    (_, _, grads), (_, _, grads_ref) = results
    for name, rows in (("q", ~tiny), ("k", ~tiny.roll(1))):  # so the other rows on their own
        assert rel_err(grads[name][0, rows], grads_ref[name][0, rows]) < 1e-4, name


@interpreter_case
def test_saturated_gate_at_lower_bound():
    """Every g at the bound (-5): the widest exponent span inside a tile (15 * 5 = 75 nats)."""
    x = make_inputs(1, 80, 1, 16, 16, seed=7)
    x["g"] = torch.full_like(x["g"], -5.0)
    results = run_pair(x, "given", safe_gate=True, l2norm=False, with_h0=False)
    assert_match(results, 1e-4, ("q", "k", "v", "g", "beta"))
    x["g"] = torch.full_like(x["g"], 40.0)  # raw input deep in saturation: sigmoid -> 1, g -> lower_bound
    x["A_log"] = torch.zeros_like(x["A_log"])
    assert_match(run_pair(x, "lower_bound", l2norm=False), 1e-4, NAMES)


@interpreter_case
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_head_dim_128(gate):
    """K = 128 as on the GPU: several K slices in intra_fwd_kernel and K tiles in intra_bwd_dqk_kernel."""
    x = make_inputs(1, 70, 1, 128, 32, seed=13)
    assert_match(run_pair(x, gate), 1e-4, NAMES)


@interpreter_case
def test_half_precision_gradients_without_l2norm():
    """fp16 q/k without the L2 norm: dq, dk come out in fp16, so the state terms of the backward go through
    separate fp32 partial buffers (with fp32 dq, dk the dq/dk kernel completes them in place instead)."""
    x = make_inputs(1, 100, 2, 64, 32, seed=17)
    x = {n: (t * 0.5 if n in ("q", "k") else t) for n, t in x.items()}  # keep fp16 dots well inside range
    assert_match(run_pair(x, "lower_bound", dtype=torch.float16, l2norm=False), 5e-3, NAMES)


@interpreter_case
def test_half_precision_with_l2norm():
    """fp16 with the in-kernel L2 norm: every kernel takes raw q, k and their inverse norms (fp32), and the walk's
    qg / kgl are the forward's, kept in fp16."""
    x = make_inputs(1, 100, 2, 64, 32, seed=19)
    assert_match(run_pair(x, "lower_bound", dtype=torch.float16), 5e-3, NAMES)


@interpreter_case
def test_sequence_shorter_than_a_tile():
    assert_match(run_pair(make_inputs(1, 7, 2, 16, 16, seed=11), "lower_bound"), 1e-4, NAMES)


def test_chunk_layout_is_built_once_per_sequence_bounds():
    """The chunk layout (host-built, copied to the device) is shared by calls with the same bounds, so a
    model's KDA layers do not rebuild it every call; other bounds get their own."""
    from kimi_kernels.kda.chunk import chunk_meta

    first = chunk_meta((0, 130, 260), torch.device("cpu"))
    assert chunk_meta((0, 130, 260), torch.device("cpu")) is first
    other = chunk_meta((0, 100, 260), torch.device("cpu"))
    assert other is not first and other.chunk_len.tolist() == [64, 36, 64, 64, 32]
    assert first.chunk_start.tolist() == [0, 64, 128, 130, 194, 258] and first.seq_chunks.tolist() == [0, 3, 6]


@pytest.mark.parametrize("bound", [float("-inf"), float("nan"), 0.0, 0.5])
def test_bad_lower_bound_raises(bound):
    x = make_inputs(1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match=r"lower_bound must be a finite value < 0.0"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                  lower_bound=bound)


def test_dense_tiles_are_chosen_from_the_bound():
    """g_min >= -5 keeps the dense diagonal tiles; below, the per-position path, and safe_gate=True is refused."""
    from kimi_kernels.kda import dense_tiles_ok

    assert dense_tiles_ok(-5.0) and dense_tiles_ok(-0.5)
    assert not dense_tiles_ok(-5.01) and not dense_tiles_ok(-12.0) and not dense_tiles_ok(None)
    x = make_inputs(1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="safe_gate=True needs lower_bound >= -5.0"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                  lower_bound=-8.0, safe_gate=True)


@interpreter_case
@pytest.mark.parametrize("bound", [-8.0, -12.0])
def test_lower_bound_below_five_takes_the_per_position_path(bound):
    """g_min -8 / -12 (issue 32's sweep): batched, T = 100 across a chunk boundary, in-kernel gate, states."""
    x = make_inputs(2, 100, 2, 16, 32, seed=21)
    x["A_log"] = x["A_log"] + 1.0  # strong decays: many gates near the bound
    assert_match(run_pair(x, "lower_bound", lower_bound=bound), 1e-4, NAMES)


@interpreter_case
@pytest.mark.parametrize("bound", [-8.0, -12.0])
def test_saturated_gate_below_five_varlen(bound):
    """Every g at the bound (15 * 12 = 180 nats across a tile: the dense path would overflow): raw gate input
    deep in saturation, packed sequences of 30, 70 (crossing a chunk boundary) and 30 tokens."""
    x = make_inputs(1, 130, 1, 16, 16, N=3, seed=23)
    x["g"] = torch.full_like(x["g"], 40.0)
    x["A_log"] = torch.zeros_like(x["A_log"])
    cu = torch.tensor([0, 30, 100, 130])
    assert_match(run_pair(x, "lower_bound", cu_seqlens=cu, l2norm=False, lower_bound=bound), 1e-4,
                 ("q", "k", "v", "beta", "h0"))
    # the precomputed gate, every g = g_min: the default safe_gate (False) is exact. dg there is a sum of terms
    # that cancel (DESIGN.md: shift invariance); at -12 every fp32 evaluation loses digits: ours and the fp32
    # reference both differ from an fp64 token recurrence by 0.5% (measured 5.1e-3 and 5.2e-3), so dg gets
    # that bound and the rest the usual one
    x["g"] = torch.full_like(x["g"], bound)
    results = run_pair(x, "given", cu_seqlens=cu, l2norm=False)
    assert_match(results, 1e-4, ("q", "k", "v", "beta", "h0"))
    assert rel_err(results[0][2]["g"], results[1][2]["g"]) < 1e-2


def test_bad_shapes_raise():
    x = make_inputs(2, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"][..., None])
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=torch.tensor([0, 16]))


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("head_dim", [16, 128])  # 16 runs masked in a 32-wide K tile (Triton 3.6 sm_90 bug at 16)
def test_bf16_on_gpu_matches_fp32_reference(gate, head_dim):
    x = make_inputs(2, 300, 4, head_dim, head_dim, device="cuda")
    results = run_pair(x, gate, dtype=torch.bfloat16)
    assert_match(results, 1e-2, ("q", "k", "v", "beta", "h0"))
    # dg comes out of a reverse cumsum of terms that cancel (shift invariance of exp(G_t - G_s)); dA_log and
    # dt_bias sum it over every token. tools/bench_kda.py measured 0.7% on dg and 0.2-0.3% on the two
    # parameter gradients on the H200; the bounds leave room for other shapes, not for a broken reduction.
    (_, _, grads), (_, _, grads_ref) = results
    assert rel_err(grads["g"], grads_ref["g"]) < 3e-2
    for n in ("A_log", "dt_bias"):
        assert rel_err(grads[n], grads_ref[n]) < 5e-2, n


@pytest.mark.gpu
def test_bf16_sequence_first_gate_on_gpu_is_read_in_place():
    x = make_inputs(2, 300, 4, 128, 128, device="cuda")
    contiguous, _ = run_with_gate_layout(x, "lower_bound", sequence_first=False, dtype=torch.bfloat16)
    strided, (grad_stride, view_stride) = run_with_gate_layout(x, "lower_bound", sequence_first=True,
                                                                dtype=torch.bfloat16)
    assert grad_stride == view_stride
    for a, b in zip(strided, contiguous):
        assert torch.equal(a, b)  # the same kernels on the same values, only the gate's addresses differ


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [-3.0, -8.0, -12.0])
def test_bf16_on_gpu_sweep_bounds_match_fp32_reference(bound):
    """The g_min sweep's other bounds in bf16 (docs/gate_lower_bound.md): -3 on the dense diagonal path, -8 and
    -12 on the per-position one, strong decays so that many gates sit near the bound."""
    x = make_inputs(2, 300, 4, 64, 64, device="cuda", seed=31)
    x["A_log"] = x["A_log"] + 1.0
    results = run_pair(x, "lower_bound", dtype=torch.bfloat16, lower_bound=bound)
    assert_match(results, 1e-2, ("q", "k", "v", "beta", "h0"))
    (o, s, _), _ = results
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [16, 32, 64])
def test_bf16_walk_tiles_on_gpu_match_the_fp32_reference(block_v, monkeypatch):
    """Each V tile of the compiled state walks in bf16, D = 128, varlen: within bf16 error of the fp32 reference
    (the e2e layer at 16k walks in 16-wide tiles, at 4k in 32-wide ones, bench_kda's larger shapes in 64)."""
    import kimi_kernels.kda.chunk as chunk

    # 12 sequence-heads walk V = 128 in 96 / 48 / 24 programs of width 16 / 32 / 64: the SM count that makes
    # state_config take each tile
    monkeypatch.setattr(chunk, "_sm_count", lambda device: {16: 96, 32: 48, 64: 24}[block_v])
    assert chunk.state_config(3, 4, 128, "cuda")["BV"] == block_v
    x = make_inputs(1, 3000, 4, 128, 128, N=3, device="cuda", seed=4)
    cu = torch.tensor([0, 2100, 2150, 3000], device="cuda")
    assert_match(run_pair(x, "lower_bound", dtype=torch.bfloat16, cu_seqlens=cu), 1e-2, ("q", "k", "v", "beta", "h0"))


@pytest.mark.gpu
def test_bf16_on_gpu_matches_fla():
    fla_kda = pytest.importorskip("fla.ops.kda")
    x = make_inputs(2, 300, 4, 128, 128, device="cuda")
    args = [x[n].to(torch.bfloat16) for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0)
    o, s = chunk_kda(*args, **kw)
    o_fla, s_fla = fla_kda.chunk_kda(*args, safe_gate=True, **kw)
    assert rel_err(o, o_fla) < 1e-2 and rel_err(s, s_fla) < 1e-2
