"""The RMSNorm kernels compile for Hopper (sm_90) without a GPU and spill nothing at the model's row widths
(h = 2048: the hidden norms; h = 128: the KDA head norm), with and without the gate (launch config of
kimi_kernels/rms_norm/fused.py, bf16 activations, fp32 weight)."""

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs the compiling JIT, not the interpreter")


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous_x", "token_strided_x"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("hidden", [2048, 128])
@pytest.mark.parametrize("name", ["rms_norm_fwd_kernel", "rms_norm_bwd_kernel"])
def test_kernels_compile_for_hopper_without_spills(name, hidden, gated, strided):
    from kimi_kernels._compile_check import compile_for, resources
    from kimi_kernels.rms_norm import fused

    kernel = getattr(fused, name)
    config = fused.launch_config(hidden, backward=name == "rms_norm_bwd_kernel", x_strided=strided)
    num_warps = config.pop("num_warps")
    constexprs = dict(HAS_GATE=gated, X_STRIDED=strided, **config)
    kinds = dict(weight="*fp32", rstd="*fp32", dw_part="*fp32", M="i32", N="i32", eps="fp32", x_d1="i32",
                 x_rows_per_token="i32", x_s0="i32", x_s1="i32")
    signature = {a: kinds.get(a, "*bf16") for a in kernel.arg_names if a not in constexprs}
    used = resources(compile_for(kernel, signature, constexprs, num_warps=num_warps))
    assert used.spill_stores == 0 and used.spill_loads == 0, used
    assert used.registers <= 128, used  # at least 2 programs' worth of threads per SM
