"""RMSNorm that works under sequence parallelism.

Megatron-Core's torch-backed norm (``WrappedTorchNorm``) refuses sequence parallelism, and its
fused norms need Apex or Transformer Engine. Under sequence parallelism each tensor-parallel rank
normalises its own slice of the sequence, so the weight's gradient is a partial sum: marking the
weight ``sequence_parallel`` makes Megatron's DDP all-reduce it over the tensor-parallel group
(``finalize_model_grads``), exactly as it does for Transformer Engine's norms.

On CUDA the norm is the fused Triton kernel of ``kimi_kernels/rms_norm`` (one pass forward, one backward);
on the CPU the PyTorch reference of the same maths.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from kimi_kernels.rms_norm import rms_norm as _rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in fp32, returned in ``x``'s dtype (the Triton
    kernel for CUDA tensors, the PyTorch reference otherwise)."""
    return _rms_norm(x, weight, eps)


class RMSNorm(MegatronModule):
    """RMSNorm over the hidden dim of ``[s, b, h]`` activations (the local sequence shard under SP).

    The builder signature matches Megatron's ``LayerNormBuilder``: ``(config, hidden_size, eps)``.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config=config)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
