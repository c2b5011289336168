"""Kimi Delta Attention as the ``self_attention`` of a Megatron-Core ``TransformerLayer``.

Data flow for one layer (``H_l`` = KDA heads on this TP rank, ``K`` = ``V`` = head dim,
``s`` = full sequence, ``s_l`` = the local shard under sequence parallelism, else ``s``)::

    x [s_l, b, h]
      x_s   = x all-gathered over the sequence, once (under SP; else x)      [s, b, h]
      q/k/v = ColumnParallel(x_s) [s, b, H_l*K] -> causal depthwise conv + SiLU -> [b, s, H_l, K]
      f     = up(down(x))       [s, b, H_l*K]  (low-rank, raw gate input)     -> [b, s, H_l, K] view
      beta  = sigmoid(ColumnParallel(x_s))     [s, b, H_l]                     -> [b, s, H_l]
      o     = KDA(q, k, v, f, beta; A_log, dt_bias)   gate + q/k L2 norm in the kernel  [b, s, H_l, V]
      o     = RMSNorm_V(o) * sigmoid(up(down(x)))     per head, weight [V] shared by heads  -> [s, b, H_l, V]
      out   = RowParallel(o [s, b, H_l*V])  -> [s_l, b, h]  (reduce-scatter under SP)

The kernels work batch-first, Megatron sequence-first: the layout changes ride on kernels that read through
strides (the conv's store, the gate kernels' reads of f and writes of df, the norm's reads of o and writes of do),
so no activation or gradient of this layer is copied only to change its layout.

The projections of one input (q, k, v, beta of x_s; the gates' downs of x, the same tensor at TP 1) run as one
autograd node with the column linears' weights (their forward is not called): its backward sums their input
gradients inside the GEMMs, as one fused QKV projection would (shared_input.py). Under TP the four
projections of x_s share one all-gather in forward and one reduce-scatter (without SP: one all-reduce) of
their summed input gradient in backward. Each Megatron linear on its own would gather x in forward, gather it again and
reduce-scatter its gradient in backward: 4 + 8 hidden-wide collectives under SP become 1 + 1 (without SP,
4 backward all-reduces become 1). The price: the gathered x is kept for the weight gradients, ``(tp - 1)
/ tp`` of ``s*b*h`` more activation memory per layer. The low-rank down projections run on the shard and
gather rank-sized activations (see lowrank.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.utils import get_pg_size

from kimi_kernels.rms_norm import rms_norm
from megatron_ext.config import ConfigError
from megatron_ext.kda.conv import CausalShortConv, convolve_together
from megatron_ext.kda.core import kda_core
from megatron_ext.kda.lowrank import LowRankProjection
from megatron_ext.kda.shared_input import project_shared_input
from megatron_ext.kda.sharding import (
    TPShardedModule,
    full_sequence,
    head_split_parameter,
    param_device,
)

# Kimi Linear / fla initialisation of the decay parameters.
A_RANGE = (1.0, 16.0)  # A = exp(A_log) ~ U(1, 16) per head
DT_RANGE = (1e-3, 1e-1)  # dt log-uniform; dt_bias = softplus^-1(dt) per channel
DT_FLOOR = 1e-4


@dataclass
class KDAAttentionSubmodules:
    """The linear layers (Megatron's local TP linears by default). Of the column linears of x (q, k, v,
    beta) only the weights are used (``KDAAttention._project_inputs``); the gates' up projections run
    their own forward."""

    column_linear: type = ColumnParallelLinear
    row_linear: type = RowParallelLinear


@dataclass(frozen=True)
class KDADims:
    num_heads: int
    head_dim: int
    gate_rank: int
    local_heads: int


def kda_dims(config, tp_size: int) -> KDADims:
    """Resolve the KDA sizes from ``config`` (defaults: attention heads, kv_channels) and check TP."""
    heads = config.kda_num_heads or config.num_attention_heads
    head_dim = config.kda_head_dim or config.kv_channels
    if not 16 <= head_dim <= 256:
        raise ConfigError(
            f"KDA head dim {head_dim} (kda_head_dim, default kv_channels) must be in [16, 256]"
        )
    if heads % tp_size:
        raise ConfigError(
            f"kda_num_heads={heads} (default num_attention_heads) must be divisible by "
            f"tensor_model_parallel_size={tp_size}"
        )
    return KDADims(heads, head_dim, config.kda_gate_rank or head_dim, heads // tp_size)


def init_decay_parameters(num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global fp32 ``A_log [H]`` and ``dt_bias [H*K]`` as in Kimi Linear / fla's KDA layer."""
    A_log = torch.empty(num_heads, dtype=torch.float32).uniform_(*A_RANGE).log()
    lo, hi = (math.log(x) for x in DT_RANGE)
    dt = torch.empty(num_heads * head_dim, dtype=torch.float32).uniform_(lo, hi).exp().clamp(min=DT_FLOOR)
    # softplus(dt_bias) == dt: dt_bias = dt + log(1 - exp(-dt)).
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return A_log, dt_bias


