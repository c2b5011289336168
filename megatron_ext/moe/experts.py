"""Routed experts as two grouped GEMMs, and the dense shared expert.

``GroupedExperts`` holds this rank's ``E_local`` experts as ``w1 [E_local, h, F1]`` (``F1 = 2f``
for a gated linear unit, else ``f``) and ``w2 [E_local, f, h]``; its forward takes tokens already
sorted by local expert plus ``tokens_per_expert``. The GEMMs go through ``torch._grouped_mm``
where this torch supports the device/dtype/shape, else through a per-expert loop with the same
math. Checkpoints hold the global ``[E, ...]`` tensors, sliced at the rank's EP offset.

The gated SiLU (SwiGLU, the config's ``F.silu``) is ``kimi_kernels/swiglu``: one fused Triton pass each way
on CUDA, the fp32 PyTorch reference on the CPU; other activations run as plain ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kimi_kernels.swiglu import swiglu
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.module import MegatronModule
from megatron_ext.moe.router import init_on_cpu, param_device

__all__ = ["GroupedExperts", "SharedExpertMLP", "ffn", "grouped_mm_supported", "group_rank", "group_size"]

# The fused kernels need 16-byte aligned row strides.
_ALIGN_BYTES = 16


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation, gated: bool) -> torch.Tensor:
    """One expert: ``act(x @ w1) @ w2``, or ``(act(a) * b) @ w2`` with ``[a, b] = x @ w1`` when gated."""
    return _activate(x @ w1, activation, gated) @ w2


def _activate(h: torch.Tensor, activation, gated: bool) -> torch.Tensor:
    if gated and activation is F.silu:
        return swiglu(h)  # fused kernel on CUDA; on the CPU the reference, in fp32
    if gated:
        a, b = h.chunk(2, dim=-1)
        return activation(a) * b
    return activation(h)


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run these operands here (CPU: fp32/fp16/bf16 in
    torch >= 2.14; CUDA: bf16) with 16-byte aligned rows."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    allowed = (torch.bfloat16,) if x.is_cuda else (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in allowed or any(w.dtype != x.dtype for w in weights):
        return False
    dims = [x.shape[-1]] + [d for w in weights for d in w.shape[-2:]]
    return all(d * x.element_size() % _ALIGN_BYTES == 0 for d in dims)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``_grouped_mm``'s backward
    rejects expanded (stride-0) gradients such as the one ``y.sum()`` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offsets))


def grouped_ffn(x, w1, w2, tokens_per_expert, activation, gated, use_grouped_mm=None):
    """Apply expert ``e`` to its contiguous block of rows of ``x`` (``tokens_per_expert[e]`` rows). Rows after
    the last block are not computed: their output rows hold anything, and their gradient is not read."""
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x, w1, w2)
    if use_grouped_mm:
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)  # stays on device: no host sync
        h = _activate(_grouped_gemm(x, w1, offsets), activation, gated)
        return _grouped_gemm(h, w2, offsets)
    # Fallback: one plain GEMM pair per expert (needs the counts on the host). Rows past the experts'
    # blocks (a static dispatch buffer's dropped pairs; grouped_mm leaves them unwritten) get zeros.
    sizes = tokens_per_expert.tolist()
    blocks = x.split(sizes + [x.shape[0] - sum(sizes)])
    out = [ffn(block, w1[e], w2[e], activation, gated) for e, block in enumerate(blocks[:-1])]
    return torch.cat(out + [x.new_zeros(blocks[-1].shape[0], w2.shape[-1])])


class GroupedExperts(MegatronModule):
    """This rank's slice ``[ep_rank * E_local, (ep_rank + 1) * E_local)`` of the ``E`` experts.

    Expert ``e``'s weights come from ``init_on_cpu`` seeded by ``(seed, e)``, so any EP layout
    holds the same global experts. Params carry ``allreduce = False``: Megatron's DDP then
    reduces their grads over the expert-data-parallel group instead of the data-parallel group.
    """

    def __init__(self, config, num_local_experts: int, ep_group, expt_dp_group, seed: int,
                 use_grouped_mm: bool | None = None):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.expt_dp_group = ep_group, expt_dp_group
        self.use_grouped_mm = use_grouped_mm  # None: decide per call from dtype/device/shape
        self.gated = config.gated_linear_unit
        self.activation = config.activation_func
        hidden, ffn_hidden = config.hidden_size, config.moe_ffn_hidden_size
        fc1_out = 2 * ffn_hidden if self.gated else ffn_hidden
        first = group_rank(ep_group) * num_local_experts
        w1, w2 = [], []
        for e in range(first, first + num_local_experts):
            # Init in Megatron's [out, in] orientation (fan-in aware init methods), store as [in, out].
            w1.append(init_on_cpu((fc1_out, hidden), config.init_method, _expert_seed(seed, e, 0),
                                  config.perform_initialization).t())
            w2.append(init_on_cpu((hidden, ffn_hidden), config.output_layer_init_method,
                                  _expert_seed(seed, e, 1), config.perform_initialization).t())
        device, dtype = param_device(config), config.params_dtype
        self.w1 = torch.nn.Parameter(torch.stack(w1).to(device=device, dtype=dtype).contiguous())
        self.w2 = torch.nn.Parameter(torch.stack(w2).to(device=device, dtype=dtype).contiguous())
        for param in (self.w1, self.w2):
            param.allreduce = False

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``tokens [M, h]`` sorted by local expert, ``tokens_per_expert [E_local]`` -> ``[M, h]``."""
        return grouped_ffn(tokens, self.w1, self.w2, tokens_per_expert, self.activation, self.gated,
                           self.use_grouped_mm)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Global ``{prefix}w1 [E, h, F1]`` / ``{prefix}w2 [E, f, h]``, this rank's slice at its EP
        offset; replicas over expert-DP (only expert-DP rank 0 writes)."""
        expert_axis = len(sharded_offsets)
        ep_shard = (expert_axis, group_rank(self.ep_group), group_size(self.ep_group))
        replica_id = (0, 0, group_rank(self.expt_dp_group))
        return {
            f"{prefix}{name}": ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", param, *sharded_offsets, ep_shard,
                replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
            for name, param in (("w1", self.w1), ("w2", self.w2))
        }


def _expert_seed(seed: int, expert: int, which: int) -> int:
    return (seed + 2 * expert + which) % (2**63)


class SharedExpertMLP(MegatronModule):
    """Dense FFN every token goes through, replicated (not split) over TP.

    Under sequence parallelism each TP rank feeds it its own sequence shard, so its params are
    marked ``sequence_parallel`` for Megatron to all-reduce their grads over TP.
    """

    def __init__(self, config, ffn_hidden_size: int, seed: int):
        super().__init__(config)
        self.gated = config.gated_linear_unit
        self.activation = config.activation_func
        hidden = config.hidden_size
        fc1_out = 2 * ffn_hidden_size if self.gated else ffn_hidden_size
        device, dtype = param_device(config), config.params_dtype
        w1 = init_on_cpu((fc1_out, hidden), config.init_method, seed, config.perform_initialization)
        w2 = init_on_cpu((hidden, ffn_hidden_size), config.output_layer_init_method, seed + 1,
                         config.perform_initialization)
        self.w1 = torch.nn.Parameter(w1.t().to(device=device, dtype=dtype).contiguous())
        self.w2 = torch.nn.Parameter(w2.t().to(device=device, dtype=dtype).contiguous())
        for param in (self.w1, self.w2):
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return ffn(hidden, self.w1, self.w2, self.activation, self.gated)
