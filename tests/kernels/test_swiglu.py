"""Fused SwiGLU: Triton kernels vs the PyTorch reference (CPU: Triton interpreter, fp32/fp16, in a subprocess
started by ``test_cases_under_interpreter``; GPU: bf16 against fp32)."""

import pytest
import torch
import torch.nn.functional as F

from kimi_kernels.swiglu import swiglu, swiglu_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


def make_case(shape, dtype, seed=0, device="cpu"):
    """h of ``shape`` (last dim 2f) and a cotangent for the output ``[..., f]``."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(shape, generator=g) * 3).to(dtype)
    cotangent = torch.randn(*shape[:-1], shape[-1] // 2, generator=g)
    return h.to(device), cotangent.to(device)


def run(h, cotangent, use_kernel):
    """(y, dh) through ``swiglu``."""
    hh = h.clone().requires_grad_()
    y = swiglu(hh, use_kernel=use_kernel)
    (y.float() * cotangent).sum().backward()
    return y, hh.grad


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


# f off the tiles (96 -> 128-column tiles, 1000 not a multiple of 16), at the model's f = 1024 and past one
# column block (2048 = two of 1024); row counts off the row tiles (32 / 16 rows at f = 96, 4 / 2 at f = 1024);
# 1-D, 2-D and 3-D inputs.
SHAPES = [(37, 192), (5, 2048), (3, 7, 192), (9, 2000), (3, 4096), (2, 3, 2048), (64,)]


@interpreter_case
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference_fp32(shape):
    h, cotangent = make_case(shape, torch.float32, seed=shape[-1])
    ours, ref = run(h, cotangent, use_kernel=True), run(h, cotangent, use_kernel=False)
    for a, b, name in zip(ours, ref, ("y", "dh")):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        assert rel_err(a, b) < 1e-5, name


@interpreter_case
@pytest.mark.parametrize("shape", [(37, 192), (5, 2048), (9, 2000)], ids=str)
def test_kernel_fp16_computes_in_fp32(shape):
    """fp16 h against the fp32 reference on the same rounded inputs (y and dh rounded to fp16 once), and
    against the reference in fp16 (which also computes in fp32 and rounds once)."""
    h, cotangent = make_case(shape, torch.float16, seed=1)
    ours = run(h, cotangent, use_kernel=True)
    assert ours[0].dtype == ours[1].dtype == torch.float16
    for a, b, name in zip(ours, run(h.float(), cotangent, use_kernel=False), ("y", "dh")):
        assert rel_err(a, b) < 2e-3, name
    for a, b, name in zip(ours, run(h, cotangent, use_kernel=False), ("y", "dh")):
        assert rel_err(a, b) < 1e-3, name


@interpreter_case
def test_non_contiguous_input_and_no_rows():
    h, cotangent = make_case((8, 5, 192), torch.float32, seed=4)
    ht, ct = h.transpose(0, 1), cotangent.transpose(0, 1)  # [5, 8, 192] strided
    ours, ref = run(ht, ct, use_kernel=True), run(ht, ct, use_kernel=False)
    for a, b, name in zip(ours, ref, ("y", "dh")):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5, name
    for shape in [(0, 128), (0, 3, 2048)]:
        y, dh = run(*make_case(shape, torch.float32, seed=5), use_kernel=True)
        assert y.shape == (*shape[:-1], shape[-1] // 2) and dh.shape == shape


def test_reference_is_the_cpu_default():
    h, _ = make_case((4, 3, 40), torch.float32)
    assert torch.equal(swiglu(h), swiglu_reference(h))


def test_reference_equals_the_definition():
    """The reference computes in fp32 whatever h's dtype: compare with the definition in fp64, and its
    gradient with the closed form the kernel uses."""
    h, cotangent = make_case((5, 48), torch.float32)
    h64, c64 = h.double(), cotangent.double()
    a, b = h64[:, :24], h64[:, 24:]
    s = 1 / (1 + (-a).exp())
    close = dict(rtol=1e-5, atol=1e-6)
    y, dh = run(h, cotangent, use_kernel=False)
    torch.testing.assert_close(y.double(), a * s * b, **close)
    torch.testing.assert_close(dh.double(), torch.cat([c64 * b * s * (1 + a * (1 - s)), c64 * a * s], -1), **close)
    # fp32 h: exactly the ops experts.py ran before the kernel.
    x, y = h.chunk(2, -1)
    assert torch.equal(swiglu_reference(h), F.silu(x) * y)


@pytest.mark.parametrize("shape,match", [
    ((4, 15), r"last dim must be 2f with f > 0.*got 15"),
    ((4, 0), r"last dim must be 2f with f > 0.*got 0"),
    ((), r"h must be \[\.\.\., 2f\] \(at least 1-D\)"),
])
def test_bad_shapes_are_refused(shape, match):
    for use_kernel in (True, False):
        with pytest.raises(ValueError, match=match):
            swiglu(torch.randn(shape), use_kernel=use_kernel)


def test_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match="fp32/fp16/bf16 h, got torch.float64"):
        swiglu(torch.randn(4, 16).double(), use_kernel=True)
    # The reference takes any floating dtype (fp64 stays fp64).
    assert swiglu(torch.randn(4, 16).double()).dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048), (2, 301, 2000), (0, 2048)], ids=str)
def test_gpu_bf16_matches_fp32_reference(shape):
    h, cotangent = make_case(shape, torch.bfloat16, device="cuda")
    ours = run(h, cotangent, use_kernel=None)  # CUDA: the kernel by default
    ref = run(h.float(), cotangent, use_kernel=False)
    assert ours[0].dtype == ours[1].dtype == torch.bfloat16
    if not h.shape[0]:
        return
    # y and dh are rounded to bf16 once (relative 2^-8).
    for a, b, name in zip(ours, ref, ("y", "dh")):
        assert rel_err(a, b) < 1e-2, name
