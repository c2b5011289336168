"""``wrap_ddp(main_grad_dtype=...)``: bf16 gradient buffers (Megatron's ``grad_reduce_in_fp32=False``).

A few optimizer steps (clipping on) of a tiny bf16 MoE model on the CPU over gloo:

* one rank, one micro-batch: nothing is ever added into the buffer, so bf16 main grads must give bit for bit
  the losses, grad norms and weights of fp32 ones, with our fused step and with Megatron's own;
* two data-parallel ranks with two micro-batches each, against one rank with four micro-batches and fp32 main
  grads: each bf16 main grad is rounded twice more (the two micro-batches' sum on a rank, the all-reduce's sum
  over ranks; the 1/2 scaling is exact), at most 2^-8 of a partial sum each time. The gradients must agree to
  2^-6 of each tensor's largest gradient (room for cancellation between micro-batches), and the training run
  stays close (losses to 2e-3 relative, weights to 2 x lr x steps: Adam moves a weight about lr per step).
"""

import pytest
import torch

from tests._dist import run_distributed
from tests.parallel import harness

LR = 1e-2
CLIP = 0.05  # below every grad norm here: the clip coefficient is used in every step
STEPS = 3


def bf16_config(**layout):
    from megatron_ext.config import HybridConfig

    return HybridConfig(**harness.TINY, **harness.TINY_MOE, **layout, bf16=True, params_dtype=torch.bfloat16,
                        pipeline_dtype=torch.bfloat16, use_cpu_initialization=True)


def train(rank, world_size, main_grad_dtype: str, fast_step: bool, global_batch: int):
    """``STEPS`` optimizer steps on ``global_batch`` sequences per step (split over the data-parallel ranks, in
    micro-batches of ``harness.MICRO_BATCH``); losses, grad norms, first-step main grads, final weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron_ext import cpu_compat
    from megatron_ext.parallel import (build_model_chunks, build_optimizer, initialize_parallel,
                                       resolve_main_grad_dtype, wrap_ddp)
    from megatron_ext.training.step import forward_backward

    cpu_compat.install()
    config = bf16_config()
    initialize_parallel(config, harness.SEED)
    micro = global_batch // (world_size * harness.MICRO_BATCH)
    chunks = [Float16Module(config, c) for c in build_model_chunks(config)]
    chunks = wrap_ddp(chunks, config, fresh_main_grads=fast_step, main_grad_dtype=main_grad_dtype,
                      micro_batches_per_step=micro)
    optimizer = build_optimizer(chunks, lr=LR, clip_grad=CLIP, bf16=True, fast_step=fast_step)
    losses, norms, first_grads = [], [], None
    for step in range(STEPS):
        windows = harness.make_batches(seed=harness.SEED + step)[:global_batch]
        microbatches = harness.microbatches_for_rank(windows)
        assert len(microbatches) == micro
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(forward_backward(chunks, microbatches, harness.SEQ, harness.MICRO_BATCH))
        if first_grads is None:
            first_grads = {n: p.main_grad.float().clone() for n, p in chunks[0].module.named_parameters()}
        ok, norm, _ = optimizer.step()
        assert ok
        norms.append(float(norm))
    return {
        "losses": losses, "norms": norms, "grads": first_grads,
        "weights": {n: p.detach().float().clone() for n, p in chunks[0].module.named_parameters()},
        "grad_dtypes": {p.main_grad.dtype for p in chunks[0].module.parameters()},
        "auto": resolve_main_grad_dtype("auto", config, micro),
        "dp": ps.get_data_parallel_world_size(),
    }


@pytest.mark.parametrize("fast_step", [True, False], ids=["fused-step", "megatron-step"])
def test_bf16_main_grads_change_nothing_with_one_micro_batch_on_one_rank(fast_step):
    one_micro = harness.MICRO_BATCH
    (wide,) = run_distributed(train, 1, "fp32", fast_step, one_micro)
    (narrow,) = run_distributed(train, 1, "bf16", fast_step, one_micro)
    assert wide["grad_dtypes"] == {torch.float32} and narrow["grad_dtypes"] == {torch.bfloat16}
    assert narrow["auto"] == "bf16"  # what auto picks here
    assert wide["losses"] == narrow["losses"]
    assert wide["norms"] == narrow["norms"] and min(wide["norms"]) > CLIP
    for name, w in wide["weights"].items():
        assert torch.equal(w, narrow["weights"][name]), name


def test_bf16_main_grads_on_dp2_with_two_micro_batches_stay_within_bound():
    (reference,) = run_distributed(train, 1, "fp32", True, harness.GLOBAL_BATCH)  # 4 micro-batches
    dp2 = run_distributed(train, 2, "bf16", True, harness.GLOBAL_BATCH)  # 2 ranks x 2 micro-batches
    assert reference["auto"] == "fp32" and all(r["auto"] == "fp32" for r in dp2)  # auto keeps fp32 here
    for r in dp2:
        assert r["dp"] == 2 and r["grad_dtypes"] == {torch.bfloat16}
        for name, ref in reference["grads"].items():
            scale = ref.abs().max().item()
            torch.testing.assert_close(r["grads"][name], ref, rtol=0, atol=2**-6 * scale, msg=name)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=2e-3, atol=0)
        for name, ref in reference["weights"].items():
            torch.testing.assert_close(r["weights"][name], ref, rtol=0, atol=2 * LR * STEPS, msg=name)
    # The bound is not vacuous: bf16 accumulation did change some gradients.
    assert any(not torch.equal(dp2[0]["grads"][n], g) for n, g in reference["grads"].items())


def test_bad_main_grad_dtype_is_refused_naming_the_key_and_the_allowed_values():
    from megatron_ext.config import ConfigError
    from megatron_ext.parallel import resolve_main_grad_dtype
    from megatron_ext.training.arguments import load_config
    from megatron_ext.training.sections import TrainingConfig

    with pytest.raises(ConfigError, match=r"main_grad_dtype='fp16'; allowed: fp32, bf16, auto"):
        resolve_main_grad_dtype("fp16", bf16_config(), 1)
    with pytest.raises(ConfigError, match=r"main_grad_dtype='bf16' needs bf16 parameters"):
        resolve_main_grad_dtype("bf16", harness.tiny_config({}, moe=False), 1)
    with pytest.raises(ConfigError, match=r"main_grad_dtype='auto' needs the number of micro-batches"):
        resolve_main_grad_dtype("auto", bf16_config(), None)
    assert resolve_main_grad_dtype("auto", harness.tiny_config({}, moe=False), None) == "fp32"  # fp32 model
    assert resolve_main_grad_dtype("fp32", bf16_config(), None) == "fp32"
    with pytest.raises(ConfigError, match=r"main_grad_dtype.*'fp32', 'bf16', 'auto'"):
        TrainingConfig(main_grad_dtype="half")
    with pytest.raises(ConfigError, match=r"main_grad_dtype: 'bf16' needs bf16: true"):
        TrainingConfig(main_grad_dtype="bf16")
    assert TrainingConfig(bf16=True, main_grad_dtype="bf16").main_grad_dtype == "bf16"
    assert TrainingConfig().main_grad_dtype == "auto"
    with pytest.raises(ConfigError, match=r"main_grad_dtype = 'half'.*one of 'fp32', 'bf16', 'auto'"):
        load_config([TrainingConfig], ["--main-grad-dtype", "half"])
