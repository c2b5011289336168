"""The depth-attention kernels compile for Hopper (sm_90) on a machine without a GPU."""

import os

import pytest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("norm_out", [False, True], ids=["mix", "mix+rmsnorm"])
def test_kernels_compile_for_hopper_without_a_gpu(norm_out):
    # The interpreter accepts code the compiler may not; compile the forward for sm_90 (frontend to cubin with
    # triton's bundled ptxas) at its shipped launch (fused.FORWARD_LAUNCH), as the GPU run would, without and with
    # the consumer's RMSNorm fused in (NORM_OUT). The backward: test_preload_backward_compiles_*.
    import kimi_kernels.attn_res.fused as fused
    from kimi_kernels._compile_check import compile_for, resources

    for n, hidden in ((3, 48), (9, 2048)):  # (9, 2048): the benchmark's widest call
        signature = {
            "src_ptrs": ("*bf16",) * n, "query_ptr": "*fp32", "norm_weight_ptr": "*fp32", "out_ptr": "*bf16",
            "lse_ptr": "*fp32", "out_norm_weight_ptr": "*bf16", "normed_ptr": "*bf16", "out_rstd_ptr": "*fp32",
            "T": "i32", "H": "i32", "eps": "fp32", "out_norm_eps": "fp32",
        }
        cfg = fused.FORWARD_LAUNCH.for_call(hidden, n)
        constexprs = {"N": n, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h, "NORM_OUT": norm_out, "PACK": True,
                      "BATCH": cfg.batch}
        # aligned pointers and H as the launcher specialises them at h = 2048 (vectorised loads)
        aligned = [name for name in _ALIGNED + ("normed_ptr",) if name in signature] if hidden == 2048 else ()
        compiled = compile_for(fused._depth_attention_fwd_kernel, signature, constexprs, num_warps=cfg.num_warps,
                               aligned=aligned, maxnreg=cfg.maxnreg)  # capped as the launcher caps it
        assert "cubin" in compiled.asm
        used = resources(compiled)
        # the capped forward at n = 9 spills 96 bytes (Triton 3.8; 11-20% faster on the H200 all the same)
        max_spill = 128 if cfg.maxnreg else 0
        assert used.spill_stores <= max_spill and used.spill_loads <= max_spill, (n, hidden, used)
        if hidden == 2048:  # at least 16 warps per SM (4 programs of 4 warps)
            assert used.registers <= 128, (n, hidden, used)


_PRELOAD_SIGNATURE = {
    "query_ptr": "*fp32", "norm_weight_ptr": "*fp32", "out_ptr": "*bf16", "grad_out_ptr": "*bf16", "lse_ptr": "*fp32",
    "partial_g_ptr": "*fp32", "out_norm_weight_ptr": "*fp32", "out_rstd_ptr": "*fp32",
    "partial_g_out_norm_ptr": "*fp32", "query2_ptr": "*fp32", "norm_weight2_ptr": "*fp32", "grad_mix2_ptr": "*bf16",
    "c2_ptr": "*fp32", "lse2_ptr": "*fp32", "partial_g2_ptr": "*fp32", "handoff_grad_ptr": "*bf16",
    "handoff_c_ptr": "*fp32", "T": "i32", "H": "i32", "eps": "fp32", "out_norm_eps": "fp32",
}
# Pointers 16-byte aligned and H a multiple of 16, as the launcher specialises them at h = 2048
# (without it the loads are scalar and each element's 64-bit address takes registers).
_ALIGNED = ("src_ptrs", "grad_ptrs", "out_ptr", "grad_out_ptr", "grad_mix2_ptr", "handoff_grad_ptr", "query_ptr",
            "norm_weight_ptr", "query2_ptr", "norm_weight2_ptr", "out_norm_weight_ptr", "partial_g_ptr",
            "partial_g2_ptr", "partial_g_out_norm_ptr", "H")


