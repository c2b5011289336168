"""Block Attention Residuals in the Megatron-Core model (DESIGN.md section 4).

Enable with ``HybridConfig(attn_res=True, attn_res_num_blocks=N)`` (or ``attn_res_block_size=S``);
``megatron_ext.model.build_model`` then builds :class:`AttnResGPTModel`.
docs/attn_res_model.md describes the mapping onto Megatron's layers, the pipeline packing and memory.
"""

from megatron_ext.attn_res.block import (
    AttnResGPTModel,
    AttnResTransformerBlock,
    attn_res_block_spec,
    pipeline_slots,
)
from megatron_ext.attn_res.layer import AttnResTransformerLayer, DepthMixer
from megatron_ext.attn_res.state import DepthState, sublayers_per_block

__all__ = [
    "AttnResGPTModel",
    "AttnResTransformerBlock",
    "AttnResTransformerLayer",
    "DepthMixer",
    "DepthState",
    "attn_res_block_spec",
    "pipeline_slots",
    "sublayers_per_block",
]
