"""Device-agnostic top-k MoE router with a choice of load balancer.

``TopKRouter`` turns hidden states ``[N, h]`` into a :class:`~megatron_ext.moe.quantile.Routing`
(experts ``[N, k]``, fp32 gates ``[N, k]``). Logits, scores and every statistic are fp32.
Selection may use the fp32 ``expert_bias`` buffer; gates always come from the unbiased scores.

Balancers (``config.moe_balancer``):

* ``"none"``: plain top-k.
* ``"aux_loss"``: Switch-style loss ``coeff * E * sum_j f_j * P_j`` on this rank's tokens,
  injected into backward by :class:`AuxLossInjector` (the forward activations are unchanged).
* ``"sign_bias"``: loss-free bias, ``b_j += u * sign(mean_load - load_j)`` once per optimizer
  step from loads summed over the step's microbatches and the data/expert group
  (:meth:`TopKRouter.update_expert_bias`).
* ``"qb_capacity"``: quantile capacity routing while training (every expert takes at most
  ``ceil(moe_expert_capacity_factor * N_group * k / E)`` pairs over ``capacity_group``; refused
  pairs overflow to the next-best expert with room, else are dropped); plain top-k in eval.
* ``"qb_bias"``: dual bias; per microbatch a histogram of ``r_ij = alpha_i - s_ij`` is summed
  into ``step_residual_histogram``; :meth:`TopKRouter.update_expert_bias` all-reduces it and
  sets the bias to the per-expert ``k/E`` quantiles (re-centred).
* ``"qb_both"``: capacity routing on the dual-biased scores, plus the dual-bias update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule
from megatron_ext.moe.routing_graph import CapacityRoutingGraphs
from megatron_ext.moe.quantile import Routing, capacity_routing, dual_bias_histogram, dual_bias_range, topk_routing
from megatron_ext.moe.quantile_dual_bias import dual_bias_updates
from megatron_ext.moe.quantile_histogram import flat_counts

__all__ = ["TopKRouter", "AuxLossInjector", "BALANCERS", "expert_counts", "init_on_cpu", "param_device",
           "update_expert_biases", "discard_expert_bias_statistics"]

BALANCERS = ("none", "aux_loss", "sign_bias", "qb_capacity", "qb_bias", "qb_both")
_BIASED_BALANCERS = ("sign_bias", "qb_bias", "qb_both")
_CAPACITY_BALANCERS = ("qb_capacity", "qb_both")
_DUAL_BIAS_BALANCERS = ("qb_bias", "qb_both")


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


class AuxLossInjector(torch.autograd.Function):
    """Identity on ``activations`` whose backward also seeds ``d aux_loss = scale``.

    The scale is the one Megatron's pipeline schedule sets for its own aux losses
    (``MoEAuxLossAutoScaler.main_loss_backward_scale``: loss scale / num microbatches), so the
    aux loss is weighted like the main loss; 1.0 when no schedule has set it.
    """

    @staticmethod
    def forward(ctx, activations: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return activations.view_as(activations)

    @staticmethod
    def backward(ctx, grad_activations: torch.Tensor):
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        grad_aux = torch.ones_like(aux_loss) if scale is None else torch.ones_like(aux_loss) * scale.to(aux_loss)
        return grad_activations, grad_aux


def _choose_balancer(config) -> str:
    balancer = getattr(config, "moe_balancer", "none")
    if balancer not in BALANCERS:
        raise ValueError(f"moe_balancer must be one of {BALANCERS}, got {balancer!r}")
    if config.moe_router_enable_expert_bias:
        # Megatron's finalize_model_grads would update our expert_bias a second time.
        raise ValueError("moe_router_enable_expert_bias must be False with megatron_ext's MoE router; "
                         "select the loss-free bias with moe_balancer='sign_bias' instead")
    if balancer == "aux_loss" and not config.moe_aux_loss_coeff > 0:
        raise ValueError(f"moe_aux_loss_coeff must be > 0 when moe_balancer='aux_loss', "
                         f"got {config.moe_aux_loss_coeff!r}")
    capacity_factor = config.moe_expert_capacity_factor
    if balancer in _CAPACITY_BALANCERS and not (capacity_factor is not None and capacity_factor > 0):
        raise ValueError(f"moe_expert_capacity_factor must be > 0 when moe_balancer={balancer!r}, "
                         f"got {capacity_factor!r}")
    if balancer not in _CAPACITY_BALANCERS and capacity_factor is not None:
        raise ValueError(f"moe_expert_capacity_factor is only used by moe_balancer in {_CAPACITY_BALANCERS}; "
                         f"leave it None for {balancer!r}")
    if balancer in _DUAL_BIAS_BALANCERS and not config.moe_router_topk < config.num_moe_experts:
        raise ValueError(f"moe_router_topk must be < num_moe_experts for moe_balancer={balancer!r}")
    if config.moe_router_score_function not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_router_score_function must be 'sigmoid' or 'softmax', "
                         f"got {config.moe_router_score_function!r}")
    return balancer


class TopKRouter(MegatronModule):
    """Gate ``[E, h]``; ``forward(x [N, h]) -> (Routing, local_counts [E] int64)``.

    ``capacity_group``: the ranks whose tokens share one set of expert replicas (the EP group);
    capacity modes count tokens and enforce capacities over it (None: this rank alone).
    """

    def __init__(self, config, seed: int, capacity_group: dist.ProcessGroup | None = None):
        super().__init__(config)
        self.balancer = _choose_balancer(config)
        self.capacity_group = capacity_group
        self.num_bins = getattr(config, "moe_qb_num_bins", 1000)
        if not isinstance(self.num_bins, int) or self.num_bins < 1:
            raise ValueError(f"moe_qb_num_bins must be a positive int, got {self.num_bins!r}")
        self.device_rounds = getattr(config, "moe_qb_device_rounds", None)  # None: capacity_routing's default
        self.host_reads = getattr(config, "moe_qb_host_reads", True)
        # One-rank CUDA capacity routing replayed from CUDA graphs (needs host_reads False; config-checked).
        self.routing_graphs = CapacityRoutingGraphs() if getattr(config, "moe_qb_cuda_graph", False) else None
        if self.routing_graphs is not None and self.host_reads:
            raise ValueError("moe_qb_cuda_graph=True needs moe_qb_host_reads=False (a CUDA graph cannot read the "
                             "device back to the host)")
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        weight = init_on_cpu((self.num_experts, config.hidden_size), config.init_method, seed,
                             config.perform_initialization)
        self.weight = torch.nn.Parameter(weight.to(device=param_device(config), dtype=config.params_dtype))
        # Replicated over TP; under sequence parallelism each TP rank sees other tokens, so
        # Megatron all-reduces grads of params marked like this over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel

        device = self.weight.device
        if self.balancer in _BIASED_BALANCERS:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, device=device))
            self.register_buffer("step_tokens_per_expert", torch.zeros(self.num_experts, device=device),
                                 persistent=False)
        else:
            self.expert_bias = None
            self.step_tokens_per_expert = None
        histogram = None
        if self.balancer in _DUAL_BIAS_BALANCERS:
            histogram = torch.zeros(self.num_experts, self.num_bins, dtype=torch.int64, device=device)
        self.register_buffer("step_residual_histogram", histogram, persistent=False)
        # Statistics of the last forward, for metrics (detached).
        self.local_tokens_per_expert: torch.Tensor | None = None
        self._counts_per_rank: torch.Tensor | None = None  # global_tokens_per_expert, summed when read
        self._dual_range: tuple | None = None  # (bias, its version, lo, hi, num_bins / (hi - lo))
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
        if self.balancer in _CAPACITY_BALANCERS and self.training and self._graphed(scores):
            routing = self.routing_graphs(scores, self.topk, self.config.moe_expert_capacity_factor,
                                          bias=self.expert_bias, num_bins=self.num_bins,
                                          device_rounds=self.device_rounds, renormalize=renormalize)
        elif self.balancer in _CAPACITY_BALANCERS and self.training:
            routing = capacity_routing(scores, self.topk, self.config.moe_expert_capacity_factor,
                                       bias=self.expert_bias, num_bins=self.num_bins,
                                       group=self.capacity_group, renormalize=renormalize,
                                       device_rounds=self.device_rounds, host_reads=self.host_reads)
        else:
            routing = topk_routing(scores, self.topk, self.expert_bias, renormalize=renormalize)
        if self.config.moe_router_topk_scaling_factor is not None:
            routing.gates = routing.gates * self.config.moe_router_topk_scaling_factor
        counts = expert_counts(routing.experts, self.num_experts, all_kept=routing.plain)

        if self.balancer == "aux_loss" and counting:
            aux_loss = self.aux_loss(scores, counts)
            routing.gates = AuxLossInjector.apply(routing.gates, aux_loss)
            self.last_aux_loss = aux_loss.detach()
        if self.balancer == "sign_bias" and counting:  # the only update that reads the loads
            self.step_tokens_per_expert += counts.float()
        if self.step_residual_histogram is not None and counting:
            lo, hi, scale = self.dual_bias_range()  # fixed for the step: the bias moves only at updates
            self.step_residual_histogram += dual_bias_histogram(scores.detach(), self.expert_bias, self.topk,
                                                                lo, hi, self.num_bins, scale)

        self.record_statistics(routing, counts, counting)
        return routing, counts

    def _graphed(self, scores: torch.Tensor) -> bool:
        """Capacity routing from CUDA graphs: asked for, on CUDA, and one rank in the capacity group (the
        graphs hold no collectives); elsewhere the eager call, which gives the same routing."""
        group = self.capacity_group
        return (self.routing_graphs is not None and scores.is_cuda
                and (group is None or dist.get_world_size(group) == 1))

    def dual_bias_range(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``dual_bias_range(expert_bias)`` and ``num_bins / (hi - lo)``, computed once per value of
        the bias: kept until the bias is replaced or changed in place (its version counter moves
        on every in-place write: the update's copy, ``load_state_dict``, ``.copy_``). A write
        through ``expert_bias.data`` does not move it; nothing here writes that way."""
        bias = self.expert_bias
        cached = self._dual_range
        if cached is None or cached[0] is not bias or cached[1] != bias._version:
            lo, hi = dual_bias_range(bias)
            cached = self._dual_range = (bias, bias._version, lo, hi, self.num_bins / (hi - lo))
        return cached[2:]

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

    def aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch loss ``coeff * E * sum_j f_j * P_j``: f_j = share of (token, slot) pairs sent to
        j, P_j = mean over tokens of j's probability (sigmoid scores normalised per token)."""
        probs = scores if self.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
        num_pairs = scores.shape[0] * self.topk
        load_share = counts.float() / max(num_pairs, 1)
        mean_prob = probs.mean(dim=0)
        return self.config.moe_aux_loss_coeff * self.num_experts * (load_share * mean_prob).sum()

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
        if self.balancer == "sign_bias":
            loads = _all_reduced(self.step_tokens_per_expert, group)
            self.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(loads.mean() - loads)
            self.step_tokens_per_expert.zero_()
        elif self.balancer in _DUAL_BIAS_BALANCERS:
            _update_dual_biases([self], group)


