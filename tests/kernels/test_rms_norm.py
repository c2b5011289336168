"""Fused RMSNorm (and the gated variant): Triton kernels vs the PyTorch reference (CPU: Triton interpreter,
fp32/fp16, in a subprocess started by ``test_cases_under_interpreter``; GPU: bf16 against fp32)."""

import pytest
import torch

from kimi_kernels.rms_norm import gated_rms_norm_reference, rms_norm, rms_norm_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)

EPS = 1e-5


def make_case(shape, dtype, weight_dtype=torch.float32, gated=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.5 + 1).to(weight_dtype)
    gate = (torch.randn(shape, generator=g) * 2).to(dtype) if gated else None
    cotangent = torch.randn(shape, generator=g)
    return [t.to(device) if t is not None else None for t in (x, weight, gate, cotangent)]


def run(x, weight, gate, cotangent, use_kernel):
    """(y, dx, dweight[, dgate]) through ``rms_norm``."""
    xx, ww = x.clone().requires_grad_(), weight.clone().requires_grad_()
    gg = gate.clone().requires_grad_() if gate is not None else None
    y = rms_norm(xx, ww, EPS, gate=gg, use_kernel=use_kernel)
    (y.float() * cotangent).sum().backward()
    return (y, xx.grad, ww.grad) + ((gg.grad,) if gg is not None else ())


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


NAMES = ("y", "dx", "dweight", "dgate")
# h off and on powers of two (48 -> 64-column tiles, 2050 -> 4096); row counts off the row tiles (32 / 16
# rows at h <= 128, 2 / 1 at h = 2048) and over the CPU's 3 backward programs; 2-D and 3-D inputs.
SHAPES = [(37, 48), (5, 7, 48), (100, 128), (3, 11, 128), (9, 2048), (2, 3, 2048), (7, 2050)]


@interpreter_case
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference_fp32(shape, gated):
    case = make_case(shape, torch.float32, gated=gated, seed=shape[-1])
    ours, ref = run(*case, use_kernel=True), run(*case, use_kernel=False)
    assert len(ours) == len(ref) == (4 if gated else 3)
    for a, b, name in zip(ours, ref, NAMES):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-5, name


@interpreter_case
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16], ids=["w_fp32", "w_fp16"])
@pytest.mark.parametrize("shape", [(37, 48), (3, 11, 128), (9, 2048), (7, 2050)], ids=str)
def test_kernel_fp16_computes_in_fp32(shape, weight_dtype, gated):
    """fp16 x (and gate), the weight in fp32 or fp16, against the fp32 reference on the same rounded inputs:
    y, dx and dgate are rounded to fp16 once; dweight is summed in fp32 and comes back in the weight's
    dtype."""
    x, weight, gate, cotangent = make_case(shape, torch.float16, weight_dtype, gated, seed=1)
    ours = run(x, weight, gate, cotangent, use_kernel=True)
    ref = run(x.float(), weight.float(), gate.float() if gated else None, cotangent, use_kernel=False)
    assert ours[0].dtype == ours[1].dtype == torch.float16 and ours[2].dtype == weight_dtype
    if gated:
        assert ours[3].dtype == torch.float16
    for a, b, name in zip(ours, ref, NAMES):
        assert rel_err(a, b) < 2e-3, name


@interpreter_case
def test_gated_kernel_against_the_layer_reference_in_fp16():
    """The gated reference rounds the norm to fp16 before gating (as the KDA layer did); the kernel rounds
    once: the two differ by about one fp16 rounding."""
    x, weight, gate, _ = make_case((6, 4, 128), torch.float16, torch.float16, gated=True, seed=2)
    ours = rms_norm(x, weight, EPS, gate=gate, use_kernel=True)
    assert rel_err(ours, gated_rms_norm_reference(x, weight, EPS, gate)) < 2e-3


@interpreter_case
def test_widest_row_and_one_row():
    for shape in [(3, 16384), (1, 2048), (1, 7, 128)]:
        case = make_case(shape, torch.float32, gated=shape[-1] == 16384, seed=3)
        ours, ref = run(*case, use_kernel=True), run(*case, use_kernel=False)
        for a, b, name in zip(ours, ref, NAMES):
            assert rel_err(a, b) < 1e-5, (shape, name)


@interpreter_case
def test_non_contiguous_inputs_and_no_rows():
    x, weight, gate, cotangent = make_case((8, 5, 128), torch.float32, gated=True, seed=4)
    xt, gt, ct = x.transpose(0, 1), gate.transpose(0, 1), cotangent.transpose(0, 1)  # [5, 8, 128] strided
    ours, ref = run(xt, weight, gt, ct, use_kernel=True), run(xt, weight, gt, ct, use_kernel=False)
    for a, b, name in zip(ours, ref, NAMES):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5, name
    empty = make_case((0, 3, 64), torch.float32, seed=5)
    y, dx, dw = run(*empty, use_kernel=True)
    assert y.shape == dx.shape == (0, 3, 64) and torch.equal(dw, torch.zeros(64))


