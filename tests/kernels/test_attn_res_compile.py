"""The depth-attention kernels compile for Hopper (sm_90) on a machine without a GPU."""

import os

import pytest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
def test_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter accepts code the compiler may not; compile both kernels for sm_90
    # (frontend to cubin with triton's bundled ptxas), as the GPU run would.
    import kernels.attn_res.fused as fused
    from kernels._compile_check import compile_for

    n, hidden = 3, 48
    cfg = fused.launch_config(hidden, fused.FORWARD_TILE_ELEMENTS)
    common = {"src_ptrs": ("*bf16",) * n, "query_ptr": "*fp32", "norm_weight_ptr": "*fp32"}
    signatures = {
        fused._depth_attention_fwd_kernel: {"out_ptr": "*bf16", "T": "i32", "H": "i32", "eps": "fp32"},
        fused._depth_attention_bwd_kernel: {
            "grad_out_ptr": "*bf16", "grad_src_ptr": "*bf16", "partial_g_ptr": "*fp32",
            "T": "i32", "H": "i32", "source_stride": "i32", "eps": "fp32",
        },
    }
    constexprs = {"N": n, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h}
    for kernel, extra in signatures.items():
        compiled = compile_for(kernel, {**common, **extra}, constexprs, num_warps=cfg.num_warps)
        assert "cubin" in compiled.asm
