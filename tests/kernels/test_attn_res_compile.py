"""The depth-attention kernels compile for Hopper (sm_90) on a machine without a GPU."""

import os

import pytest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("norm_out", [False, True], ids=["mix", "mix+rmsnorm"])
def test_kernels_compile_for_hopper_without_a_gpu(norm_out):
    # The interpreter accepts code the compiler may not; compile both kernels for sm_90
    # (frontend to cubin with triton's bundled ptxas), as the GPU run would, without and with
    # the consumer's RMSNorm fused in (NORM_OUT).
    import kernels.attn_res.fused as fused
    from kernels._compile_check import compile_for, resources

    for n, hidden in ((3, 48), (9, 2048)):  # (9, 2048): the benchmark's widest call
        common = {
            "src_ptrs": ("*bf16",) * n, "query_ptr": "*fp32", "norm_weight_ptr": "*fp32",
            "out_norm_weight_ptr": "*bf16", "out_rstd_ptr": "*fp32", "T": "i32", "H": "i32", "eps": "fp32",
            "out_norm_eps": "fp32",
        }
        signatures = {
            fused._depth_attention_fwd_kernel: (
                {"out_ptr": "*bf16", "lse_ptr": "*fp32", "normed_ptr": "*bf16"},
                {"FUSE_REDUCTIONS": fused.FORWARD_FUSE_REDUCTIONS, "NORM_OUT": norm_out},
                fused.FORWARD_TILE_ELEMENTS,
            ),
            fused._depth_attention_bwd_kernel: (
                {
                    "grad_ptrs": ("*bf16",) * n, "out_ptr": "*bf16", "grad_out_ptr": "*bf16", "lse_ptr": "*fp32",
                    "partial_g_ptr": "*fp32", "partial_g_out_norm_ptr": "*fp32",
                },
                {"ACCUMULATE": (1 << n) - 2, "FUSE_REDUCTIONS": fused.BACKWARD_FUSE_REDUCTIONS,
                 "PREFETCH": fused.BACKWARD_PREFETCH, "NORM_OUT": norm_out},
                None,
            ),
        }
        for kernel, (extra, flags, tile) in signatures.items():
            cfg = fused.launch_config(hidden, tile) if tile else fused.backward_launch_config(hidden, norm_out)
            constexprs = {"N": n, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h, **flags}
            compiled = compile_for(kernel, {**common, **extra}, constexprs, num_warps=cfg.num_warps)
            assert "cubin" in compiled.asm
            used = resources(compiled)
            assert used.spill_stores == 0 and used.spill_loads == 0, (kernel.__name__, n, hidden, used)
            if hidden == 2048:  # at least 16 warps per SM (2 programs of 8 or 1 of 16)
                assert used.registers <= 128, (kernel.__name__, n, hidden, used)
                if norm_out and kernel is fused._depth_attention_bwd_kernel:
                    assert cfg.num_warps == 16 and used.registers <= 96, (cfg, used)
