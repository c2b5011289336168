"""Capacity mode of quantile balancing: a hard per-expert capacity enforced in the forward pass.

Algorithm (rounds of proposals; every decision depends only on global statistics and on the
global token order, so W ranks produce exactly the one-rank assignment of the concatenated
batch, rank 0's tokens first):

1. Each token with free slots proposes to its best untried experts (by biased score) that
   still have room, one proposal per free slot. Round 1 is the plain top-k.
2. Every rank histograms the scores of the proposals it holds, per expert; one all-reduce of
   the ``[E, num_bins]`` int64 counts gives the global demand ``D_j`` (round 1 also carries the
   token count, which fixes the capacity ``C``).
3. Expert j with ``D_j <= room_j`` accepts everything. Otherwise it accepts its ``room_j``
   best-scoring proposals: the global histogram locates the bin holding the lowest accepted
   rank; bins above it are accepted, bins below refused, and the boundary bin is resolved
   exactly in global token order from a tiny ``[world, E]`` all-reduce of each rank's count in
   that bin (each rank admits after its exclusive prefix). Interpolated thresholds alone could
   over-fill an expert whenever the boundary bin holds several proposals.
4. Refused proposals leave their experts full, so the next round only goes elsewhere; stop when
   a round refuses nothing, or when no refused token has an expert with room left.

GPU cost model: the work is tiny, so the cost is kernel launches and host reads. A host read
drains the GPU, which then idles while the host launches the next small kernels; a host-bound step
pays for every launch instead. So the common case, no expert over-subscribed in round 1 (plain
top-k), is round 1 and one read. Otherwise round 1's admission and ``device_rounds`` overflow rounds
(dense ``[N, E]`` masks; a round with nothing left to move is a no-op) run before a second read,
which says whether a token could still move; only then does each further round read once.

``host_reads=False`` reads nothing: round 1's admission and exactly ``device_rounds`` overflow rounds
always run, so a token that could still move after them is dropped (the result of ``host_reads=True``
with ``max_rounds = 1 + device_rounds``), and the kept-pair count stays on the device (a one-rank
dispatcher then keeps static ``[N k]`` buffers): the layer has no host sync, as CUDA-graph capture
needs. By itself it did not speed up the all-techniques benchmark step on the H200, which is bound by
the host's launch rate rather than by these reads (docs/quantile_balancing.md, "Host reads").

Two kinds of rounds run this protocol (:func:`_route`, ``quantile_rounds``): PyTorch ops on any group and,
on one CUDA rank, Triton kernels (``kernels/moe_routing``; ``ROUTING_KERNELS`` for calls
without reads, ``ROUTING_KERNELS_WITH_READS`` for calls with them). Both give the same routing, up to the order
among equal biased scores.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.moe.quantile_rounds import KernelRounds, TorchRounds, expert_capacity
from megatron_ext.moe.quantile_routing import Routing, check_scores, gates_from_scores

__all__ = ["expert_capacity", "capacity_routing"]


# Overflow rounds run between an over-subscribed call's two host reads (capacity_routing's device_rounds
# default): each costs ~40 small launches on [N, E] whether or not anything is left to move.
DEVICE_ROUNDS = 2

# One-rank CUDA routing without host reads runs its rounds as Triton kernels (kernels/moe_routing: two
# launches per round instead of ~40 PyTorch ops; the same result up to the order among equal biased scores).
# False: the PyTorch ops below (the benchmarks' ``+torch-rounds`` rows).
ROUTING_KERNELS = True
# ... and so do the calls with host reads (the default eager path): the same rounds behind the same reads, the same
# routing as the PyTorch rounds on the H200 (tests/kernels/test_moe_routing.py) and 4.0x faster there at 65536 x 256
# (docs/bench/routing-h200.json). False: the PyTorch rounds behind the reads.
ROUTING_KERNELS_WITH_READS = True


def capacity_routing(scores: torch.Tensor, k: int, capacity_factor: float, *, bias: torch.Tensor | None = None,
                     num_bins: int = 1000, score_range: tuple[float, float] = (0.0, 1.0),
                     group=None, renormalize: bool = True, max_rounds: int | None = None,
                     device_rounds: int | None = None, host_reads: bool = True) -> Routing:
    """Top-k routing where expert j accepts at most ``C = expert_capacity(N_global, k, E,
    capacity_factor)`` pairs over all ranks of ``group`` (None: this process alone).

    ``bias`` shifts selection only; gates are the unbiased scores of the final experts
    (renormalised over the kept ones unless ``renormalize=False``); only the gates carry
    gradients. ``score_range`` is the histogram range (sigmoid/softmax scores lie in [0, 1]);
    scores outside it fall in the edge bins, which coarsens who wins a contested expert but
    never breaks the capacity. ``max_rounds`` caps the overflow rounds (None: until nothing can
    move; at most E + 1). Slots are ordered by biased score, best first, dropped (-1) last.
    ``Routing.rounds`` says how many rounds ran. ``device_rounds`` (default ``DEVICE_ROUNDS``): the
    overflow rounds run before the host read; the result does not depend on it. ``host_reads=False``:
    no host read; exactly ``1 + device_rounds`` rounds run (capped by ``max_rounds``), a token that
    could still move after them is dropped, ``Routing.num_kept`` is None and ``Routing.rounds`` counts
    the rounds run, useful or not.

    Collectives per call: per round, one all-reduce of ``E * num_bins`` int64 (+1 in round 1) and
    one of ``world * E`` int64; ``1 + device_rounds`` rounds run (fewer with ``max_rounds``), more
    only when tokens can still move. Host reads: one, plus one per round beyond those (none without
    ``host_reads``).
    """
    check_scores(scores, k, bias)
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    lo, hi = score_range
    if not hi > lo:
        raise ValueError(f"score_range must be (lo, hi) with hi > lo, got {score_range}")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1 or None, got {max_rounds}")
    device_rounds = DEVICE_ROUNDS if device_rounds is None else device_rounds
    if not isinstance(device_rounds, int) or device_rounds < 0:
        raise ValueError(f"device_rounds must be an int >= 0 or None, got {device_rounds!r}")
    if not isinstance(host_reads, bool):
        raise ValueError(f"host_reads must be True or False, got {host_reads!r}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None  # a one-rank collective is an identity that still costs a launch and a sync
    with torch.no_grad():  # only the gates below are differentiable
        result = _route(scores.detach(), k, capacity_factor, bias, num_bins, lo, hi, group, max_rounds,
                        device_rounds, host_reads)
    gates = gates_from_scores(scores, result.experts, renormalize, all_kept=result.plain)
    return Routing(result.experts, gates, result.dropped, result.rerouted, global_load=result.global_load,
                   rounds=result.rounds, plain=result.plain, num_kept=result.num_kept)


def _route(scores, k, capacity_factor, bias, num_bins, lo, hi, group, max_rounds, device_rounds, host_reads):
    """The rounds and their host reads, on either kind of rounds (``quantile_rounds``)."""
    overflow_rounds = device_rounds if max_rounds is None else min(device_rounds, max_rounds - 1)
    num_experts = scores.shape[1]
    kind = KernelRounds if _kernels_apply(scores, group, host_reads) else TorchRounds
    # round 1, the device rounds and, with reads, at most one round per expert after them (each fills one)
    max_steps = 1 + overflow_rounds + (num_experts + 1 if host_reads else 0)
    rounds = kind(scores, k, capacity_factor, bias, num_bins, lo, hi, group, max_steps)
    rounds.first()
    if host_reads:
        # The read of a call where nothing overflows (the common case): then the result is plain top-k.
        refused, proposed = _read(*rounds.first_refused_and_proposed())
        if not refused:
            return rounds.result(1 if proposed else 0, scores.shape[0] * k, plain=True)
    rounds.admit_first()
    for _ in range(overflow_rounds):
        rounds.step()
    if not host_reads:
        return rounds.result(1 + overflow_rounds, None)
    # The second read: rounds that did something, whether a further round could move a token, kept pairs.
    active, movable, kept = _read(rounds.active(), rounds.refused(), rounds.kept_pairs())
    count = 1 + active
    while movable and (max_rounds is None or count < max_rounds):  # rare: one read per round
        rounds.step()
        proposed, movable, kept = _read(rounds.proposed(), rounds.refused(), rounds.kept_pairs())
        if not proposed:
            break
        count += 1
    return rounds.result(count, kept)


def _kernels_apply(scores: torch.Tensor, group, host_reads: bool) -> bool:
    """The Triton rounds serve one CUDA rank (their admission has no all-reduce between kernels)."""
    return (ROUTING_KERNELS and (ROUTING_KERNELS_WITH_READS or not host_reads) and group is None and scores.is_cuda
            and scores.shape[0] > 0)


def _read(*scalars: torch.Tensor) -> list[int]:
    """One host read of several 0-d tensors (bool or int)."""
    return torch.stack([t.to(torch.int64) for t in scalars]).tolist()
