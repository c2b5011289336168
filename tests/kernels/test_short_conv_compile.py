"""The short-conv kernels compile for Hopper (sm_90) without a GPU and spill nothing (launch config of
kernels/short_conv/fused.py, bf16 activations, fp32 weight), up to the largest kernel size accepted."""

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs the compiling JIT, not the interpreter")


@pytest.mark.parametrize("kernel_size", [4, 8])
@pytest.mark.parametrize("name", ["conv_fwd_kernel", "conv_bwd_kernel"])
def test_kernels_compile_for_hopper_without_spills(name, kernel_size):
    import triton

    from kernels._compile_check import compile_for, resources
    from kernels.short_conv import MAX_KERNEL_SIZE, fused

    assert kernel_size <= MAX_KERNEL_SIZE
    kernel = getattr(fused, name)
    config = dict(fused.FWD_CONFIG if name == "conv_fwd_kernel" else fused.BWD_CONFIG)
    num_warps = config.pop("num_warps")
    constexprs = dict(K=kernel_size, **config)
    if name == "conv_bwd_kernel":
        constexprs["KP"] = triton.next_power_of_2(kernel_size)
    kinds = dict(w="*fp32", dw_part="*fp32", S="i32", B="i32", C="i32")
    signature = {a: kinds.get(a, "*bf16") for a in kernel.arg_names if a not in constexprs}
    used = resources(compile_for(kernel, signature, constexprs, num_warps=num_warps))
    assert used.spill_stores == 0 and used.spill_loads == 0, used
