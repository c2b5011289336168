"""The SwiGLU kernels compile for Hopper (sm_90) without a GPU and spill nothing at the model's f = 1024 and
at a narrow f = 96 (launch config of kimi_kernels/swiglu/fused.py, bf16 h), both with f a multiple of 16 and
16-byte aligned tensors (vectorized loads, as the launcher specializes them: one 16-byte access per thread
and tensor half) and without (one address per element)."""

import os
import re

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs the compiling JIT, not the interpreter")


def compile_swiglu(name, f, aligned):
    from kimi_kernels._compile_check import compile_for
    from kimi_kernels.swiglu import fused

    kernel = getattr(fused, name)
    config = fused.launch_config(f, backward=name == "swiglu_bwd_kernel")
    num_warps = config.pop("num_warps")
    signature = {a: ("i32" if a in ("M", "F") else "*bf16") for a in kernel.arg_names if a not in config}
    divisible = [a for a in signature if a != "M"] if aligned else []
    return compile_for(kernel, signature, config, num_warps=num_warps, aligned=divisible)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("f", [1024, 96])
@pytest.mark.parametrize("name", ["swiglu_fwd_kernel", "swiglu_bwd_kernel"])
def test_kernels_compile_for_hopper_without_spills(name, f, aligned):
    from kimi_kernels._compile_check import resources

    used = resources(compile_swiglu(name, f, aligned))
    assert used.spill_stores == 0 and used.spill_loads == 0, used
    assert used.registers <= 64, used  # an elementwise kernel: full occupancy (2048 threads per SM)


@pytest.mark.parametrize("name", ["swiglu_fwd_kernel", "swiglu_bwd_kernel"])
def test_aligned_rows_use_16_byte_accesses(name):
    """f a multiple of 16: every global load and store of bf16 h, dout, out and dh is 16 bytes (v4.b32)."""
    ptx = compile_swiglu(name, 1024, aligned=True).asm["ptx"]
    accesses = re.findall(r"(?:ld|st)\.global[.\w]*", ptx)
    assert accesses and all(".v4.b32" in op for op in accesses), sorted(set(accesses))
