"""The fused AdamW kernel compiles for Hopper (sm_90) without a GPU and spills nothing (bf16 model copy; fp32 or
bf16 gradient; the clip coefficient as a number or read from device memory)."""

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs the compiling JIT, not the interpreter")


@pytest.mark.parametrize("scale_in_memory", [False, True])  # a number, or the norm left on the device
@pytest.mark.parametrize("grad", ["*fp32", "*bf16"])  # Megatron's fp32 main grads, or bf16 ones
def test_kernel_compiles_for_hopper_without_spills(grad, scale_in_memory):
    from kimi_kernels._compile_check import compile_for, resources
    from kimi_kernels.adamw import fused

    kernel = fused.adamw_step_kernel
    constexprs = dict(HAS_MODEL=True, SCALE_IN_MEMORY=scale_in_memory, BLOCK=fused.BLOCK)
    kinds = dict(grad=grad, model_param="*bf16", n="i64", lr="fp32", beta1="fp32", beta2="fp32", eps="fp32",
                 weight_decay="fp32", grad_scale="*fp32" if scale_in_memory else "fp32")
    signature = {a: kinds.get(a, "*fp32") for a in kernel.arg_names if a not in constexprs}
    used = resources(compile_for(kernel, signature, constexprs, num_warps=fused.NUM_WARPS))
    assert used.spill_stores == 0 and used.spill_loads == 0, used


@pytest.mark.parametrize("scale_in_memory", [False, True])
@pytest.mark.parametrize("grad", ["bfloat16", "float32"])
def test_multi_step_kernel_compiles_for_hopper_without_spills(grad, scale_in_memory):
    """The one-launch-per-list kernel: pointers read from its table, the same update."""
    import triton.language as tl

    from kimi_kernels._compile_check import compile_for, resources
    from kimi_kernels.adamw import fused

    kernel = fused.adamw_multi_step_kernel
    constexprs = dict(GRAD_DTYPE=getattr(tl, grad), MODEL_DTYPE=tl.bfloat16, HAS_MODEL=True,
                      SCALE_IN_MEMORY=scale_in_memory, COLUMNS=fused.TABLE_COLUMNS, BLOCK=fused.BLOCK)
    kinds = dict(table="*i64", block_tensor="*i32", block_start="*i64",
                 grad_scale="*fp32" if scale_in_memory else "fp32")
    signature = {a: kinds.get(a, "fp32") for a in kernel.arg_names if a not in constexprs}
    used = resources(compile_for(kernel, signature, constexprs, num_warps=fused.NUM_WARPS))
    assert used.spill_stores == 0 and used.spill_loads == 0, used