@interpreter_case
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_token_strided_x_is_read_in_place(gated):
    """The KDA layer's case: o [b, s, H, V] normalised as [s, b, H, V] against a contiguous gate: y comes out
    contiguous, dx in x's own layout (a transposed view back in [b, s] is contiguous), values as the reference."""
    x_bs, weight, gate, cotangent = make_case((3, 37, 4, 48), torch.float32, gated=gated, seed=7)
    x = x_bs.transpose(0, 1)
    gate = gate.transpose(0, 1).contiguous() if gated else None
    cotangent = cotangent.transpose(0, 1).contiguous()
    ours, ref = run(x, weight, gate, cotangent, use_kernel=True), run(x, weight, gate, cotangent, use_kernel=False)
    for a, b, name in zip(ours, ref, NAMES):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5, name
    y, dx = ours[0], ours[1]
    assert y.is_contiguous() and dx.stride() == x.stride() and dx.transpose(0, 1).is_contiguous()


@interpreter_case
def test_overlapping_or_inner_strided_x_is_copied_first():
    base, weight, _, cotangent = make_case((6, 5, 2, 32), torch.float32, seed=8)
    sliced = base[:, :, :, ::2]  # inner dim strided: copied, then as any contiguous x
    ours = run(sliced, weight[:16], None, cotangent[..., :16], use_kernel=True)
    ref = run(sliced, weight[:16], None, cotangent[..., :16], use_kernel=False)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(ours, ref))
    expanded = base[:1].expand(4, 5, 2, 32)  # tokens overlap (stride 0): must not be written through in place
    ours = run(expanded, weight, None, cotangent[:4], use_kernel=True)
    ref = run(expanded, weight, None, cotangent[:4], use_kernel=False)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(ours, ref))


@interpreter_case
def test_backward_is_deterministic():
    case = make_case((200, 128), torch.float32, gated=True, seed=6)
    first, second = run(*case, use_kernel=True), run(*case, use_kernel=True)
    for a, b, name in zip(first, second, NAMES):
        assert torch.equal(a, b), name


def test_reference_is_the_cpu_default_and_the_layer_function():
    from megatron_ext.layers.norm import rms_norm as layer_rms_norm

    x, weight, gate, _ = make_case((4, 3, 40), torch.float32, gated=True)
    assert torch.equal(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    assert torch.equal(layer_rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    assert torch.equal(rms_norm(x, weight, EPS, gate=gate), gated_rms_norm_reference(x, weight, EPS, gate))


def test_reference_equals_the_definition():
    """The reference computes in fp32 whatever x's dtype: compare with the definition in fp64."""
    x, weight, gate, _ = make_case((5, 24), torch.float32, gated=True)
    x64, w64, g64 = x.double(), weight.double(), gate.double()
    rms = (x64.pow(2).sum(-1, keepdim=True) / x.shape[-1] + EPS).sqrt()
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_norm_reference(x, weight, EPS).double(), x64 / rms * w64, **close)
    torch.testing.assert_close(gated_rms_norm_reference(x, weight, EPS, gate).double(),
                               x64 / rms * w64 / (1 + (-g64).exp()), **close)


@pytest.mark.parametrize("x_shape,w_shape,g_shape,match", [
    ((4, 16), (12,), None, r"weight must be \[h\] with h = 16"),
    ((4, 16), (16, 1), None, r"weight must be \[h\]"),
    ((4, 16), (16,), (4, 8), r"gate must have x's shape \(4, 16\)"),
    ((), (1,), None, r"x must be \[\.\.\., h\]"),
    ((4, 0), (0,), None, r"x must be \[\.\.\., h\] with h > 0"),
    ((2, 16385), (16385,), None, r"h <= 16384"),
])
def test_bad_shapes_are_refused(x_shape, w_shape, g_shape, match):
    gate = torch.randn(g_shape) if g_shape is not None else None
    with pytest.raises(ValueError, match=match):
        rms_norm(torch.randn(x_shape), torch.randn(w_shape), EPS, gate=gate, use_kernel=True)


def test_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match="weight fp32 or x's dtype"):
        rms_norm(torch.randn(4, 16).half(), torch.randn(16).bfloat16(), EPS, use_kernel=True)
    with pytest.raises(ValueError, match="x must be fp32/fp16/bf16"):
        rms_norm(torch.randn(4, 16).double(), torch.randn(16), EPS, use_kernel=True)
    with pytest.raises(ValueError, match="gate must be fp32 or x's dtype"):
        rms_norm(torch.randn(4, 16).half(), torch.randn(16), EPS, gate=torch.randn(4, 16).bfloat16(),
                 use_kernel=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("shape", [(4096, 2, 2048), (2, 1000, 16, 128), (301, 2050), (64, 16384)], ids=str)
def test_gpu_bf16_matches_fp32_reference(shape, gated):
    x, weight, gate, cotangent = make_case(shape, torch.bfloat16, gated=gated, device="cuda")
    ours = run(x, weight, gate, cotangent, use_kernel=None)  # CUDA: the kernel by default
    ref = run(x.float(), weight, gate.float() if gated else None, cotangent, use_kernel=False)
    assert ours[0].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    # y, dx, dgate are rounded to bf16 once (relative 2^-8); dweight sums fp32 products of bf16 inputs.
    for a, b, name in zip(ours, ref, NAMES):
        assert rel_err(a, b) < 1e-2, name
    again = run(x, weight, gate, cotangent, use_kernel=None)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))  # deterministic dweight (no atomics)
