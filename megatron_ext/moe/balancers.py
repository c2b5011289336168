"""The MoE router's load balancers (``config.moe_balancer``) as small strategy objects, built once per router by
:func:`build_balancer`.

A :class:`Balancer` is three parts, one class per behaviour, composed per ``moe_balancer`` value:

* ``routing``, how a training forward routes: :class:`TopK` (plain top-k) or :class:`Capacity` (quantile capacity
  routing over the capacity group, :class:`~megatron_ext.moe.quantile_capacity.CapacityRouting`); evaluation
  always routes by plain top-k;
* ``bias``, what selection adds to the scores before top-k and how that bias moves after each optimizer step:
  None, :class:`SignBias` (``b += u * sign(mean load - load)``) or :class:`DualBias` (the ``k/E`` quantiles of
  the residuals, re-centred);
* ``loss``, what it adds to the loss: None or :class:`AuxLoss` (Switch-style, injected into backward).

| ``moe_balancer`` | routing | bias | loss |
| --- | --- | --- | --- |
| ``none`` | TopK | - | - |
| ``aux_loss`` | TopK | - | AuxLoss |
| ``sign_bias`` | TopK | SignBias | - |
| ``qb_capacity`` | Capacity | - | - |
| ``qb_bias`` | TopK | DualBias | - |
| ``qb_both`` | Capacity | DualBias | - |

The parts hold settings and per-router caches only. The state lives on the router as buffers, so its
``state_dict`` keys stay what checkpoints hold: ``expert_bias`` (saved) and the step statistics
``step_tokens_per_expert`` and ``step_residual_histogram`` (not saved), created from :meth:`Balancer.buffers`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_ext.errors import ConfigError
from megatron_ext.moe.quantile_capacity import ROUNDS_IMPLS, CapacityRouting
from megatron_ext.moe.quantile_dual_bias import dual_bias_histogram, dual_bias_range, dual_bias_updates
from megatron_ext.moe.quantile_routing import Routing, topk_routing

__all__ = ["Balancer", "TopK", "Capacity", "SignBias", "DualBias", "AuxLoss", "AuxLossInjector", "BALANCERS",
           "build_balancer"]


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


# --- routing ------------------------------------------------------------------------------------------------------

class TopK:
    """Plain top-k of ``scores + bias``."""

    def __init__(self, k: int):
        self.k = k

    def route(self, scores: torch.Tensor, bias: torch.Tensor | None, renormalize: bool, training: bool) -> Routing:
        return topk_routing(scores, self.k, bias, renormalize=renormalize)

    def place(self, device: torch.device) -> None:
        pass


class Capacity(TopK):
    """While training, quantile capacity routing: at most ``ceil(moe_expert_capacity_factor * N_group * k / E)``
    pairs per expert over the capacity group, overflow to the next-best expert with room, else dropped. The Torch
    or Triton rounds and the CUDA-graph replay are decided by :class:`CapacityRouting` for the router's device."""

    def __init__(self, k: int, capacity: CapacityRouting):
        super().__init__(k)
        self.capacity = capacity

    def route(self, scores, bias, renormalize, training):
        if not training:  # not causal: evaluation and inference route by plain top-k
            return super().route(scores, bias, renormalize, training)
        return self.capacity(scores, bias, renormalize)

    def place(self, device: torch.device) -> None:
        self.capacity.place(device)


# --- bias ---------------------------------------------------------------------------------------------------------

class _ExpertBias:
    """An fp32 ``expert_bias [E]`` added to the scores for selection only (gates stay unbiased), updated once per
    optimizer step from statistics summed over the step's training forwards."""

    def buffers(self, num_experts: int, num_bins: int, device) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, tensor, persistent) of the router buffers this bias needs, in registration order."""
        return [("expert_bias", torch.zeros(num_experts, device=device), True),
                ("step_tokens_per_expert", torch.zeros(num_experts, device=device), False)]

    def observe(self, router, scores: torch.Tensor, counts: torch.Tensor) -> None:
        """Add a counted training forward (once per microbatch) to the step's statistics."""

    def batch_key(self, router) -> tuple | None:
        """Routers with the same key are updated together by one :meth:`update` call; None: alone."""
        return None

    def update(self, routers: list, group) -> None:
        raise NotImplementedError


class SignBias(_ExpertBias):
    """Loss-free bias: ``b_j += u * sign(mean_load - load_j)`` from the step's loads summed over ``group``."""

    def __init__(self, rate: float):
        self.rate = rate

    def observe(self, router, scores, counts):  # the only update that reads the loads
        router.step_tokens_per_expert += counts.float()

    @torch.no_grad()
    def update(self, routers, group):
        for router in routers:
            loads = _all_reduced(router.step_tokens_per_expert, group)
            router.expert_bias += self.rate * torch.sign(loads.mean() - loads)
            router.step_tokens_per_expert.zero_()


