"""One training step's forward/backward through Megatron's pipeline schedules.

A batch is a dict of ``[b, s]`` tensors: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
(``megatron_ext.data`` produces them). The loss of a microbatch is the mean token loss over its
``loss_mask``; Megatron's schedules average it over microbatches and DDP over data-parallel
ranks, so every layout computes the same global-batch mean when microbatches hold equal numbers
of loss tokens (true for fixed-length packed samples).
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func


def masked_mean_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron loss function: ``(loss, {"lm loss": loss})`` from per-token losses ``[b, s]``."""
    mask = loss_mask.float()
    loss = (output_tensor.float() * mask).sum() / mask.sum().clamp(min=1.0)
    # clone: the schedule divides the returned loss in place by the number of microbatches.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
    """Megatron ``forward_step_func``: run one microbatch, return output and its loss function."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(masked_mean_loss, batch["loss_mask"])


def forward_backward(
    model_chunks: list[torch.nn.Module],
    microbatches: list[dict],
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    read_loss: bool = True,
) -> float | torch.Tensor | None:
    """Run ``microbatches`` through the schedule for this layout; return the mean loss.

    The loss is the global-batch mean (averaged over data-parallel ranks), returned on the last
    pipeline stage and ``None`` elsewhere: a float, or with ``read_loss=False`` a 0-d device tensor that
    the caller reads when it logs (reading it every step would make the host wait for the GPU there, so
    the host could not queue the optimizer step while the backward still runs).
    """
    num_chunks = len(model_chunks)
    # Interleaved schedules take one iterator per model chunk; each walks the same microbatches.
    iterators = [iter(microbatches) for _ in range(num_chunks)]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if num_chunks > 1 else iterators[0],
        model=model_chunks if num_chunks > 1 else model_chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    if not losses:
        return None
    loss = torch.stack([d["lm loss"] for d in losses]).mean()
    world = ps.get_data_parallel_world_size()
    if world > 1:  # one rank: no collective (nothing for a CUDA graph of the step to capture)
        torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / world if read_loss else loss / world
