"""Run the tiny Block AttnRes model under a layout: the parity harness with attn_res overrides.

Reuses ``tests/parallel/harness.py`` (batches, microbatches, grads by checkpoint key, weight
loading). The saved reference weights randomise every depth mixer (pseudo-queries and key-norm
weights), so the softmax over depth is far from uniform and every parameter gets a real grad.
"""

from __future__ import annotations

import torch
from megatron.core import dist_checkpointing

from megatron_ext import cpu_compat
from megatron_ext.attn_res import DepthMixer
from tests.parallel import harness

# 4 layers = 8 sublayers in 2 blocks of 4: the PP2 boundary (sublayer 4) starts a block, the
# PP4 / interleaved boundaries at sublayers 2 and 6 cut blocks in the middle.
ATTN_RES = dict(attn_res=True, attn_res_num_blocks=2)


def setup(layout: dict, overrides: dict):
    from megatron_ext.parallel import build_model_chunks, initialize_parallel

    cpu_compat.install()
    config = harness.tiny_config(layout, False, **overrides)
    initialize_parallel(config, harness.SEED)
    return config, build_model_chunks(config)


def randomise_mixers(chunks, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, DepthMixer):
                with torch.no_grad():
                    module.query.copy_(torch.randn(module.query.shape, generator=g))
                    module.key_norm_weight.copy_(1 + 0.3 * torch.randn(module.query.shape, generator=g))


def save_reference(rank, world_size, ckpt_dir: str, overrides: dict):
    """One rank: build from the seed, randomise the mixers, save the weights."""
    _, chunks = setup({}, overrides)
    randomise_mixers(chunks)
    dist_checkpointing.save(harness._sharded(chunks), ckpt_dir)
    return True


def run_layout(rank, world_size, layout: dict, ckpt_dir: str, windows, overrides: dict):
    """Load the reference weights under ``layout``; one global batch -> loss + grads."""
    from megatron_ext.parallel import wrap_ddp
    from megatron_ext.training.step import forward_backward

    config, chunks = setup(layout, overrides)
    harness.load_weights(chunks, ckpt_dir)
    ddp_chunks = wrap_ddp(chunks, config)
    for c in ddp_chunks:
        c.zero_grad_buffer()
    loss = forward_backward(ddp_chunks, harness.microbatches_for_rank(windows), harness.SEQ, harness.MICRO_BATCH)
    return {"loss": loss, "grads": harness.collect_grads(ddp_chunks)}