def _compile_preload(n, maxnreg=None, out_ptr="*bf16", **changes):
    """The backward compiled for sm_90 at h = 2048 with n sources, every source accumulated, the norm fused,
    unpaired, pointers aligned as the launcher specialises them, the shipped launch (``fused.BACKWARD_LAUNCH``)
    except for ``changes`` (constexprs): (compiled kernel, its resources, launch)."""
    import kimi_kernels.attn_res.fused as fused
    from kimi_kernels._compile_check import compile_for, resources

    cfg = fused.BACKWARD_LAUNCH.for_call(2048, n, changes.get("SUBSET", False), changes.get("HANDOFF", False))
    signature = {**_PRELOAD_SIGNATURE, "src_ptrs": ("*bf16",) * n, "grad_ptrs": ("*bf16",) * n, "out_ptr": out_ptr}
    constexprs = {"N": n, "ACCUMULATE": (1 << n) - 1, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h,
                  "NORM_OUT": True, "SUBSET": False, "PAIRED": 0, "HANDOFF": False, "OUT_NORM_GRAD": True,
                  "PACK": True, "BATCH": cfg.batch, **changes}
    compiled = compile_for(fused._depth_attention_bwd_preload_kernel, signature, constexprs, num_warps=cfg.num_warps,
                           aligned=_ALIGNED, maxnreg=maxnreg)
    return compiled, resources(compiled), cfg


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("norm_out", [False, True], ids=["mix", "mix+rmsnorm"])
@pytest.mark.parametrize("n, paired, subset", [(9, 0, False), (8, 8, False), (1, 0, True), (2, 1, False), (3, 0, False)])
def test_preload_backward_compiles_within_its_register_budget(norm_out, n, paired, subset):
    # The shipped launch of the backward (fused.BACKWARD_LAUNCH; sources reloaded in the grad pass) at
    # h = 2048: the benchmark's widest call (n = 9, every source accumulated), the widest pair (the MLP mixer of
    # layer 7 deferring 8 shared blocks to the attention mixer), the second call's own-source pass (subset) and
    # small calls. One row over 4 warps, two programs per SM (<= 255 registers), as measured fastest
    # (docs/bench/attnres-sweep-h200.json); the own pass capped (BACKWARD_LAUNCH.subset_maxnreg) to three per SM.
    # Spills: at most 64 bytes (n = 9 with the norm spills ~40 to L1 with Triton 3.8; without the reload ~840;
    # the widest pair 44 since its row sums are reduced four sources at a time, 120 one at a time,
    # docs/bench/history/attn_res-notes.md); more means the tile or the kept scalars grew.
    import kimi_kernels.attn_res.fused as fused
    from kimi_kernels._compile_check import triton_release

    older_triton = triton_release() < (3, 8)
    # a pair's second call (subset): its output saved in fp32, its mix gradient handed on, its own pass capped as
    # the launcher caps it
    _, used, cfg = _compile_preload(
        n, maxnreg=fused.BACKWARD_LAUNCH.subset_maxnreg if subset else None, out_ptr="*fp32" if subset else "*bf16",
        ACCUMULATE=0 if subset else (1 << n) - 1, NORM_OUT=norm_out, OUT_NORM_GRAD=norm_out, SUBSET=subset,
        PAIRED=paired, HANDOFF=subset)
    if subset:  # three programs per SM, without spills (Triton 3.6, the GPU machine's: 8 bytes with the norm)
        assert used.registers <= 168 and used.spill_stores <= (8 if older_triton else 0), used
    # Triton 3.6 spills 88 bytes at the widest pair with the norm (the H200 timings ran that code)
    spill_limit = 96 if older_triton else 64
    assert used.spill_stores <= spill_limit and used.spill_loads <= spill_limit, (n, paired, used)
    assert cfg.num_warps == 4 and used.registers <= 255, (cfg, used)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("parameter_grads", [False, True])
def test_finish_kernel_compiles(parameter_grads):
    import kimi_kernels.attn_res.fused as fused
    from kimi_kernels._compile_check import compile_for, resources

    compiled = compile_for(fused._depth_attention_finish_kernel, {
        "partial_ptr": "*fp32", "out_ptr": "*fp32", "query_ptr": "*fp32", "norm_weight_ptr": "*bf16",
        "grad_query_ptr": "*fp32", "grad_norm_weight_ptr": "*bf16", "grad_out_norm_ptr": "*bf16", "H": "i32",
    }, {"P": 264, "ROWS": 2, "BLOCK_P": fused.BACKWARD_LAUNCH.finish_block_p,
        "BLOCK": fused.BACKWARD_LAUNCH.finish_block, "PARAMETER_GRADS": parameter_grads},
        num_warps=4)
    used = resources(compiled)
    assert used.spill_stores == 0 and used.spill_loads == 0, used
