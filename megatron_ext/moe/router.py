"""Device-agnostic top-k MoE router with a choice of load balancer.

``TopKRouter`` turns hidden states ``[N, h]`` into a :class:`~megatron_ext.moe.quantile.Routing`
(experts ``[N, k]``, fp32 gates ``[N, k]``). Logits, scores and every statistic are fp32.
Selection may use the fp32 ``expert_bias`` buffer; gates always come from the unbiased scores.

The balancer (``config.moe_balancer``: none, aux_loss, sign_bias, qb_capacity, qb_bias, qb_both) is a
:class:`~megatron_ext.moe.balancers.Balancer` built once at construction
(:func:`~megatron_ext.moe.balancers.build_balancer`): how a training forward routes (top-k or quantile capacity
routing), the bias added to the scores before top-k and its update after each optimizer step (sign rule or dual
bias), and the loss it adds (Switch aux loss). The router keeps the state as buffers (``expert_bias``, the step
statistics) and calls the balancer at three points: ``route`` and ``observe`` in :meth:`TopKRouter.forward`,
the bias's ``update`` in :meth:`TopKRouter.update_expert_bias` / :func:`update_expert_biases`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule
from megatron_ext.moe.balancers import BALANCERS, AuxLossInjector, build_balancer
from megatron_ext.moe.quantile_histogram import flat_counts
from megatron_ext.moe.quantile_routing import Routing

__all__ = ["TopKRouter", "AuxLossInjector", "BALANCERS", "expert_counts", "init_on_cpu", "param_device",
           "update_expert_biases", "discard_expert_bias_statistics"]

# The buffers a balancer's bias may ask for (Balancer.buffers), in registration order; those it does not ask for
# are None. Their names are checkpoint keys (expert_bias) and read by metrics and the training loop.
_BIAS_BUFFERS = ("expert_bias", "step_tokens_per_expert", "step_residual_histogram")


def expert_counts(experts: torch.Tensor, num_experts: int, all_kept: bool = False) -> torch.Tensor:
    """int64 ``[E]`` number of kept (token, slot) pairs per expert; ``-1`` (dropped) is ignored.
    ``all_kept``: the caller knows there is no ``-1`` (two kernels fewer)."""
    flat = experts.reshape(-1)
    if all_kept:
        return flat_counts(flat, num_experts)
    # Dropped pairs go to an overflow bin that is cut off (no boolean-mask host sync), and
    # index_add_ rather than bincount, which reads its max back to the host on CUDA.
    return flat_counts(flat.where(flat >= 0, num_experts), num_experts + 1)[:num_experts]


def param_device(config) -> torch.device:
    """Where parameters live: the current CUDA device unless CPU initialisation is asked for."""
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_on_cpu(shape, init_method, seed: int, perform_initialization: bool = True) -> torch.Tensor:
    """fp32 CPU tensor filled by ``init_method`` from a private seed.

    Using a private seed (and the CPU) makes the values independent of the device and of how
    the surrounding model is split, so EP=1 and EP=N layers start from the same weights.
    """
    tensor = torch.zeros(shape, dtype=torch.float32)
    if perform_initialization:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            init_method(tensor)
    return tensor


class TopKRouter(MegatronModule):
    """Gate ``[E, h]``; ``forward(x [N, h]) -> (Routing, local_counts [E] int64)``.

    ``capacity_group``: the ranks whose tokens share one set of expert replicas (the EP group);
    capacity modes count tokens and enforce capacities over it (None: this rank alone).
    """

    def __init__(self, config, seed: int, capacity_group: dist.ProcessGroup | None = None):
        super().__init__(config)
        self.capacity_group = capacity_group
        self.num_bins = getattr(config, "moe_qb_num_bins", 1000)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        device = param_device(config)
        # Chosen once: how it routes, the bias and its update, the loss (checks the config's balancer settings).
        self.balancer = build_balancer(config, capacity_group, device)
        weight = init_on_cpu((self.num_experts, config.hidden_size), config.init_method, seed,
                             config.perform_initialization)
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=config.params_dtype))
        # Replicated over TP; under sequence parallelism each TP rank sees other tokens, so
        # Megatron all-reduces grads of params marked like this over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel

        device = self.weight.device
        # The bias (saved: "expert_bias") and its step statistics (not saved), as the balancer asks.
        wanted = {name: (tensor, persistent)
                  for name, tensor, persistent in self.balancer.buffers(self.num_experts, self.num_bins, device)}
        for name in _BIAS_BUFFERS:
            if name in wanted:
                self.register_buffer(name, wanted[name][0], persistent=wanted[name][1])
            elif name == "step_residual_histogram":
                self.register_buffer(name, None, persistent=False)
            else:
                setattr(self, name, None)
        # Statistics of the last forward, for metrics (detached).
        self.local_tokens_per_expert: torch.Tensor | None = None
        self._counts_per_rank: torch.Tensor | None = None  # global_tokens_per_expert, summed when read
        self.last_aux_loss: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None
        self.last_rerouted: torch.Tensor | None = None
        # Sums over the step's training forwards, for megatron_ext.moe.metrics (which reads them
        # once per step and resets them): kept pairs per expert routed by this rank, and
        # [dropped, rerouted] pairs. int64, so module-wide float casts leave them alone.
        self.register_buffer("step_routed_counts", torch.zeros(self.num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("step_dropped_rerouted", torch.zeros(2, dtype=torch.int64, device=device),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # Module-wide casts (e.g. Float16Module's .bfloat16()) must not touch the fp32 bias and
        # load counters: detach them, apply, then only move them to the new device.
        kept = {name: self._buffers.pop(name) for name in ("expert_bias", "step_tokens_per_expert")
                if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            target = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device)).device
            self._buffers[name] = tensor.to(target)
        self.balancer.place(self.weight.device)  # the capacity routing's rounds follow the scores' device
        return self

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N, E]`` router scores."""
        logits = F.linear(hidden.float(), self.weight.float())
        return logits.sigmoid() if self.score_function == "sigmoid" else logits.softmax(dim=-1)

    def forward(self, hidden: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        scores = self.scores(hidden)
        # Sigmoid scores are always renormalised over the chosen k; softmax follows Megatron's
        # moe_router_pre_softmax (False: softmax over the chosen k, i.e. renormalised).
        renormalize = self.score_function == "sigmoid" or not self.config.moe_router_pre_softmax
        counting = self.training and torch.is_grad_enabled()  # once per microbatch, also under recompute
        routing = self.balancer.route(scores, self.expert_bias, renormalize, self.training)
        if self.config.moe_router_topk_scaling_factor is not None:
            routing.gates = routing.gates * self.config.moe_router_topk_scaling_factor
        counts = expert_counts(routing.experts, self.num_experts, all_kept=routing.plain)
        if counting:  # the aux loss into backward, the bias's step statistics
            routing.gates = self.balancer.observe(self, scores, counts, routing.gates)
        self.record_statistics(routing, counts, counting)
        return routing, counts

    def record_statistics(self, routing: Routing, counts: torch.Tensor, counting: bool) -> None:
        """Keep the last forward's statistics and, for a counted training forward (once per
        microbatch), add them to the step sums read by :mod:`megatron_ext.moe.metrics`."""
        self.local_tokens_per_expert = counts.detach()
        self.last_dropped, self.last_rerouted = routing.dropped, routing.rerouted
        if counting:
            self.step_routed_counts += counts.detach()
            if not routing.plain:  # plain top-k drops and reroutes nothing: adding zeros is skipped
                self.step_dropped_rerouted += torch.stack([routing.dropped, routing.rerouted]).to(
                    self.step_dropped_rerouted.device)

    def reset_step_statistics(self) -> None:
        self.step_routed_counts.zero_()
        self.step_dropped_rerouted.zero_()

    def record_global_counts(self, counts_per_rank: torch.Tensor) -> None:
        """Keep ``[P, E]`` counts per EP rank (from the dispatcher) for
        :attr:`global_tokens_per_expert`, summed only when read (the step does not read it)."""
        self._counts_per_rank = counts_per_rank.detach()

    @property
    def global_tokens_per_expert(self) -> torch.Tensor | None:
        """``[E]`` tokens per expert of the last forward, summed over the EP group."""
        return None if self._counts_per_rank is None else self._counts_per_rank.sum(dim=0)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Once per optimizer step, after the step's microbatches: all-reduce the step's statistics
        over ``group`` (every rank that routes part of the global batch through this layer:
        DP x EP x TP under sequence parallelism), update the bias, reset the statistics.
        sign_bias: ``b += u * sign(mean load - load)``; qb_bias/qb_both: ``b = k/E`` quantiles
        of the residuals, re-centred. No-op for balancers without a bias."""
        if self.balancer.bias is not None:
            self.balancer.bias.update([self], group)


def update_expert_biases(model_chunks, group: dist.ProcessGroup | None = None) -> None:
    """Call :meth:`TopKRouter.update_expert_bias` on every router in ``model_chunks`` (a module
    or a list of them), once per optimizer step, in the same order on every rank. Dual-bias routers
    of the same shape are updated together (one all-reduce and one batched update for all layers,
    instead of ~55 kernels and an all-reduce per layer), with the same result."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    batches: dict[tuple, list[TopKRouter]] = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and module.training:
                bias = module.balancer.bias
                key = None if bias is None else bias.batch_key(module)
                if key is None:
                    module.update_expert_bias(group)
                else:
                    batches.setdefault(key, []).append(module)
    for routers in batches.values():  # dict order: first appearance, the same on every rank
        routers[0].balancer.bias.update(routers, group)


@torch.no_grad()
def discard_expert_bias_statistics(model_chunks) -> None:
    """Zero every router's bias statistics without updating its bias: what a step whose update was
    skipped (a NaN/inf loss or grad norm, ``megatron_ext.training.nonfinite_guard``) does in place of
    :func:`update_expert_biases`, so neither its weights nor its biases move. No collective."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                for stats in (module.step_tokens_per_expert, module.step_residual_histogram):
                    if stats is not None:
                        stats.zero_()
