"""The tiny Block AttnRes model under a layout goes through ``tests/parallel/harness.py`` with
attn_res overrides; the reference weights randomise every depth mixer first (pseudo-queries and
key-norm weights, ``randomise_mixers`` as the harness's ``prepare`` hook), so the softmax over
depth is far from uniform and every parameter gets a real grad.
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
