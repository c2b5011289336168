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
pays for every launch instead. With host reads, the common case, no expert over-subscribed in round 1
(plain top-k), is round 1 and one read. Otherwise round 1's admission and ``device_rounds`` overflow
rounds (dense ``[N, E]`` masks; a round with nothing left to move is a no-op) run before a second read,
which says whether a token could still move; only then does each further round read once.

``host_reads=False`` reads nothing: round 1's admission and ``device_rounds`` overflow rounds always run
and the kept-pair count stays on the device (a one-rank dispatcher then keeps static ``[N k]`` buffers):
the layer has no host sync, as CUDA-graph capture needs. ``device_rounds=None`` then means every round
that can matter (:func:`rounds_that_can_matter`: on one rank ``min(E, N k // C)`` overflow rounds, 51 of 64
experts at capacity factor 1.25): the same routing as with host reads, nothing dropped that they would place. The Triton
rounds run the overflow rounds in one launch that skips the rounds after the last useful one, so on one CUDA rank,
replayed from a CUDA graph, this is one graph launch per call for the whole lossless routing; the PyTorch rounds run
each no-op round in full.
A smaller ``device_rounds`` stops early and drops a token that could still move (the result of
``host_reads=True`` with ``max_rounds = 1 + device_rounds``).

Defaults (``host_reads=None``, ``cuda_graph=None``, ``device_rounds=None``) are decided per device by
:meth:`CapacityRouting.place`: on one CUDA rank no host reads, every round on the device, replayed from a
CUDA graph; on a group, off CUDA or with the PyTorch rounds forced, host reads (a group's dispatcher reads
its split sizes anyway, and no-op PyTorch rounds run in full, a group's each with its all-reduces) with
``DEVICE_ROUNDS`` rounds before the second read.

Structure: :class:`CapacityRouting` holds one router's settings and runs the protocol of rounds and host reads
(``_route``) over one of two kinds of rounds (``quantile_rounds``): ``TorchRounds`` (PyTorch ops, any group) or
``KernelRounds`` (Triton kernels, ``kimi_kernels/moe_routing``, one rank). Which one is decided once, when the routing
is built or moved to a device (:meth:`CapacityRouting.place`): ``rounds="auto"`` (``moe_qb_rounds_impl``) takes
the Triton rounds on one CUDA rank and the PyTorch rounds elsewhere; ``"torch"`` / ``"triton"`` force a kind.
Both give the same routing, up to the order among equal biased scores. With ``cuda_graph`` (``moe_qb_cuda_graph``;
no host reads; by default wherever there are none) a one-rank CUDA routing is captured once per shape and
replayed (:class:`_Graphs`). :func:`capacity_routing` is the same as a one-call function.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_ext.moe.quantile_rounds import KernelRounds, TorchRounds, expert_capacity
from megatron_ext.moe.quantile_routing import Routing, check_scores, gates_from_scores

__all__ = ["expert_capacity", "capacity_routing", "CapacityRouting", "DEVICE_ROUNDS", "ROUNDS_IMPLS",
           "rounds_that_can_matter"]


# Overflow rounds run between an over-subscribed call's two host reads (device_rounds's default with host
# reads): each costs ~40 small launches on [N, E] as PyTorch ops, two as Triton kernels.
DEVICE_ROUNDS = 2

# Which rounds run (``moe_qb_rounds_impl``). "auto": the Triton rounds (kimi_kernels/moe_routing: two launches per
# round instead of ~40 PyTorch ops; 4.0x faster with reads at 65536 x 256 on the H200, docs/bench/routing-h200.json)
# on one CUDA rank, with or without host reads; the PyTorch rounds on a group (the Triton admission has no
# all-reduce between kernels) and off CUDA. "torch" / "triton": that kind wherever allowed ("triton" off CUDA
# runs under the Triton interpreter only).
ROUNDS_IMPLS = ("auto", "torch", "triton")


class CapacityRouting:
    """Capacity routing of one router: :func:`capacity_routing` with every setting fixed at construction.

    ``routing(scores, bias=None, renormalize=True) -> Routing``. ``group`` is the capacity group (None or one
    rank: this process alone). ``rounds`` (:data:`ROUNDS_IMPLS`), ``host_reads``, ``cuda_graph`` and
    ``device_rounds`` are resolved for ``device`` (the device of the scores it will route) by :meth:`place`, at
    construction and again when the owner moves to another kind of device; a call with scores elsewhere is
    refused. ``cuda_graph=True`` needs no host reads and replays a one-rank CUDA call from a CUDA graph
    (:class:`_Graphs`); elsewhere it routes eagerly, with the same result.
    """

    def __init__(self, k: int, capacity_factor: float, *, num_bins: int = 1000,
                 score_range: tuple[float, float] = (0.0, 1.0), group=None, max_rounds: int | None = None,
                 device_rounds: int | None = None, host_reads: bool | None = None, rounds: str = "auto",
                 cuda_graph: bool | None = None, device: torch.device | str = "cpu"):
        if not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
        lo, hi = score_range
        if not hi > lo:
            raise ValueError(f"score_range must be (lo, hi) with hi > lo, got {score_range}")
        if max_rounds is not None and max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1 or None, got {max_rounds}")
        if device_rounds is not None and (not isinstance(device_rounds, int) or device_rounds < 0):
            raise ValueError(f"device_rounds must be an int >= 0 or None, got {device_rounds!r}")
        for name, value in (("host_reads", host_reads), ("cuda_graph", cuda_graph)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None (decided per device), got {value!r}")
        if rounds not in ROUNDS_IMPLS:
            raise ValueError(f"rounds must be one of {ROUNDS_IMPLS}, got {rounds!r}")
        if cuda_graph and host_reads:
            raise ValueError("moe_qb_cuda_graph=True needs moe_qb_host_reads=False (a CUDA graph cannot read the "
                             "device back to the host)")
        if group is not None and dist.get_world_size(group) == 1:
            group = None  # a one-rank collective is an identity that still costs a launch and a sync
        if rounds == "triton" and group is not None:
            raise ValueError("rounds='triton' (moe_qb_rounds_impl) routes one rank; a capacity group needs the "
                             "PyTorch rounds (their admission all-reduces between kernels)")
        self.k, self.capacity_factor, self.num_bins, self.lo, self.hi = k, capacity_factor, num_bins, lo, hi
        self.group, self.max_rounds, self.device_rounds = group, max_rounds, device_rounds
        self.rounds, self.cuda_graph, self.host_reads = rounds, cuda_graph, host_reads
        self.device_type: str | None = None
        self.place(device)

    def place(self, device: torch.device | str) -> None:
        """Decide, for scores on ``device``, which rounds run, whether the host reads between them and whether
        calls are replayed from CUDA graphs (``reads``, ``rounds_kind``, ``graphs``). The settings left at None
        follow the device: one CUDA rank reads nothing and replays its rounds from a graph (its Triton rounds
        skip the rounds after the last useful one on the device); a group or a CPU reads. Same kind of device
        as before: nothing changes (captured graphs are kept)."""
        device_type = torch.device(device).type
        if device_type == self.device_type:
            return
        self.device_type = device_type
        one_cuda_rank = device_type == "cuda" and self.group is None
        triton = self.rounds == "triton" or (self.rounds == "auto" and one_cuda_rank)
        self.rounds_kind = KernelRounds if triton else TorchRounds
        if self.host_reads is not None:
            self.reads = self.host_reads
        else:  # an explicit graph needs no reads; otherwise reads only where they cost no graph
            self.reads = not (self.cuda_graph or (one_cuda_rank and triton))
        graphed = self.cuda_graph if self.cuda_graph is not None else not self.reads
        self.graphs = _Graphs() if graphed and one_cuda_rank else None

    def __call__(self, scores: torch.Tensor, bias: torch.Tensor | None = None, renormalize: bool = True) -> Routing:
        check_scores(scores, self.k, bias)
        if scores.device.type != self.device_type:
            raise ValueError(f"this capacity routing was placed for {self.device_type} scores, got "
                             f"{scores.device.type} ones (place() it on their device)")
        # Inside a larger capture (cuda_graph_step) the eager call's kernels join that graph instead.
        if self.graphs is not None and not torch.cuda.is_current_stream_capturing():
            return self.graphs(self, scores, bias, renormalize)
        with torch.no_grad():  # only the gates below are differentiable
            result = self._route(scores.detach(), bias)
        gates = gates_from_scores(scores, result.experts, renormalize, all_kept=result.plain)
        return Routing(result.experts, gates, result.dropped, result.rerouted, global_load=result.global_load,
                       rounds=result.rounds, plain=result.plain, num_kept=result.num_kept)

    def _route(self, scores, bias):
        """The rounds and their host reads (``quantile_rounds``'s interface)."""
        k, max_rounds, host_reads = self.k, self.max_rounds, self.reads
        num_experts = scores.shape[1]
        device_rounds = self.device_rounds
        if device_rounds is None:  # with reads: the default before the second; without: all that can matter
            device_rounds = DEVICE_ROUNDS if host_reads else rounds_that_can_matter(
                scores.shape[0], k, num_experts, self.capacity_factor, self.group)
        overflow_rounds = device_rounds if max_rounds is None else min(device_rounds, max_rounds - 1)
        kind = self.rounds_kind if scores.shape[0] > 0 else TorchRounds  # the kernels need a token
        # round 1, the device rounds and, with reads, at most one round per expert after them (each fills one)
        max_steps = 1 + overflow_rounds + (num_experts + 1 if host_reads else 0)
        rounds = kind(scores, k, self.capacity_factor, bias, self.num_bins, self.lo, self.hi, self.group, max_steps)
        rounds.first()
        if host_reads:
            # The read of a call where nothing overflows (the common case): then the result is plain top-k.
            refused, proposed = _read(*rounds.first_refused_and_proposed())
            if not refused:
                return rounds.result(1 if proposed else 0, scores.shape[0] * k, plain=True)
        rounds.admit_first()
        rounds.steps(overflow_rounds)
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


def rounds_that_can_matter(num_tokens: int, k: int, num_experts: int, capacity_factor: float, group=None) -> int:
    """Overflow rounds after round 1 that can still move a token. A round that refuses fills an expert (one with
    room, else nobody would have proposed to it); a full expert holds ``C`` pairs of at most ``N k``, so at most
    ``F = min(E, N k // C)`` rounds refuse. The round after the last of them refuses nothing and places all it
    proposes; after it nothing moves: round 1 and F overflow rounds. A group's N is its total, which only an
    all-reduce would tell: ``E`` there."""
    if group is not None or num_tokens == 0:
        return num_experts
    return min(num_experts, num_tokens * k // expert_capacity(num_tokens, k, num_experts, capacity_factor))


def capacity_routing(scores: torch.Tensor, k: int, capacity_factor: float, *, bias: torch.Tensor | None = None,
                     num_bins: int = 1000, score_range: tuple[float, float] = (0.0, 1.0),
                     group=None, renormalize: bool = True, max_rounds: int | None = None,
                     device_rounds: int | None = None, host_reads: bool | None = None,
                     rounds: str = "auto") -> Routing:
    """Top-k routing where expert j accepts at most ``C = expert_capacity(N_global, k, E,
    capacity_factor)`` pairs over all ranks of ``group`` (None: this process alone).

    ``bias`` shifts selection only; gates are the unbiased scores of the final experts
    (renormalised over the kept ones unless ``renormalize=False``); only the gates carry
    gradients. ``score_range`` is the histogram range (sigmoid/softmax scores lie in [0, 1]);
    scores outside it fall in the edge bins, which coarsens who wins a contested expert but
    never breaks the capacity. ``max_rounds`` caps the overflow rounds (None: until nothing can
    move; at most E + 1). Slots are ordered by biased score, best first, dropped (-1) last.
    ``Routing.rounds`` says how many rounds ran. ``host_reads`` (None: decided for the scores' device,
    :meth:`CapacityRouting.place`; a one-call function never graphs). With reads, ``device_rounds``
    (default ``DEVICE_ROUNDS``): the overflow rounds run before the second host read; the result does not
    depend on it. Without: no host read; exactly ``1 + device_rounds`` rounds run (default ``E``: every
    round that can matter, so the result equals the reading one; capped by ``max_rounds``), a token that
    could still move after them is dropped, ``Routing.num_kept`` is None and ``Routing.rounds`` counts the
    rounds run, useful or not. ``rounds``: which kind of rounds (:data:`ROUNDS_IMPLS`), decided for the
    scores' device.

    Collectives per call: per round, one all-reduce of ``E * num_bins`` int64 (+1 in round 1) and
    one of ``world * E`` int64; ``1 + device_rounds`` rounds run (fewer with ``max_rounds``), more
    only when tokens can still move. Host reads: one, plus one per round beyond those (none without
    ``host_reads``).
    """
    check_scores(scores, k, bias)
    routing = CapacityRouting(k, capacity_factor, num_bins=num_bins, score_range=score_range, group=group,
                              max_rounds=max_rounds, device_rounds=device_rounds, host_reads=host_reads,
                              rounds=rounds, cuda_graph=False, device=scores.device)
    return routing(scores, bias, renormalize)


def _read(*scalars: torch.Tensor) -> list[int]:
    """One host read of several 0-d tensors (bool or int)."""
    return torch.stack([t.to(torch.int64) for t in scalars]).tolist()


# --- CUDA-graph replay (moe_qb_cuda_graph) -----------------------------------------------------------------------
#
# Without host reads and with a one-rank capacity group, one call is a fixed sequence of small kernels on [N, E]:
# ~10 launches on the Triton rounds (every overflow round in one), ~160 as PyTorch ops with two overflow rounds
# (N = 16384, E = 64, k = 8), which were about 40% of the all-techniques benchmark step's ~3,000 launches on a step
# bound by the host's launch rate (docs/quantile_balancing.md, "Host reads"). Captured once per shape, a call
# becomes one copy of the scores into the graph's input and one graph launch; the gates, the only differentiable
# part, are computed outside the graph from the unbiased scores as the eager call does.
#
# The graph reads ``bias`` where it lived at capture (the router's buffer, updated in place by the dual-bias step);
# a bias at another address or another shape captures another graph. The graphs of all routers share one memory
# pool per device: they run one at a time on the current stream and their outputs are copied out right after each
# replay. A pool lives as long as the graphs in it: once every owner holding graphs in it is gone (a model freed,
# as the benchmarks free one variant before building the next), the next capture starts a new pool (torch refuses
# to capture into a pool whose graphs were all destroyed).

# device -> (graph memory pool, the _Graphs holding graphs in it)
_pools: dict[torch.device, tuple[tuple, weakref.WeakSet]] = {}


def _shared_pool(device: torch.device, owner: "_Graphs") -> tuple:
    pool, owners = _pools.get(device, (None, None))
    if not owners:  # first capture on this device, or every graph of the old pool is gone with its owner
        pool, owners = torch.cuda.graph_pool_handle(), weakref.WeakSet()
        _pools[device] = (pool, owners)
    owners.add(owner)
    return pool


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    scores: torch.Tensor  # the graph's input: each call copies its scores here
    outputs: tuple[torch.Tensor, ...]  # experts, dropped, rerouted, global_load
    rounds: int


class _Graphs:
    """A :class:`CapacityRouting`'s calls (no host reads, one rank, CUDA) replayed from one CUDA graph per scores
    shape, device and bias address. The result equals the eager call's (same kernels, same order)."""

    def __init__(self):
        self._graphs: dict[tuple, _Graph] = {}

    def __call__(self, routing: CapacityRouting, scores: torch.Tensor, bias: torch.Tensor | None,
                 renormalize: bool) -> Routing:
        key = (tuple(scores.shape), scores.device, None if bias is None else bias.data_ptr())
        entry = self._graphs.get(key)
        if entry is None:
            pool = _shared_pool(scores.device, self)
            entry = self._graphs[key] = _capture(routing, scores, bias, pool)
        entry.scores.copy_(scores.detach())
        entry.graph.replay()
        experts, dropped, rerouted, global_load = (t.clone() for t in entry.outputs)
        gates = gates_from_scores(scores, experts, renormalize)
        return Routing(experts, gates, dropped, rerouted, global_load=global_load, rounds=entry.rounds,
                       plain=False, num_kept=None)


def _capture(routing: CapacityRouting, scores, bias, pool) -> _Graph:
    static_scores = scores.detach().clone()
    rounds = []

    def decide():
        result = routing._route(static_scores, bias)
        rounds[:] = [result.rounds]
        return result.experts, result.dropped, result.rerouted, result.global_load

    with torch.no_grad():
        # One eager call on a side stream first (torch's capture recipe): lazy initialisation and the
        # cached constants (quantile_histogram's) happen outside the capture.
        side = torch.cuda.Stream(device=scores.device)
        side.wait_stream(torch.cuda.current_stream(scores.device))
        with torch.cuda.stream(side):
            decide()
        torch.cuda.current_stream(scores.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a data loader's pinning thread may use CUDA meanwhile; only this thread is captured
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = decide()
    return _Graph(graph, static_scores, outputs, rounds[0])
