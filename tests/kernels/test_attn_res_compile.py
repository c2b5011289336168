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
                {"FUSE_REDUCTIONS": fused.FORWARD_FUSE_REDUCTIONS, "NORM_OUT": norm_out,
                 "PRELOAD": fused.FORWARD_PRELOAD, "PACK": fused.FORWARD_PACK_ROWS,
                 "NEXT_TILE": fused.FORWARD_NEXT_TILE,
                 "BATCH": fused.sources_per_reduction(fused.FORWARD_SOURCES_PER_REDUCTION, n)},
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
            cfg = (fused.launch_config(hidden, tile, fused.FORWARD_VALUES_PER_THREAD) if tile
                   else fused.backward_launch_config(hidden, norm_out))
            constexprs = {"N": n, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h, **flags}
            signature = {**common, **extra}
            # aligned pointers and H as the launcher specialises them at h = 2048 (vectorised loads)
            aligned = [name for name in _ALIGNED + ("normed_ptr",) if name in signature] if hidden == 2048 else ()
            forward = kernel is fused._depth_attention_fwd_kernel
            maxnreg = fused.for_width(fused.FORWARD_MAXNREG, n) if forward else None  # as the launcher caps it
            compiled = compile_for(kernel, signature, constexprs, num_warps=cfg.num_warps, aligned=aligned,
                                   maxnreg=maxnreg)
            assert "cubin" in compiled.asm
            used = resources(compiled)
            # the capped forward at n = 9 spills 96 bytes (Triton 3.8; 11-20% faster on the H200 all the same)
            max_spill = 128 if maxnreg else 0
            assert used.spill_stores <= max_spill and used.spill_loads <= max_spill, (kernel.__name__, n, hidden, used)
            if hidden == 2048:  # at least 16 warps per SM (4 programs of 4 warps forward, 2 of 8 or 1 of 16 streaming)
                assert used.registers <= 128, (kernel.__name__, n, hidden, used)
                if norm_out and kernel is fused._depth_attention_bwd_kernel:
                    assert cfg.num_warps == 16 and used.registers <= 96, (cfg, used)


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


def _compile_preload(n, values_per_thread=None, maxnreg=None, out_ptr="*bf16", **changes):
    """The preload backward compiled for sm_90 at h = 2048 with n sources, every source accumulated, the norm
    fused, unpaired, pointers aligned as the launcher specialises them, the shipped layout (``fused``'s
    constants) except for ``changes`` (constexprs) and ``values_per_thread``: (compiled kernel, its resources,
    launch config)."""
    import kernels.attn_res.fused as fused
    from kernels._compile_check import compile_for, resources

    cfg = fused.launch_config(2048, fused.BACKWARD_TILE_ELEMENTS,
                              values_per_thread or fused.BACKWARD_PRELOAD_VALUES_PER_THREAD)
    signature = {**_PRELOAD_SIGNATURE, "src_ptrs": ("*bf16",) * n, "grad_ptrs": ("*bf16",) * n, "out_ptr": out_ptr}
    constexprs = {"N": n, "ACCUMULATE": (1 << n) - 1, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h,
                  "NORM_OUT": True, "SUBSET": False, "PAIRED": 0, "HANDOFF": False, "OUT_NORM_GRAD": True,
                  "RELOAD": fused.BACKWARD_RELOAD, "PIPELINE": fused.BACKWARD_PIPELINE,
                  "STAGES": fused.BACKWARD_TILE_STAGES, "PACK": fused.BACKWARD_PACK_ROWS,
                  "BATCH": fused.sources_per_reduction(fused.BACKWARD_SOURCES_PER_REDUCTION, n), **changes}
    compiled = compile_for(fused._depth_attention_bwd_preload_kernel, signature, constexprs, num_warps=cfg.num_warps,
                           aligned=_ALIGNED, maxnreg=maxnreg)
    return compiled, resources(compiled), cfg


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("norm_out", [False, True], ids=["mix", "mix+rmsnorm"])
@pytest.mark.parametrize("n, paired, subset", [(9, 0, False), (8, 8, False), (1, 0, True), (2, 1, False), (3, 0, False)])
def test_preload_backward_compiles_within_its_register_budget(norm_out, n, paired, subset):
    # The shipped layout of the preload backward (fused.BACKWARD_PRELOAD_VALUES_PER_THREAD, BACKWARD_RELOAD) at
    # h = 2048: the benchmark's widest call (n = 9, every source accumulated), the widest pair (the MLP mixer of
    # layer 7 deferring 8 shared blocks to the attention mixer), the second call's own-source pass (subset) and
    # small calls. One row over 4 warps, two programs per SM (<= 255 registers), as measured fastest
    # (docs/bench/attnres-sweep-h200.json); the own pass capped (fused.BACKWARD_SUBSET_MAXNREG) to three per SM.
    # Spills: at most 64 bytes (n = 9 with the norm spills ~40 to L1 with Triton 3.8; without RELOAD it was ~840;
    # the widest pair 44 since its row sums are reduced four sources at a time, 120 one at a time, docs/attn_res.md);
    # more means the tile or the kept scalars grew.
    import kernels.attn_res.fused as fused

    # a pair's second call (subset): its output saved in fp32, its mix gradient handed on, its own pass capped as
    # the launcher caps it
    _, used, cfg = _compile_preload(
        n, maxnreg=fused.BACKWARD_SUBSET_MAXNREG if subset else None, out_ptr="*fp32" if subset else "*bf16",
        ACCUMULATE=0 if subset else (1 << n) - 1, NORM_OUT=norm_out, OUT_NORM_GRAD=norm_out, SUBSET=subset,
        PAIRED=paired, HANDOFF=subset)
    if subset:  # three programs per SM, without spills
        assert used.registers <= 168 and used.spill_stores == 0, used
    assert used.spill_stores <= 64 and used.spill_loads <= 64, (n, paired, used)
    assert cfg.num_warps == 4 and used.registers <= 255, (cfg, used)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("parameter_grads", [False, True])
