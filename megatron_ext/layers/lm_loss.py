"""The LM loss of our models: Megatron's ``compute_language_model_loss`` through the fused cross-entropy.

Megatron's stock loss (``tensor_parallel.vocab_parallel_cross_entropy``) copies the ``[s, b, V/tp]`` logits
to fp32 and runs about ten elementwise and reduction kernels over them; ``kimi_kernels.cross_entropy`` reads
them once forward and once backward (docs/e2e.md). :class:`FusedLMLossMixin` swaps it in
for ``config.fused_cross_entropy`` and keeps Megatron's contract: labels ``[b, s]`` in, loss ``[b, s]`` fp32
out, computed in the logits' ``[s, b]`` order, the vocab split over ``pg_collection.tp``. With the field
off it is Megatron's own method (including its ``cross_entropy_loss_fusion`` options).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.utils import VocabUtility

from kimi_kernels.cross_entropy import cross_entropy


class FusedLMLossMixin:
    """Put before ``GPTModel`` (or a subclass) in the bases."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not getattr(self.config, "fused_cross_entropy", False):
            return super().compute_language_model_loss(labels, logits)
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as Megatron
        tp_group = self.pg_collection.tp
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        rank = dist.get_rank(tp_group) if tp > 1 else 0
        vocab_start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], rank, tp)
        # The logits are the output layer's fresh output, read by nothing after the loss: backward writes
        # their gradient into them.
        loss = cross_entropy(logits, labels, tp_group=tp_group, vocab_start=vocab_start,
                             inplace_backward=True)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]


class HybridGPTModel(FusedLMLossMixin, GPTModel):
    """Megatron's ``GPTModel`` with the LM loss above (``build_model``'s class without AttnRes)."""
