"""bf16 mixed precision, the path users train on: a checkpoint of the tiny hybrid model (bf16 weights beside the
fp32 KDA gate parameters) saves and a fresh model + optimizer resumes from it bit for bit, with our fused AdamW
step and with Megatron's own, with and without the distributed optimizer (DP2 over gloo). Before
``megatron_ext.checkpoint_fixes`` every case failed: the save with ``Optimizer shape ((4,) does not match model
shape ((16,))``, the distributed optimizer's save with a size mismatch, its load with ``assert len(steps) == 1``
or ``KeyError: 'step'``, and its resumed step with a shared ``step`` counter."""

import pytest
import torch

from tests._dist import run_distributed
from tests.parallel.harness import HYBRID, MICRO_BATCH, SEED, SEQ, TINY, TINY_MOE, make_batches, microbatches_for_rank

STEPS_BEFORE_SAVE = 2


def _build(fast_step: bool, distributed_optimizer: bool):
    from megatron_ext.config import HybridConfig
    from megatron_ext.parallel import build_model_chunks, build_optimizer, wrap_ddp

    config = HybridConfig(**TINY, **HYBRID, **TINY_MOE, moe_balancer="qb_bias", bf16=True,
                          params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=True)
    chunks = wrap_ddp(build_model_chunks(config), config, use_distributed_optimizer=distributed_optimizer)
    optimizer = build_optimizer(chunks, lr=1e-2, clip_grad=1.0, bf16=True,
                                use_distributed_optimizer=distributed_optimizer, fast_step=fast_step)
    return chunks, optimizer


def _step(chunks, optimizer, seed: int) -> None:
    """One training step as launch/train.py takes it (the dual-bias router update included)."""
    from megatron.core import parallel_state as ps

    from megatron_ext.moe.metrics import reset_moe_step_statistics
    from megatron_ext.moe.router import update_expert_biases
    from megatron_ext.training.step import forward_backward

    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward(chunks, microbatches_for_rank(make_batches(seed)), SEQ, MICRO_BATCH)
    optimizer.step()
    reset_moe_step_statistics(chunks)
    update_expert_biases(chunks, ps.get_tensor_and_data_parallel_group(with_context_parallel=True))


def _weights_and_buffers(chunks) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": t.detach().clone() for i, c in enumerate(chunks)
            for name, t in [*c.module.named_parameters(), *c.module.named_buffers()]}


def _save_then_resume(rank, world, ckpt_dir, fast_step, distributed_optimizer):
    from megatron_ext import cpu_compat
    from megatron_ext.config import HybridConfig
    from megatron_ext.parallel import initialize_parallel
    from megatron_ext.training.checkpointing import load_checkpoint, save_checkpoint, sharded_training_state

    cpu_compat.install()
    initialize_parallel(HybridConfig(**TINY, **HYBRID, **TINY_MOE, use_cpu_initialization=True), SEED)
    chunks, optimizer = _build(fast_step, distributed_optimizer)
    for step in range(STEPS_BEFORE_SAVE):
        _step(chunks, optimizer, SEED + step)
    save_checkpoint(ckpt_dir, STEPS_BEFORE_SAVE,
                    sharded_training_state(chunks, optimizer, for_loading=False, with_optimizer=True))
    _step(chunks, optimizer, SEED + STEPS_BEFORE_SAVE)
    uninterrupted = _weights_and_buffers(chunks)

    torch.manual_seed(SEED + 1)  # the fresh model starts from other weights: all must come from the checkpoint
    fresh, fresh_optimizer = _build(fast_step, distributed_optimizer)
    state, common = load_checkpoint(
        ckpt_dir, sharded_training_state(fresh, fresh_optimizer, for_loading=True, with_optimizer=True))
    for i, c in enumerate(fresh):
        c.module.load_state_dict(state[f"model{i}"])
    fresh_optimizer.load_state_dict(state["optimizer"])
    _step(fresh, fresh_optimizer, SEED + STEPS_BEFORE_SAVE)
    resumed = _weights_and_buffers(fresh)
    fp32_params = sorted(k for k, v in resumed.items() if v.dtype == torch.float32 and "A_log" in k)
    return common["iteration"], uninterrupted, resumed, fp32_params


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("fast_step", [True, False], ids=["fused_step", "megatron_step"])
def test_bf16_checkpoint_resumes_bit_exact(tmp_path, fast_step, distributed_optimizer):
    results = run_distributed(_save_then_resume, 2, str(tmp_path / "ckpt"), fast_step, distributed_optimizer)
    for iteration, uninterrupted, resumed, fp32_params in results:
        assert iteration == STEPS_BEFORE_SAVE
        assert fp32_params, "the model should keep KDA's A_log in fp32 beside its bf16 weights"
        assert uninterrupted.keys() == resumed.keys()
        for name, expected in uninterrupted.items():
            assert torch.equal(resumed[name], expected), name