def test_finish_kernel_compiles(parameter_grads):
    import kernels.attn_res.fused as fused
    from kernels._compile_check import compile_for, resources

    compiled = compile_for(fused._depth_attention_finish_kernel, {
        "partial_ptr": "*fp32", "out_ptr": "*fp32", "query_ptr": "*fp32", "norm_weight_ptr": "*bf16",
        "grad_query_ptr": "*fp32", "grad_norm_weight_ptr": "*bf16", "grad_out_norm_ptr": "*bf16", "H": "i32",
    }, {"P": 264, "ROWS": 2, "BLOCK_P": fused.FINISH_BLOCK_P, "BLOCK": fused.FINISH_BLOCK, "PARAMETER_GRADS": parameter_grads},
        num_warps=4)
    used = resources(compiled)
    assert used.spill_stores == 0 and used.spill_loads == 0, used


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("values_per_thread, pipeline, stages, pack, max_spill", [
    (16, 1, None, True, 64),  # old grads loaded after their source's reductions: ~44 bytes spilled
    (16, 5, None, True, 96),  # + sources reloaded one ahead: ~68
    (8, 3, None, True, 0),  # old grads early + the next tile's rows: 8 warps, ~178 registers, one program per SM
    (8, 0, 2, False, 0),  # Triton's pipelining: cp.async into ~139 KB of shared memory
], ids=["pipe1-pack", "pipe5-pack", "pipe3-8vpt-pack", "stages2-8vpt"])
def test_preload_backward_variants_compile(values_per_thread, pipeline, stages, pack, max_spill):
    # The opt-in variants of tools/sweep_attnres_kernels.py (fused.BACKWARD_PIPELINE, BACKWARD_TILE_STAGES,
    # BACKWARD_PACK_ROWS) at the benchmark's widest call (n = 9, h = 2048, the norm, every source accumulated).
    compiled, used, _ = _compile_preload(9, values_per_thread, RELOAD=True, PIPELINE=pipeline, STAGES=stages,
                                         PACK=pack, BATCH=1)
    assert used.spill_stores <= max_spill and used.spill_loads <= max_spill, used
    if stages:  # the tile's loads became asynchronous copies; one program's buffers fit an SM's 227 KB
        assert "cp.async" in compiled.asm["ptx"] and used.shared <= 227 * 1024, used


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter")
@pytest.mark.parametrize("values_per_thread, tile, next_tile, max_registers", [
    (16, 2048, 1, 200),  # persistent, the next tile's rows in flight: ~190 (255 and spills unpacked), 2 per SM
    (32, 4096, 0, 255),  # 2 rows over 4 warps: unpacked it spilled ~24 bytes with the norm
], ids=["next1-pack", "pack-2rows"])
def test_forward_variants_compile(values_per_thread, tile, next_tile, max_registers):
    # Opt-in forward variants of tools/sweep_attnres_kernels.py (fused.FORWARD_PACK_ROWS, FORWARD_NEXT_TILE) at the
    # benchmark's widest call (n = 9, h = 2048, the fused norm), pointers aligned as the launcher specialises them.
    import kernels.attn_res.fused as fused
    from kernels._compile_check import compile_for, resources

    n = 9
    cfg = fused.launch_config(2048, tile, values_per_thread)
    signature = {
        "src_ptrs": ("*bf16",) * n, "query_ptr": "*fp32", "norm_weight_ptr": "*fp32", "out_ptr": "*bf16",
        "lse_ptr": "*fp32", "out_norm_weight_ptr": "*bf16", "normed_ptr": "*bf16", "out_rstd_ptr": "*fp32",
        "T": "i32", "H": "i32", "eps": "fp32", "out_norm_eps": "fp32",
    }
    constexprs = {"N": n, "BLOCK_T": cfg.block_t, "BLOCK_H": cfg.block_h, "FUSE_REDUCTIONS": True, "NORM_OUT": True,
                  "PRELOAD": True, "PACK": True, "NEXT_TILE": next_tile, "BATCH": 1}
    aligned = [name for name in _ALIGNED + ("normed_ptr",) if name in signature]
    compiled = compile_for(fused._depth_attention_fwd_kernel, signature, constexprs, num_warps=cfg.num_warps,
                           aligned=aligned)
    used = resources(compiled)
    assert used.spill_stores == 0 and used.spill_loads == 0 and used.registers <= max_registers, (cfg, used)
