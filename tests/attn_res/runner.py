"""The tiny Block AttnRes model under a layout goes through ``tests/parallel/harness.py`` with
attn_res overrides; the reference weights randomise every depth mixer first (pseudo-queries and
key-norm weights, ``randomise_mixers`` as the harness's ``prepare`` hook), so the softmax over
depth is far from uniform and every parameter gets a real grad. The parity tests also randomise
the RMSNorm weights (``randomise_mixers_and_norms``), which the fused depth-mix + norm op reads.
"""

from __future__ import annotations

import torch

from megatron_ext.attn_res import DepthMixer

# 4 layers = 8 sublayers in 2 blocks of 4: the PP2 boundary (sublayer 4) starts a block, the
# PP4 / interleaved boundaries at sublayers 2 and 6 cut blocks in the middle.
ATTN_RES = dict(attn_res=True, attn_res_num_blocks=2)


def randomise_mixers(chunks, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, DepthMixer):
                with torch.no_grad():
                    module.query.copy_(torch.randn(module.query.shape, generator=g))
                    module.key_norm_weight.copy_(1 + 0.3 * torch.randn(module.query.shape, generator=g))


def randomise_norms(chunks, seed: int = 8) -> None:
    """Every RMSNorm weight (the sublayer norms and the final norm) to ``1 + 0.3 N(0, 1)``."""
    from megatron_ext.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(seed)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, RMSNorm):
                with torch.no_grad():
                    module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=g))


def randomise_mixers_and_norms(chunks) -> None:
    randomise_mixers(chunks)
    randomise_norms(chunks)
