"""The depth-attention kernels compile for Hopper (sm_90) on a machine without a GPU."""

import os

import pytest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
def test_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter accepts code the compiler may not; compile both kernels for sm_90
    # (frontend to cubin with triton's bundled ptxas), as the GPU run would.
    import kernels.attn_res.fused as fused
    from kernels._compile_check import compile_for, resources

    for n, hidden in ((3, 48), (9, 2048)):  # (9, 2048): the benchmark's widest call
        common = {"src_ptrs": ("*bf16",) * n, "query_ptr": "*fp32", "norm_weight_ptr": "*fp32"}
        signatures = {
            fused._depth_attention_fwd_kernel: (
                {"out_ptr": "*bf16", "lse_ptr": "*fp32", "T": "i32", "H": "i32", "eps": "fp32"},
                {"FUSE_REDUCTIONS": fused.FORWARD_FUSE_REDUCTIONS},
                fused.FORWARD_TILE_ELEMENTS,
            ),
            fused._depth_attention_bwd_kernel: (
                {
                    "grad_ptrs": ("*bf16",) * n, "out_ptr": "*bf16", "grad_out_ptr": "*bf16", "lse_ptr": "*fp32",
                    "partial_g_ptr": "*fp32", "T": "i32", "H": "i32", "eps": "fp32",
                },
                {"ACCUMULATE": (1 << n) - 2, "FUSE_REDUCTIONS": fused.BACKWARD_FUSE_REDUCTIONS,
                 "PREFETCH": fused.BACKWARD_PREFETCH},
                fused.BACKWARD_TILE_ELEMENTS,
            ),
        }
        for kernel, (extra, flags, tile) in signatures.items():
            cfg = fused.launch_config(hidden, tile)
            constexprs = {"N": n, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h, **flags}
            compiled = compile_for(kernel, {**common, **extra}, constexprs, num_warps=cfg.num_warps)
            assert "cubin" in compiled.asm
            used = resources(compiled)
            assert used.spill_stores == 0 and used.spill_loads == 0, (kernel.__name__, n, hidden, used)
            if hidden == 2048:  # at least 2 programs of 8 warps per SM
                assert used.registers <= 128, (kernel.__name__, n, hidden, used)
