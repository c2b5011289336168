"""Per-step load-balancing metrics of every ``MoELayer`` (DESIGN.md section 3, "Metrics").

Each router sums its training forwards' statistics over the step's microbatches
(``TopKRouter.step_routed_counts`` and ``step_dropped_rerouted``); :func:`collect_moe_metrics`
reduces them over the process groups, resets them and returns a :class:`MoEStepMetrics` with,
per MoE layer (keyed by Megatron's global 1-based ``layer_number``):

* ``maxvio``: ``(max_j load_j - mean_j load_j) / mean_j load_j`` on the global counts;
* ``ep_load_factor``: max over EP ranks of the pairs its experts receive, over the mean;
* ``dropped`` / ``rerouted``: (token, slot) pairs over the global batch;
* ``bias_mean/std/min/max`` of ``expert_bias`` (None without a bias);
* ``local_tokens_per_expert`` ``[E]`` (routed by this rank), ``received_tokens_per_expert``
  ``[E / EP]`` (what this rank's experts receive from its EP group) and
  ``global_tokens_per_expert`` ``[E]``.

Training loop, once per optimizer step that logs, on EVERY rank (the function runs collectives and
reads the counts to the host; the other steps call :func:`reset_moe_step_statistics`, which does neither)::

    loss = forward_backward(chunks, microbatches, seq, mbs, read_loss=False)
    optimizer.step()
    moe = collect_moe_metrics(chunks, ps.get_expert_model_parallel_group(),
                              dp_group=<the group passed to update_expert_biases>,
                              pp_group=ps.get_pipeline_model_parallel_group())
    update_expert_biases(chunks, <that group>)  # after collecting: bias stats = this step's bias
    logger.log_iteration(..., extra=moe.scalars())          # the logging (last) rank
    moe.log_tensorboard(rank_logger, iteration, rank, write_heatmap=rank == last_rank)

TensorBoard layout (chosen so every rank's own load is visible and it works under PP): each
rank owns a ``MetricsLogger(train_iters, tensorboard_dir=f"{tb_dir}/rank_{rank}")`` (the
logging rank may reuse its main logger) and writes a histogram of the pairs received by each of
its local experts, tag ``moe/tokens_per_expert/rank_{rank}/layer_{l}``, for the MoE layers of
its own pipeline stage; no gather is needed. Scalars and the ``layers x experts`` load heatmap
(``moe/load_heatmap``, global counts over the mean load, white = 2x mean) need every layer,
so ``pp_group`` gathers the per-layer summaries across pipeline stages first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["MoELayerMetrics", "MoEStepMetrics", "collect_moe_metrics", "reset_moe_step_statistics", "max_violation",
           "ep_load_factor"]


def max_violation(loads: torch.Tensor) -> float:
    """``(max - mean) / mean`` of a ``[E]`` load vector (0 when nothing was routed)."""
    loads = loads.double()
    mean = loads.mean()
    return 0.0 if mean == 0 else float((loads.max() - mean) / mean)


def ep_load_factor(ep_counts: torch.Tensor, ep_size: int) -> float:
    """Max over EP ranks of the pairs received (experts in contiguous blocks of ``E / ep_size``)
    over the mean, from ``[E]`` counts summed over the EP group (1.0 when nothing was routed)."""
    received = ep_counts.double().view(ep_size, -1).sum(dim=1)
    mean = received.mean()
    return 1.0 if mean == 0 else float(received.max() / mean)


@dataclass
class MoELayerMetrics:
    layer: int
    maxvio: float
    ep_load_factor: float
    dropped: int
    rerouted: int
    bias_mean: float | None
    bias_std: float | None
    bias_min: float | None
    bias_max: float | None
    global_tokens_per_expert: list[int]
    # Only on the ranks of the layer's own pipeline stage (None when gathered from another).
    local_tokens_per_expert: list[int] | None = None
    received_tokens_per_expert: list[int] | None = None


@dataclass
class MoEStepMetrics:
    layers: list[MoELayerMetrics] = field(default_factory=list)

    def scalars(self) -> dict[str, float]:
        """Flat ``moe/...`` scalars for ``MetricsLogger.log_iteration(extra=...)``."""
        out: dict[str, float] = {}
        if not self.layers:
            return out
        for m in self.layers:
            out[f"moe/maxvio/layer_{m.layer}"] = m.maxvio
            out[f"moe/ep_load_factor/layer_{m.layer}"] = m.ep_load_factor
            out[f"moe/dropped/layer_{m.layer}"] = m.dropped
            out[f"moe/rerouted/layer_{m.layer}"] = m.rerouted
            if m.bias_std is not None:
                for stat in ("mean", "std", "min", "max"):
                    out[f"moe/bias_{stat}/layer_{m.layer}"] = getattr(m, f"bias_{stat}")
        out["moe/maxvio/mean"] = sum(m.maxvio for m in self.layers) / len(self.layers)
        out["moe/maxvio/max"] = max(m.maxvio for m in self.layers)
        out["moe/ep_load_factor/max"] = max(m.ep_load_factor for m in self.layers)
        out["moe/dropped"] = sum(m.dropped for m in self.layers)
        out["moe/rerouted"] = sum(m.rerouted for m in self.layers)
        return out

    def load_matrix(self) -> torch.Tensor:
        """``[layers, E]`` global load over the mean load of each layer (1 = balanced)."""
        counts = torch.tensor([m.global_tokens_per_expert for m in self.layers], dtype=torch.float64)
        return counts / counts.mean(dim=1, keepdim=True).clamp(min=1e-12)

    def log_tensorboard(self, metrics_logger, iteration: int, rank: int, write_heatmap: bool = True) -> None:
        """This rank's per-expert received-pair histograms (its own stage's layers) and, when
        asked, the ``layers x experts`` load heatmap (see the module docstring)."""
        for m in self.layers:
            if m.received_tokens_per_expert is not None:
                metrics_logger.add_histogram(f"moe/tokens_per_expert/rank_{rank}/layer_{m.layer}",
                                             torch.tensor(m.received_tokens_per_expert, dtype=torch.float64),
                                             iteration)
        if write_heatmap and self.layers:
            metrics_logger.add_heatmap("moe/load_heatmap", self.load_matrix().numpy(), iteration, vmax=2.0)


def _moe_layers(model_chunks):
    from megatron_ext.moe.layer import MoELayer

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, MoELayer)]


def _summed(tensor: torch.Tensor, group) -> torch.Tensor:
    total = tensor.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def _bias_stats(bias: torch.Tensor | None) -> tuple:
    if bias is None:
        return None, None, None, None
    b = bias.detach().float()
    return float(b.mean()), float(b.std(unbiased=False)), float(b.min()), float(b.max())


@torch.no_grad()
def collect_moe_metrics(model_chunks, ep_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None = None,
                        pp_group: dist.ProcessGroup | None = None, reset: bool = True) -> MoEStepMetrics:
    """Metrics of the step just run, for every ``MoELayer`` in ``model_chunks``; then (``reset``)
    clear the routers' step sums. Call on every rank, once per step, after the microbatches.

    ``ep_group``: the expert-parallel group (None: EP = 1). ``dp_group``: every rank of this
    pipeline stage that routes different tokens (data x expert x tensor-under-SP: the group
    given to ``update_expert_biases``), so ``global`` means the whole global batch; None: the
    EP group only. ``pp_group``: gather the per-layer summaries of all pipeline stages.
    """
    layers = _moe_layers(model_chunks)
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    results = []
    if layers:
        # One collective per group for all layers: [layers, E + 2] = counts, dropped, rerouted.
        local = torch.stack([torch.cat([m.router.step_routed_counts, m.router.step_dropped_rerouted])
                             for m in layers])
        ep_total = _summed(local, ep_group)
        global_total = ep_total if dp_group is None else _summed(local, dp_group)
        num_experts = local.shape[1] - 2
        num_local = num_experts // ep_size
        for i, module in enumerate(layers):
            global_counts = global_total[i, :num_experts]
            results.append(MoELayerMetrics(
                layer=int(module.layer_number or i + 1),
                maxvio=max_violation(global_counts),
                ep_load_factor=ep_load_factor(ep_total[i, :num_experts], ep_size),
                dropped=int(global_total[i, num_experts]),
                rerouted=int(global_total[i, num_experts + 1]),
                **dict(zip(("bias_mean", "bias_std", "bias_min", "bias_max"), _bias_stats(module.router.expert_bias))),
                global_tokens_per_expert=global_counts.tolist(),
                local_tokens_per_expert=local[i, :num_experts].tolist(),
                received_tokens_per_expert=ep_total[i, ep_rank * num_local:(ep_rank + 1) * num_local].tolist(),
            ))
    if reset:
        reset_moe_step_statistics(model_chunks)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        results = _gather_stages(results, pp_group)
    return MoEStepMetrics(sorted(results, key=lambda m: m.layer))


def reset_moe_step_statistics(model_chunks) -> None:
    """Zero every router's step sums without reading them (no collective, no host read): what a training step
    that logs nothing does in place of :func:`collect_moe_metrics`."""
    for module in _moe_layers(model_chunks):
        module.router.reset_step_statistics()


def _gather_stages(mine: list[MoELayerMetrics], pp_group) -> list[MoELayerMetrics]:
    """Every stage's layers; other stages' layers arrive without their rank-local counts."""
    shared = [MoELayerMetrics(**{**vars(m), "local_tokens_per_expert": None, "received_tokens_per_expert": None})
              for m in mine]
    gathered: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, shared, group=pp_group)
    own = {m.layer for m in mine}
    return mine + [m for stage in gathered for m in stage if m.layer not in own]
