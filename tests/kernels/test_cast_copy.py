"""Widening copy: the Triton kernel (CPU: Triton interpreter, in a subprocess started by
``test_cases_under_interpreter``; GPU: bf16) equals torch's copy_ bit for bit (widening is exact)."""

import pytest
import torch

from kimi_kernels.cast_copy import widening_copy_
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


@interpreter_case
@pytest.mark.parametrize("n", [1, 4095, 4096, 10_000])  # one element, a tile edge, several tiles
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_equals_torch_copy(n, dtype):
    src = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    dst = torch.full((n,), 7.0)
    widening_copy_(dst, src, use_kernel=True)
    assert torch.equal(dst, src.float())


def test_small_and_cpu_tensors_take_torch_copy():
    src = torch.randn(3, 5).bfloat16()
    dst = torch.empty(3, 5)
    assert widening_copy_(dst, src) is dst and torch.equal(dst, src.float())


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        widening_copy_(torch.empty(4), torch.randn(5).bfloat16(), use_kernel=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu_equals_torch_copy():
    src = torch.randn(3_000_001, device="cuda").bfloat16()
    dst = torch.empty(3_000_001, device="cuda")
    widening_copy_(dst, src)
    assert torch.equal(dst, src.float())