class DualBias(_ExpertBias):
    """Dual bias (Kimi K3): per microbatch a histogram of ``r_ij = alpha_i - s_ij`` (``num_bins`` bins over a range
    fixed by the bias), summed into ``step_residual_histogram``; after the step the bias becomes the per-expert
    ``k/E`` quantiles of the residuals over ``group``, re-centred. Routers of the same shape update together."""

    def __init__(self, k: int, num_bins: int):
        self.k, self.num_bins = k, num_bins
        self._range: tuple | None = None  # (bias, its version, lo, hi, num_bins / (hi - lo))

    def buffers(self, num_experts, num_bins, device):
        histogram = torch.zeros(num_experts, num_bins, dtype=torch.int64, device=device)
        return super().buffers(num_experts, num_bins, device) + [("step_residual_histogram", histogram, False)]

    def observe(self, router, scores, counts):
        lo, hi, scale = self.range(router.expert_bias)  # fixed for the step: the bias moves only at updates
        router.step_residual_histogram += dual_bias_histogram(scores.detach(), router.expert_bias, self.k, lo, hi,
                                                              self.num_bins, scale)

    def range(self, bias: torch.Tensor) -> tuple:
        """``dual_bias_range(bias)`` and ``num_bins / (hi - lo)``, computed once per value of the bias: kept until
        the bias is replaced or changed in place (its version counter moves on every in-place write: the update's
        copy, ``load_state_dict``, ``.copy_``). A write through ``expert_bias.data`` does not move it; nothing
        here writes that way."""
        cached = self._range
        if cached is None or cached[0] is not bias or cached[1] != bias._version:
            lo, hi = dual_bias_range(bias)
            cached = self._range = (bias, bias._version, lo, hi, self.num_bins / (hi - lo))
        return cached[2:]

    def batch_key(self, router):
        return ("dual_bias", router.num_experts, self.num_bins, self.k, router.expert_bias.device)

    @torch.no_grad()
    def update(self, routers, group):
        """One all-reduce of the routers' stacked histograms and one batched quantile computation
        (:func:`~megatron_ext.moe.quantile_dual_bias.dual_bias_updates`); each bias ends exactly where its own
        update would put it. A step without a training forward (empty histogram) keeps the bias: decided on the
        device, since a host read here would wait for the optimizer step."""
        histograms = [r.step_residual_histogram for r in routers]
        biases = [r.expert_bias for r in routers]
        counts = torch.stack(histograms)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        updated = dual_bias_updates(counts, torch.stack(biases), self.k)
        torch._foreach_copy_(biases, list(updated.unbind(0)))
        torch._foreach_zero_(histograms)


def _all_reduced(tensor: torch.Tensor, group) -> torch.Tensor:
    total = tensor.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


# --- loss ---------------------------------------------------------------------------------------------------------

