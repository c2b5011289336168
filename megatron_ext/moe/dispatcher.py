"""Expert-parallel all-to-all token dispatcher (any device: gloo on CPU, NCCL on CUDA).

Forward of one MoE layer on one EP rank (``N`` local tokens, top-``k``, ``E`` experts,
``P`` EP ranks, ``L = E / P`` local experts):

1. permute: stable-sort the ``N * k`` (token, slot) pairs by expert (dropped pairs, expert
   ``-1``, sort last and are cut off) and gather their rows: ``[n_kept, h]``;
2. :meth:`AllToAllDispatcher.global_counts`: all-gather the ``[E]`` local counts into
   ``[P, E]`` so every rank knows what it sends to and receives from every rank (one host sync:
   the split sizes must be Python ints; none with ``P = 1``: the routing's kept-pair count when
   it knows one, else static ``[N k, h]`` buffers whose dropped rows trail the experts' blocks
   and are never read back);
3. all-to-all with uneven splits: rows arrive grouped by (source rank, local expert);
4. sort the received rows by local expert: ``[M, h]`` plus ``tokens_per_expert [L]``.

:meth:`AllToAllDispatcher.combine` reverses 4-3-1 and sums each token's ``k`` expert outputs
weighted by its fp32 gates. With ``P = 1`` there is no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimi_kernels.moe_combine import moe_combine
from megatron_ext.moe.experts import group_rank, group_size
from megatron_ext.moe.quantile import Routing

__all__ = ["AllToAllDispatcher", "DispatchState"]


@dataclass
class DispatchState:
    """What :meth:`AllToAllDispatcher.combine` needs from the matching dispatch."""

    pair_order: torch.Tensor  # [n_kept] flat (token * k + slot) ids of kept pairs, sorted by expert ([N k]: static)
    source: torch.Tensor  # [N * k] row of each pair in dispatch order (the inverse of pair_order); n_kept if dropped
    send_splits: list[int] | None  # rows sent to each EP rank (None: one rank, static buffers)
    recv_splits: list[int] | None  # rows received from each EP rank
    expert_order: torch.Tensor | None  # [M] received-row order that groups rows by local expert
    expert_unsort: torch.Tensor | None  # its inverse
    num_tokens: int
    top_k: int


class AllToAllDispatcher:
    """Moves (token, expert) pairs to the EP rank owning the expert and back."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None):
        self.ep_group = ep_group
        self.ep_size = group_size(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_moe_experts ({num_experts}) must be divisible by the expert-parallel "
                             f"size ({self.ep_size})")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.ep_rank = group_rank(ep_group)

    def global_counts(self, local_counts: torch.Tensor) -> torch.Tensor:
        """``[P, E]`` int64: row ``r`` = pairs EP rank ``r`` routes to each expert.

        The capacity balancer hooks in here: it must leave ``local_counts`` consistent with the
        routing it hands to :meth:`dispatch`.
        """
        if self.ep_size == 1:
            return local_counts.unsqueeze(0)
        gathered = [torch.empty_like(local_counts) for _ in range(self.ep_size)]
        dist.all_gather(gathered, local_counts.contiguous(), group=self.ep_group)
        return torch.stack(gathered)

    def dispatch(self, hidden: torch.Tensor, routing: Routing, counts_per_rank: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """``hidden [N, h]`` -> (``expert_input [M, h]`` sorted by local expert,
        ``tokens_per_expert [L]`` int64 on ``hidden``'s device, state for :meth:`combine`)."""
        num_tokens, top_k = routing.experts.shape
        num_local = self.num_local_experts
        send_splits, recv_splits = self._splits(routing, counts_per_rank)

        flat_experts = routing.experts.reshape(-1)
        num_pairs = flat_experts.numel()
        # Dropped pairs last (the plain top-k has none).
        sort_key = flat_experts if routing.plain else flat_experts.where(flat_experts >= 0, self.num_experts)
        sorted_keys, pair_order = torch.sort(sort_key, stable=True)
        rows = torch.arange(num_pairs, device=hidden.device)
        if send_splits is None:  # static: every pair gets a row; a dropped pair's combine index is past the end
            source = torch.empty_like(rows)
            source[pair_order] = rows.where(sorted_keys < self.num_experts, num_pairs)
        else:
            pair_order = pair_order[:sum(send_splits)]
            source = torch.full((num_pairs,), len(pair_order), dtype=torch.long, device=hidden.device)
            source[pair_order] = rows[:len(pair_order)]
        permuted = _GatherTokens.apply(hidden, pair_order, source, top_k)

        # From the device copy of the counts: a host-to-device copy of ``mine`` would wait for the stream.
        local_columns = slice(self.ep_rank * num_local, (self.ep_rank + 1) * num_local)
        tokens_per_expert = counts_per_rank[:, local_columns].sum(0).to(hidden.device)
        expert_order = expert_unsort = None
        if self.ep_size == 1:
            received = permuted  # already grouped by expert
        else:
            received = _all_to_all(permuted, recv_splits, send_splits, self.ep_group)
            # Rows arrive as blocks (source rank r, local expert e); regroup by e, keeping r order.
            block_expert = torch.arange(num_local, device=hidden.device).repeat(self.ep_size)
            block_rows = counts_per_rank[:, local_columns].reshape(-1).to(hidden.device)
            row_expert = block_expert.repeat_interleave(block_rows, output_size=sum(recv_splits))
            expert_order = torch.sort(row_expert, stable=True).indices
            expert_unsort = torch.empty_like(expert_order)
            expert_unsort[expert_order] = torch.arange(len(expert_order), device=expert_order.device)
            received = _PermuteRows.apply(received, expert_order, expert_unsort)
        state = DispatchState(pair_order, source, send_splits, recv_splits, expert_order, expert_unsort, num_tokens,
                              top_k)
        return received, tokens_per_expert, state

    def _splits(self, routing: Routing, counts_per_rank: torch.Tensor) -> tuple[list[int] | None, list[int] | None]:
        """Rows sent to and received from each EP rank, as Python ints. One rank needs no read: the
        kept-pair count when the routing knows it on the host (plain top-k, capacity routing with host
        reads), else (None, None): static buffers. With more ranks this is the layer's one host sync."""
        if self.ep_size == 1:
            kept = routing.num_kept
            return (None, None) if kept is None else ([kept], [kept])
        num_local = self.num_local_experts
        counts_host = counts_per_rank.cpu()
        send_splits = counts_host[self.ep_rank].view(self.ep_size, num_local).sum(1).tolist()
        mine = counts_host[:, self.ep_rank * num_local:(self.ep_rank + 1) * num_local]  # [P, L]
        return send_splits, mine.sum(1).tolist()

    def combine(self, expert_output: torch.Tensor, gates: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """``expert_output [M, h]`` (dispatch order) -> ``[N, h]``: sum_k gate * output, in fp32,
        returned in ``expert_output``'s dtype. Dropped pairs contribute nothing."""
        out = expert_output
        if state.expert_order is not None:
            out = _PermuteRows.apply(out, state.expert_unsort, state.expert_order)
            out = _all_to_all(out, state.send_splits, state.recv_splits, self.ep_group)
        return moe_combine(out, gates, state.source)


def sum_slot_grads(grad: torch.Tensor, source: torch.Tensor, num_tokens: int, top_k: int,
                   use_kernel: bool | None = None) -> torch.Tensor:
    """``[N, h]``: each token's ``k`` slot rows of ``grad [M, h]`` (row ``source[n k + j]``; ``M`` for a
    dropped pair, which adds nothing) summed in fp32, rounded once. On CUDA (``use_kernel`` default) the
    MoE combine kernel with unit gates: one pass over the rows, where gather-then-sum writes and reads an
    ``[N k, h]`` copy (on the H200 profile the pair took 2.0 ms per step, the combine forward on the same
    shapes 0.6)."""
    if grad.is_cuda if use_kernel is None else use_kernel:
        ones = torch.ones(num_tokens, top_k, dtype=torch.float32, device=grad.device)
        return moe_combine(grad, ones, source, use_kernel=True)
    grad = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])  # a dropped pair's row: past the end
    return grad.index_select(0, source).view(num_tokens, top_k, grad.shape[1]).sum(1)


