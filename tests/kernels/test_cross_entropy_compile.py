"""The cross-entropy kernels compile for Hopper (sm_90) without a GPU and spill nothing at the model's vocab
tile (4096 columns, 8 warps: V = 32768 / tp and anything above 4096) and at a narrow vocab (1000 -> 1024),
bf16 logits (launch config of kimi_kernels/cross_entropy/fused.py)."""

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs the compiling JIT, not the interpreter")


@pytest.mark.parametrize("vocab", [32768, 1000])
@pytest.mark.parametrize("name", ["ce_fwd_kernel", "ce_bwd_kernel"])
def test_kernels_compile_for_hopper_without_spills(name, vocab):
    from kimi_kernels._compile_check import compile_for, resources
    from kimi_kernels.cross_entropy import fused

    kernel = getattr(fused, name)
    config = fused.launch_config(vocab)
    num_warps = config.pop("num_warps")
    kinds = dict(target="*i64", row_max="*fp32", sum_exp="*fp32", target_logit="*fp32", lse="*fp32",
                 dloss="*fp32", V="i32", vocab_start="i32")
    signature = {a: kinds.get(a, "*bf16") for a in kernel.arg_names if a not in config}
    used = resources(compile_for(kernel, signature, config, num_warps=num_warps, aligned=("logits", "V")))
    assert used.spill_stores == 0 and used.spill_loads == 0, used
    assert used.registers <= 128, used