def _all_reduced(tensor: torch.Tensor, group) -> torch.Tensor:
    total = tensor.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


@torch.no_grad()
def _update_dual_biases(routers: list[TopKRouter], group) -> None:
    """The dual-bias update of several routers (same experts, bins, top-k and device) at once: one
    all-reduce of their stacked histograms and one batched quantile computation
    (:func:`~megatron_ext.moe.quantile_dual_bias.dual_bias_updates`); each bias ends exactly where its
    own update would put it. A step without a training forward (empty histogram) keeps the bias: decided
    on the device, since a host read here would wait for the optimizer step."""
    histograms = [r.step_residual_histogram for r in routers]
    biases = [r.expert_bias for r in routers]
    counts = torch.stack(histograms)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    updated = dual_bias_updates(counts, torch.stack(biases), routers[0].topk)
    torch._foreach_copy_(biases, list(updated.unbind(0)))
    torch._foreach_zero_(histograms)


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
                if module.balancer in _DUAL_BIAS_BALANCERS:
                    key = (module.num_experts, module.num_bins, module.topk, module.expert_bias.device)
                    batches.setdefault(key, []).append(module)
                else:
                    module.update_expert_bias(group)
    for routers in batches.values():  # dict order: first appearance, the same on every rank
        _update_dual_biases(routers, group)


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