class _GatherTokens(torch.autograd.Function):
    """``hidden[pair_order // k]``: one row per kept (token, slot) pair. The backward sums each token's
    ``k`` slot gradients (:func:`sum_slot_grads`: fp32 accumulation, one rounding, deterministic) instead of
    ``index_select``'s ``index_add_`` backward (atomics, a bf16 rounding per add, several times slower on
    the GPU)."""

    @staticmethod
    def forward(ctx, hidden, pair_order, source, top_k):
        ctx.save_for_backward(source)
        ctx.num_tokens, ctx.top_k = hidden.shape[0], top_k
        return hidden.index_select(0, pair_order // top_k)

    @staticmethod
    def backward(ctx, grad):
        (source,) = ctx.saved_tensors
        return sum_slot_grads(grad.contiguous(), source, ctx.num_tokens, ctx.top_k), None, None, None


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm``; the backward gathers with ``inverse`` (index_select's
    backward would scatter with index_add_)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all with uneven splits; backward sends the gradients back along the swapped splits.
    (Our own: torch.distributed.nn.functional.all_to_all_single is deprecated.)"""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all: row block ``r`` of ``x`` (``in_splits[r]`` rows) goes to rank
    ``r``; ``out_splits[r]`` rows come back from it (gloo and NCCL)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)