class AuxLoss:
    """Switch loss ``coeff * E * sum_j f_j * P_j`` on this rank's tokens (f_j = share of (token, slot) pairs sent to
    j, P_j = mean over tokens of j's probability, sigmoid scores normalised per token), injected into backward by
    :class:`AuxLossInjector`: the forward activations are unchanged. The value is kept in ``router.last_aux_loss``."""

    def __init__(self, coeff: float, k: int, num_experts: int, softmax: bool):
        self.coeff, self.k, self.num_experts, self.softmax = coeff, k, num_experts, softmax

    def value(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        probs = scores if self.softmax else scores / scores.sum(-1, keepdim=True)
        num_pairs = scores.shape[0] * self.k
        load_share = counts.float() / max(num_pairs, 1)
        mean_prob = probs.mean(dim=0)
        return self.coeff * self.num_experts * (load_share * mean_prob).sum()

    def inject(self, router, scores: torch.Tensor, counts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        aux_loss = self.value(scores, counts)
        router.last_aux_loss = aux_loss.detach()
        return AuxLossInjector.apply(gates, aux_loss)


# --- the balancer and its factory ----------------------------------------------------------------------------------

class Balancer(NamedTuple):
    name: str
    routing: TopK
    bias: _ExpertBias | None = None
    loss: AuxLoss | None = None

    def buffers(self, num_experts: int, num_bins: int, device) -> list[tuple[str, torch.Tensor, bool]]:
        return [] if self.bias is None else self.bias.buffers(num_experts, num_bins, device)

    def route(self, scores, bias, renormalize: bool, training: bool) -> Routing:
        return self.routing.route(scores, bias, renormalize, training)

    def observe(self, router, scores, counts, gates) -> torch.Tensor:
        """A counted training forward: the aux loss into the gates' backward, the bias's step statistics."""
        if self.loss is not None:
            gates = self.loss.inject(router, scores, counts, gates)
        if self.bias is not None:
            self.bias.observe(router, scores, counts)
        return gates

    def place(self, device: torch.device) -> None:
        self.routing.place(device)


# moe_balancer -> (routing, bias, loss) part classes
_PARTS = {
    "none": (TopK, None, None),
    "aux_loss": (TopK, None, AuxLoss),
    "sign_bias": (TopK, SignBias, None),
    "qb_capacity": (Capacity, None, None),
    "qb_bias": (TopK, DualBias, None),
    "qb_both": (Capacity, DualBias, None),
}
BALANCERS = tuple(_PARTS)
CAPACITY_BALANCERS = tuple(name for name, parts in _PARTS.items() if parts[0] is Capacity)


def check_balancer_settings(config) -> None:
    """The balancer settings of ``config``: a bad value raises :class:`~megatron_ext.errors.ConfigError` naming
    the key (HybridConfig calls this at start, before any process group exists; build_balancer again)."""
    name = getattr(config, "moe_balancer", "none")
    if name not in _PARTS:
        raise ConfigError(f"moe_balancer={name!r}; allowed: {', '.join(BALANCERS)}")
    if config.moe_router_enable_expert_bias:
        # Megatron's finalize_model_grads would update our expert_bias a second time.
        raise ConfigError("moe_router_enable_expert_bias must be False with megatron_ext's MoE router; "
                          "select the loss-free bias with moe_balancer='sign_bias' instead")
    if config.moe_router_score_function not in ("sigmoid", "softmax"):
        raise ConfigError(f"moe_router_score_function must be 'sigmoid' or 'softmax', "
                          f"got {config.moe_router_score_function!r}")
    num_bins = getattr(config, "moe_qb_num_bins", 1000)
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ConfigError(f"moe_qb_num_bins must be a positive int, got {num_bins!r}")
    if getattr(config, "moe_qb_cuda_graph", None) and getattr(config, "moe_qb_host_reads", None):
        raise ConfigError("moe_qb_cuda_graph=True needs moe_qb_host_reads=False (a CUDA graph cannot read the "
                          "device back to the host)")
    if name == "aux_loss" and not config.moe_aux_loss_coeff > 0:
        raise ConfigError(f"moe_balancer='aux_loss' needs moe_aux_loss_coeff > 0 (e.g. 1e-2, Switch "
                          f"Transformer's), got {config.moe_aux_loss_coeff!r}")
    if name in CAPACITY_BALANCERS:
        capacity_factor = config.moe_expert_capacity_factor
        if not (capacity_factor is not None and capacity_factor > 0):
            raise ConfigError(f"moe_expert_capacity_factor must be > 0 when moe_balancer={name!r}, "
                              f"got {capacity_factor!r} (e.g. 1.25)")
        rounds = getattr(config, "moe_qb_rounds_impl", "auto")
        if rounds not in ROUNDS_IMPLS:
            raise ConfigError(f"moe_qb_rounds_impl={rounds!r}; allowed: {', '.join(ROUNDS_IMPLS)}")
    elif config.moe_expert_capacity_factor is not None:
        raise ConfigError(f"moe_expert_capacity_factor is only used by moe_balancer in {CAPACITY_BALANCERS}; "
                          f"leave it None for {name!r}")


def build_balancer(config, capacity_group: dist.ProcessGroup | None = None, device="cpu") -> Balancer:
    """The balancer ``config.moe_balancer`` names (default ``"none"``), with its settings checked: a bad value
    raises :class:`~megatron_ext.errors.ConfigError` naming the key. ``capacity_group`` and ``device`` (where the
    router's scores live) are for the capacity routing."""
    check_balancer_settings(config)
    name = getattr(config, "moe_balancer", "none")
    num_bins = getattr(config, "moe_qb_num_bins", 1000)
    routing_part, bias_part, loss_part = _PARTS[name]
    k, num_experts = config.moe_router_topk, config.num_moe_experts
    capacity_factor = config.moe_expert_capacity_factor

    if routing_part is Capacity:
        rounds = getattr(config, "moe_qb_rounds_impl", "auto")
        capacity = CapacityRouting(
            k, capacity_factor, num_bins=num_bins, group=capacity_group,
            # None: decided for the router's device (CapacityRouting.place)
            device_rounds=getattr(config, "moe_qb_device_rounds", None),
            host_reads=getattr(config, "moe_qb_host_reads", None), rounds=rounds,
            cuda_graph=getattr(config, "moe_qb_cuda_graph", None), device=device)
        routing = Capacity(k, capacity)
    else:
        routing = TopK(k)

    bias = None
    if bias_part is SignBias:
        bias = SignBias(config.moe_router_bias_update_rate)
    elif bias_part is DualBias:
        if not k < num_experts:
            raise ConfigError(f"moe_router_topk must be < num_moe_experts for moe_balancer={name!r}")
        bias = DualBias(k, num_bins)

    loss = None
    if loss_part is AuxLoss:
        loss = AuxLoss(config.moe_aux_loss_coeff, k, num_experts, config.moe_router_score_function == "softmax")
    return Balancer(name, routing, bias, loss)