class KDAAttention(TPShardedModule):
    """KDA self-attention with the constructor and ``(output, bias)`` return of ``SelfAttention``."""

    # Decay parameters: fp32 whatever the model dtype (Float16Module casts with .bfloat16()).
    FP32_PARAMS = ("A_log", "dt_bias")

    def __init__(
        self,
        config,
        submodules: KDAAttentionSubmodules | None = None,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
        **_unused,  # attn_mask_type, cp_comm_type, pp_layer_offset, name: not used by KDA
    ):
        super().__init__(config=config)
        submodules = submodules or KDAAttentionSubmodules()
        self._use_tp_group(pg_collection, "KDA")
        self.layer_number = layer_number
        self.dims = dims = kda_dims(config, get_pg_size(self.tp_group))
        self.lower_bound = config.kda_gate_lower_bound if config.kda_gate == "lower_bound" else None
        hidden, key_dim = config.hidden_size, dims.num_heads * dims.head_dim

        def column(out: int):  # weights only: _project_inputs applies them to full_sequence(x)
            return submodules.column_linear(
                hidden, out, config=config, init_method=config.init_method, gather_output=False,
                bias=False, skip_bias_add=False, tp_group=self.tp_group,
            )

        self.q_proj, self.k_proj, self.v_proj = column(key_dim), column(key_dim), column(key_dim)
        self.q_conv, self.k_conv, self.v_conv = (
            CausalShortConv(config, key_dim, config.kda_conv_size, self.tp_group) for _ in range(3)
        )
        self.b_proj = column(dims.num_heads)
        self.f_proj = LowRankProjection(
            config, submodules.column_linear, hidden, dims.gate_rank, key_dim, False, self.tp_group
        )
        # Output gate: the up projection's bias is optional (Kimi Linear's g_b_proj has none).
        self.g_proj = LowRankProjection(
            config, submodules.column_linear, hidden, dims.gate_rank, key_dim, config.kda_output_gate_bias,
            self.tp_group,
        )
        A_log, dt_bias = init_decay_parameters(dims.num_heads, dims.head_dim)
        device = param_device(config)
        self.A_log = head_split_parameter(A_log, self.tp_group, device, torch.float32)
        self.dt_bias = head_split_parameter(dt_bias, self.tp_group, device, torch.float32)
        # One RMSNorm weight over the head dim, shared by all heads (replicated over TP).
        self.o_norm_weight = torch.nn.Parameter(
            torch.ones(dims.head_dim, device=device, dtype=config.params_dtype)
        )
        self.o_proj = submodules.row_linear(
            key_dim, hidden, config=config, init_method=config.output_layer_init_method,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            tp_group=self.tp_group,
        )

    def _apply(self, fn, recurse=True):
        # Keep the decay parameters (and their grads) fp32 through dtype casts; moves still apply.
        keep = {id(t) for name in self.FP32_PARAMS for t in (getattr(self, name), getattr(self, name).grad)}
        keep.discard(id(None))

        def cast_except_fp32(t):
            out = fn(t)
            if id(t) in keep and out.dtype != t.dtype:
                return t.to(device=out.device)
            return out

        return super()._apply(cast_except_fp32, recurse)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[.., .., H_l*D] -> [.., .., H_l, D]`` (a view)."""
        return x.unflatten(-1, (self.dims.local_heads, self.dims.head_dim))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        inference_context=None,
        packed_seq_params=None,
        **_unused,  # rotary embeddings, attention_bias, sequence_len_offset: KDA is NoPE
    ):
        if packed_seq_params is not None:
            raise NotImplementedError("KDAAttention does not take packed sequences (cu_seqlens) yet")
        if inference_context is not None:
            raise NotImplementedError("KDAAttention has no inference (recurrent state) path yet")
        # The causal mask is implicit in the recurrence; attention_mask is ignored.
        x = full_sequence(hidden_states, self.config.sequence_parallel, self.tp_group)  # [s, b, h]
        q, k, v, beta, f_low, g_low = self._project_inputs(x, hidden_states)
        q, k, v = (self._heads(y) for y in convolve_together((self.q_conv, self.k_conv, self.v_conv), (q, k, v)))
        f = self._heads(self.f_proj.up_project(f_low).transpose(0, 1))  # the up projection gathers
        # fp32 sigmoid, then the cast to q's dtype and the [b, s] layout in one copy (.to returns
        # its input when the dtype already matches: .contiguous() then makes the copy).
        beta = torch.sigmoid(beta.float()).transpose(0, 1).to(
            q.dtype, memory_format=torch.contiguous_format).contiguous()
        o = kda_core(q, k, v, f, beta, self.A_log, self.dt_bias, self.lower_bound)  # [b, s, H_l, V]
        gate = self._heads(self.g_proj.up_project(g_low))  # [s, b, H_l, V]
        o = self._gated_norm(o.transpose(0, 1), gate)  # [s, b, H_l, V]: the norm reads o through its strides
        return self.o_proj(o.flatten(2))

    def _project_inputs(self, x: torch.Tensor, shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v, beta logits from the full-sequence ``x``; the gates' down projections from this rank's
        ``shard``. Projections of one tensor run as one autograd node, whose backward sums their input
        gradients inside its GEMMs (shared_input.py); at TP 1 ``x`` is the shard and all six share it."""
        # q, k, v: a GEMM each (their outputs go on as whole tensors); the small ones share one.
        large = [[self.q_proj.weight], [self.k_proj.weight], [self.v_proj.weight]]
        beta, downs = self.b_proj.weight, [self.f_proj.down.weight, self.g_proj.down.weight]
        if x is shard:
            return project_shared_input(x, large + [[beta, *downs]])
        return project_shared_input(x, large + [[beta]]) + project_shared_input(shard, [downs])

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = self.o_norm_weight
        if get_pg_size(self.tp_group) > 1:
            # Each TP rank normalises only its heads: the shared weight's gradient is a partial
            # sum over heads, summed here (identity forward, all-reduce backward), SP or not.
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        # rms_norm(o) * sigmoid(gate) in one pass on CUDA (kimi_kernels/rms_norm); the reference on the CPU.
        return rms_norm(o, weight, self.config.layernorm_epsilon, gate=gate)
