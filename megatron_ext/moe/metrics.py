"""Per-step load-balancing metrics of every ``MoELayer`` (DESIGN.md section 3, "Metrics").

Each router sums its training forwards' statistics over the step's microbatches
(``TopKRouter.step_routed_counts`` and ``step_dropped_rerouted``); :func:`collect_moe_metrics`
reduces them over the process groups, resets them and returns a :class:`MoEStepMetrics` with,
per MoE layer (keyed by Megatron's global 1-based ``layer_number``):

* ``maxvio``: ``(max_j load_j - mean_j load_j) / mean_j load_j`` on the global counts;
* ``ep_load_factor``: max over EP ranks of the pairs its experts receive, over the mean, and
  ``ep_most_loaded_rank``: which EP rank that is (the straggler of the all-to-all);
* ``dropped`` / ``rerouted``: (token, slot) pairs over the global batch;
* ``bias_mean/std/min/max`` of ``expert_bias`` (None without a bias);
* ``local_tokens_per_expert`` ``[E]`` (routed by this rank), ``received_tokens_per_expert``
  ``[E / EP]`` (what this rank's experts receive from its EP group) and
  ``global_tokens_per_expert`` ``[E]``; ``ep_rank_load``: this rank's received pairs over the mean of its
  EP group.

Training loop, once per optimizer step that logs, on EVERY rank (the function runs collectives and
reads the counts to the host; the other steps call :func:`reset_moe_step_statistics`, which does neither)::

    loss = forward_backward(chunks, microbatches, seq, mbs, read_loss=False)
    optimizer.step()
    moe = collect_moe_metrics(chunks, ps.get_expert_model_parallel_group(),
                              dp_group=<the group passed to update_expert_biases>,
                              pp_group=ps.get_pipeline_model_parallel_group())
    update_expert_biases(chunks, <that group>)  # after collecting: bias stats = this step's bias
    extra = {**moe.scalars(), **(moe.expert_load_record() if images_step else {})}
    logger.log_iteration(..., extra=extra)          # the logging (last) rank
    moe.log_tensorboard(rank_logger, iteration, rank,
                        global_logger=logger if rank == last_rank and images_step else None)

TensorBoard layout (chosen so every rank's own load is visible and it works under PP):

* the main run (the logging rank's ``MetricsLogger``): the scalars of :meth:`MoEStepMetrics.scalars`
  every logged step (all layers: ``pp_group`` gathers the per-layer summaries across pipeline
  stages first, so a layer of another stage appears once); on the image steps the
  ``layers x experts`` figure ``moe/load_heatmap`` (:mod:`megatron_ext.moe.load_figures`) and, per
  layer, ``moe/expert_load/layer_{l}``: the global tokens per expert as a histogram with one bucket
  per expert id (the x axis is the expert, the height its tokens; exact counts, read back by
  ``tools/expert_load.py``);
* one run per rank (``MetricsLogger(train_iters, tensorboard_dir=f"{tb_dir}/rank_{rank}")``), for
  the MoE layers of its own stage, no gather needed: ``moe/ep_rank_load/layer_{l}`` = the pairs
  this rank's experts received over the mean of its EP group (TensorBoard draws one curve per rank
  run, so a straggler rank is the curve above 1), ``moe/ep_rank_load/mean`` over its layers, and
  the histogram ``moe/tokens_per_expert/rank_{rank}/layer_{l}`` of the pairs each local expert
  received.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["MoELayerMetrics", "MoEStepMetrics", "collect_moe_metrics", "reset_moe_step_statistics", "max_violation",
           "ep_load_factor", "ep_rank_loads"]


def max_violation(loads: torch.Tensor) -> float:
    """``(max - mean) / mean`` of a ``[E]`` load vector (0 when nothing was routed)."""
    loads = loads.double()
    mean = loads.mean()
    return 0.0 if mean == 0 else float((loads.max() - mean) / mean)


def ep_rank_loads(ep_counts: torch.Tensor, ep_size: int) -> torch.Tensor:
    """``[ep_size]`` pairs received by each EP rank (experts in contiguous blocks of ``E / ep_size``)
    over the mean, from ``[E]`` counts summed over the EP group (all 1 when nothing was routed)."""
    received = ep_counts.double().view(ep_size, -1).sum(dim=1)
    mean = received.mean()
    return torch.ones_like(received) if mean == 0 else received / mean


def ep_load_factor(ep_counts: torch.Tensor, ep_size: int) -> float:
    """Max over EP ranks of the pairs received over the mean (see :func:`ep_rank_loads`)."""
    return float(ep_rank_loads(ep_counts, ep_size).max())


@dataclass
class MoELayerMetrics:
    layer: int
    maxvio: float
    ep_load_factor: float
    ep_most_loaded_rank: int
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
    ep_rank_load: float | None = None


@dataclass
class MoEStepMetrics:
    layers: list[MoELayerMetrics] = field(default_factory=list)
    ep_size: int = 1

    def scalars(self) -> dict[str, float]:
        """Flat ``moe/...`` scalars for ``MetricsLogger.log_iteration(extra=...)``."""
        out: dict[str, float] = {}
        if not self.layers:
            return out
        for m in self.layers:
            out[f"moe/maxvio/layer_{m.layer}"] = m.maxvio
            out[f"moe/ep_load_factor/layer_{m.layer}"] = m.ep_load_factor
            out[f"moe/ep_most_loaded_rank/layer_{m.layer}"] = m.ep_most_loaded_rank
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
        out["moe/ep_size"] = self.ep_size  # how tools/expert_load.py finds the ranks' expert blocks
        return out

    def expert_load_record(self) -> dict[str, dict[str, list[int]]]:
        """Global tokens per expert of every layer, for ``metrics.jsonl`` on the image steps only
        (``E`` numbers per layer: too many for every logged step of a large model)."""
        return {"moe/tokens_per_expert": {str(m.layer): m.global_tokens_per_expert for m in self.layers}}

    def load_matrix(self) -> torch.Tensor:
        """``[layers, E]`` global load over the mean load of each layer (1 = balanced)."""
        counts = torch.tensor([m.global_tokens_per_expert for m in self.layers], dtype=torch.float64)
        return counts / counts.mean(dim=1, keepdim=True).clamp(min=1e-12)

    def log_tensorboard(self, rank_logger, iteration: int, rank: int, global_logger=None) -> None:
        """This rank's load into its own run (its own stage's layers) and, with ``global_logger``
        (the main run, on image steps), the heatmap figure and the per-expert global load of every
        layer (see the module docstring)."""
        own = [m for m in self.layers if m.ep_rank_load is not None]
        for m in own:
            rank_logger.add_scalar(f"moe/ep_rank_load/layer_{m.layer}", m.ep_rank_load, iteration)
            rank_logger.add_histogram(f"moe/tokens_per_expert/rank_{rank}/layer_{m.layer}",
                                      torch.tensor(m.received_tokens_per_expert, dtype=torch.float64), iteration)
        if own:
            rank_logger.add_scalar("moe/ep_rank_load/mean", sum(m.ep_rank_load for m in own) / len(own), iteration)
        if global_logger is None or not self.layers:
            return
        from megatron_ext.moe.load_figures import heatmap_figure_image

        for m in self.layers:
            global_logger.add_bar_histogram(f"moe/expert_load/layer_{m.layer}", m.global_tokens_per_expert, iteration)
        global_logger.add_image("moe/load_heatmap", heatmap_figure_image(
            self.load_matrix().numpy(), [m.layer for m in self.layers], self.ep_size,
            title=f"iteration {iteration}"), iteration)


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
            rank_loads = ep_rank_loads(ep_total[i, :num_experts], ep_size)
            results.append(MoELayerMetrics(
                layer=int(module.layer_number or i + 1),
                maxvio=max_violation(global_counts),
                ep_load_factor=float(rank_loads.max()),
                ep_most_loaded_rank=int(rank_loads.argmax()),
                ep_rank_load=float(rank_loads[ep_rank]),
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
    return MoEStepMetrics(sorted(results, key=lambda m: m.layer), ep_size=ep_size)


def reset_moe_step_statistics(model_chunks) -> None:
    """Zero every router's step sums without reading them (no collective, no host read): what a training step
    that logs nothing does in place of :func:`collect_moe_metrics`."""
    for module in _moe_layers(model_chunks):
        module.router.reset_step_statistics()


def _gather_stages(mine: list[MoELayerMetrics], pp_group) -> list[MoELayerMetrics]:
    """Every stage's layers; other stages' layers arrive without their rank-local counts."""
    shared = [MoELayerMetrics(**{**vars(m), "local_tokens_per_expert": None, "received_tokens_per_expert": None,
                                 "ep_rank_load": None}) for m in mine]
    gathered: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, shared, group=pp_group)
    own = {m.layer for m in mine}
    return mine + [m for stage in gathered for m in stage if m.layer not in own]
