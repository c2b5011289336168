"""The MoE combine kernels compile for Hopper (sm_90) without a GPU and spill nothing (launch config of
kimi_kernels/moe_combine/fused.py, bf16 rows, top-8)."""

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs the compiling JIT, not the interpreter")


@pytest.mark.parametrize("name", ["combine_fwd_kernel", "combine_bwd_kernel"])
def test_kernels_compile_for_hopper_without_spills(name):
    """bf16 rows, fp32 gates, int64 source, top-8: the launch config of fused.py."""
    from kimi_kernels._compile_check import compile_for, resources
    from kimi_kernels.moe_combine import fused

    kernel = getattr(fused, name)
    config = fused.FWD_CONFIG if name == "combine_fwd_kernel" else fused.BWD_CONFIG
    constexprs = dict(TOPK=8, BN=config["BN"], BH=config["BH"])
    kinds = dict(gates="*fp32", d_gates="*fp32", source="*i64", N="i32", M="i32", H="i32")
    signature = {a: kinds.get(a, "*bf16") for a in kernel.arg_names if a not in constexprs}
    used = resources(compile_for(kernel, signature, constexprs, num_warps=config["num_warps"]))
    assert used.spill_stores == 0 and used.spill_loads == 0, used
