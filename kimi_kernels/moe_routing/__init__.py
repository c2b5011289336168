"""One-rank capacity routing in rounds (quantile balancing's capacity mode) as Triton kernels:
:func:`capacity_rounds` and :func:`kernel_rounds` (``fused.py``), checked against the PyTorch reference
``naive.py`` and against ``megatron_ext.moe.quantile_capacity``, whose one-rank CUDA rounds run on them
(``quantile_rounds.KernelRounds``)."""

import torch

from kimi_kernels.moe_routing.naive import capacity_rounds_reference

__all__ = ["capacity_rounds", "capacity_rounds_reference", "kernel_rounds"]


def capacity_rounds(scores, k, capacity, bias=None, num_bins=1000, score_range=(0.0, 1.0), rounds=3):
    """``rounds`` proposal rounds on fp32 ``scores [N, E]`` with per-expert ``capacity`` (pairs), ``bias``
    (fp32 ``[E]`` or None) shifting selection only, scores binned into ``num_bins`` over ``score_range``.
    Returns int64 (experts ``[N, k]``: held experts by biased score, then -1; dropped pairs; rerouted pairs,
    those outside the token's plain top-k; per-expert load ``[E]``). Ties between equal biased scores go
    to the lower expert id."""
    engine = kernel_rounds(scores, k, capacity, bias, num_bins, score_range, rounds)
    for _ in range(rounds):
        engine.step()
    return engine.result()


def kernel_rounds(scores, k, capacity, bias=None, num_bins=1000, score_range=(0.0, 1.0), max_steps=3):
    """The rounds' device state (:class:`kimi_kernels.moe_routing.fused.KernelRounds`) for a caller that reads
    between rounds (``quantile_capacity``); arguments as :func:`capacity_rounds`."""
    from kimi_kernels.moe_routing.fused import KernelRounds

    _check(scores, max_steps, capacity)
    return KernelRounds(scores.contiguous(), k, capacity, bias, num_bins, score_range, max_steps)


def _check(scores, rounds, capacity):
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"scores must be fp32 [N, E], got {scores.dtype} {tuple(scores.shape)}")
    if scores.shape[0] < 1 or rounds < 1 or capacity < 0:
        raise ValueError(f"need N >= 1, rounds >= 1, capacity >= 0; got N={scores.shape[0]}, rounds={rounds}, "
                         f"capacity={capacity}")
