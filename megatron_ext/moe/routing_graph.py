"""Capacity routing replayed from CUDA graphs (``moe_qb_cuda_graph``).

Without host reads (``moe_qb_host_reads: false``) and with a one-rank capacity group, one capacity-routing
call is a fixed sequence of small kernels on ``[N, E]``: ~12 launches with its rounds as Triton kernels
(``quantile_capacity.ROUTING_KERNELS``), ~160 as PyTorch ops with two overflow rounds (N = 16384, E = 64,
k = 8), which were about 40% of the all-techniques benchmark step's ~3,000 launches on a step bound by the
host's launch rate (docs/quantile_balancing.md, "Host reads"). Captured once per shape, a call becomes one copy of the
scores into the graph's input and one graph launch; the gates, the only differentiable part, are computed
outside the graph from the unbiased scores as :func:`capacity_routing` does.

The graph reads ``bias`` where it lived at capture (the router's buffer, updated in place by the dual-bias
step); a bias at another address, another shape or other settings captures another graph. The graphs of
all routers share one memory pool per device: they run one at a time on the current stream and their
outputs are copied out right after each replay. A pool lives as long as the graphs in it: once every router
holding graphs in it is gone (a model freed, as the benchmarks free one variant before building the next), the
next capture starts a new pool (torch refuses to capture into a pool whose graphs were all destroyed).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from megatron_ext.moe.quantile_capacity import DEVICE_ROUNDS, _route
from megatron_ext.moe.quantile_routing import Routing, check_scores, gates_from_scores

__all__ = ["CapacityRoutingGraphs"]

# device -> (graph memory pool, the CapacityRoutingGraphs holding graphs in it)
_pools: dict[torch.device, tuple[tuple, weakref.WeakSet]] = {}


def _shared_pool(device: torch.device, owner: "CapacityRoutingGraphs") -> tuple:
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


class CapacityRoutingGraphs:
    """``capacity_routing(..., host_reads=False)`` on one rank, replayed from a CUDA graph per call
    signature. The result equals the eager call's (same kernels, same order)."""

    def __init__(self):
        self._graphs: dict[tuple, _Graph] = {}

    def __call__(self, scores: torch.Tensor, k: int, capacity_factor: float, *, bias: torch.Tensor | None,
                 num_bins: int, device_rounds: int | None = None, renormalize: bool = True) -> Routing:
        device_rounds = DEVICE_ROUNDS if device_rounds is None else device_rounds
        if not scores.is_cuda:
            raise ValueError(f"CUDA-graph capacity routing needs CUDA scores, got {scores.device}")
        check_scores(scores, k, bias)
        key = (tuple(scores.shape), scores.device, k, capacity_factor, num_bins, device_rounds,
               None if bias is None else bias.data_ptr())
        entry = self._graphs.get(key)
        if entry is None:
            pool = _shared_pool(scores.device, self)
            entry = self._graphs[key] = _capture(scores, k, capacity_factor, bias, num_bins, device_rounds, pool)
        entry.scores.copy_(scores.detach())
        entry.graph.replay()
        experts, dropped, rerouted, global_load = (t.clone() for t in entry.outputs)
        gates = gates_from_scores(scores, experts, renormalize)
        return Routing(experts, gates, dropped, rerouted, global_load=global_load, rounds=1 + device_rounds,
                       plain=False, num_kept=None)


def _capture(scores, k, capacity_factor, bias, num_bins, device_rounds, pool) -> _Graph:
    static_scores = scores.detach().clone()

    def decide():
        # capacity_routing's default score range (sigmoid / softmax scores), as the router calls it
        result = _route(static_scores, k, capacity_factor, bias, num_bins, 0.0, 1.0, None, None, device_rounds,
                        False)
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
    return _Graph(graph, static_scores, outputs)
