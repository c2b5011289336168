"""The Block AttnRes transformer layer: Megatron's ``TransformerLayer`` with depth-attention inputs.

Each of the layer's two sublayers (attention, MLP) takes its input from a :class:`DepthMixer`
over the current depth sources instead of from the residual stream, computes
``f(Norm(h_l))`` with the layer's own ``input_layernorm`` / ``pre_mlp_layernorm``, and adds its
output to the block's partial sum (DESIGN.md section 4). The submodules, their specs, names and
checkpoint keys are Megatron's; only the two mixers are new.

With ``attn_res_fuse_norm`` (default on) a sublayer norm that is our
:class:`~megatron_ext.layers.norm.RMSNorm` (what ``megatron_ext.model`` builds) is fused into
the depth mix: the mixer returns ``Norm(h_l)`` from one op, computed with that norm module's own
``weight`` and ``eps``. The weight stays the norm module's parameter (same checkpoint key and
attributes, ``sequence_parallel`` included: its grad is a partial sum over the local tokens under
sequence parallelism, all-reduced by Megatron's ``finalize_model_grads`` as before). Any other
norm module runs separately on the mix, as without the switch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_layer import TransformerLayer

from kimi_kernels.attn_res import DepthPair, depth_attention, depth_attention_unchecked, resolve_impl
from megatron_ext.layers.norm import RMSNorm
from megatron_ext.attn_res.state import DepthState, closes_block, sublayers_per_block


class DepthMixer(MegatronModule):
    """``h = depth_attention(sources, query, key_norm_weight)``: one sublayer's input over depth.

    ``query`` (the pseudo-query ``w_l``, zero-initialised so training starts from the uniform
    average) and ``key_norm_weight`` (the RMSNorm weight ``gamma_l`` of the keys) are fp32 ``[h]``
    parameters, replicated over tensor-parallel ranks. Under sequence parallelism each rank mixes
    its own sequence shard, so their grads are partial sums: ``sequence_parallel = True`` makes
    Megatron's ``finalize_model_grads`` all-reduce them over the TP group.

    ``source_grads`` (from :meth:`DepthState.source_grads`): the blocks' in-place grad sums.
    The first call (and any call whose sources differ in count, shape, dtype or device from the
    last checked one) goes through ``depth_attention``'s checks; the others take its unchecked
    path (a ``DepthState`` keeps all its sources alike and contiguous).

    ``norm`` (the consumer's norm module, or ``None``): the mixer returns ``norm(h)``, fused into
    the op when :func:`fusable_norm` accepts it and ``attn_res_fuse_norm`` is on.
    """

    def __init__(self, config):
        super().__init__(config=config)
        self.eps = float(config.layernorm_epsilon)
        self.impl = config.attn_res_impl
        self.query = torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=torch.float32))
        self.key_norm_weight = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=torch.float32))
        for p in (self.query, self.key_norm_weight):
            setattr(p, "sequence_parallel", config.sequence_parallel)
        self.fuse_norm = getattr(config, "attn_res_fuse_norm", True)
        self._checked = None  # (n, shape, dtype, device, parameter devices) of the last checked call
        self._resolved_impl = None

    def _apply(self, fn, recurse=True):
        # Keep the logit parameters fp32 when the model is cast (Float16Module's .bfloat16()):
        # the softmax over depth is computed in fp32 from them. Device moves still apply.
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)

    def forward(self, sources: list[torch.Tensor], source_grads=None, norm=None, pair=None) -> torch.Tensor:
        """``pair``: ``None`` or a role of a :class:`~kimi_kernels.attn_res.DepthPair` (the layer's two
        mixers share one backward pass over their common blocks; Triton path only)."""
        fused = norm if self.fuse_norm and fusable_norm(norm) else None
        out = self._mix(sources, source_grads, fused, pair)
        return norm(out) if norm is not None and fused is None else out

    def _mix(self, sources, source_grads, out_norm, pair=None) -> torch.Tensor:
        first, query, weight = sources[0], self.query, self.key_norm_weight
        out_norm_weight = None if out_norm is None else out_norm.weight
        out_norm_eps = 0.0 if out_norm is None else float(out_norm.eps)
        key = (len(sources), first.shape, first.dtype, first.device, query.device,
               None if out_norm is None else (out_norm_weight.shape, out_norm_weight.device))
        if key == self._checked:
            return depth_attention_unchecked(
                sources, query, weight, self.eps, self._resolved_impl, source_grads, out_norm_weight, out_norm_eps,
                pair,
            )
        out = depth_attention(
            sources, query, weight, eps=self.eps, impl=self.impl, source_grads=source_grads,
            out_norm_weight=out_norm_weight, out_norm_eps=out_norm_eps, pair=pair,
        )
        self._checked, self._resolved_impl = key, resolve_impl(self.impl, first)
        return out


def fusable_norm(norm) -> bool:
    """Whether ``norm`` can be fused into the depth mix: exactly our ``RMSNorm`` (whose forward
    is ``rms_norm(x, weight, eps)``), not a subclass that may compute something else."""
    return type(norm) is RMSNorm and isinstance(norm.eps, (int, float)) and norm.weight.dim() == 1


class AttnResTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose ``forward`` maps a :class:`DepthState` to the next one.

    Supports what our models use: self-attention (any registered kind) and a dense or MoE MLP,
    no cross-attention, no inference cache. Megatron's selective-recompute hooks inside
    ``TransformerLayer._forward_*`` are not used (``attn_res`` allows ``recompute_granularity``
    None or "full"; the block implements "full").
    """

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_mixer = DepthMixer(config)
        self.mlp_mixer = DepthMixer(config)
        block_size = sublayers_per_block(config)
        first = 2 * (self.layer_number - 1)  # layer_number is global and 1-based
        self.closes = (closes_block(first, block_size), closes_block(first + 1, block_size))
        self.pair_backward = getattr(config, "attn_res_pair_backward", True)

    def _output(self, output_with_bias) -> torch.Tensor:
        output, bias = output_with_bias
        if bias is not None:
            output = output + bias
        return F.dropout(output, p=self.hidden_dropout, training=self.training)

    def forward(
        self,
        state: DepthState,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params=None,
        padding_mask: torch.Tensor | None = None,
        **_unused,
    ) -> DepthState:
        # The two mixers read the same blocks: with in-place block grads, one backward pass over
        # them for both (kimi_kernels/attn_res/pair.py; the MLP mixer's block grads are computed in
        # the attention mixer's backward, which also returns the MLP mixer's query/norm grads).
        pair = None
        if self.pair_backward and state.block_grads is not None and torch.is_grad_enabled():
            pair = DepthPair(self.mlp_mixer.query, self.mlp_mixer.key_norm_weight)
        attn = self.self_attention(
            self.attn_mixer(state.sources(), state.source_grads(), self.input_layernorm,  # Norm(h)
                            pair=None if pair is None else pair.first),
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
        )
        state = state.add(self._output(attn), close=self.closes[0])
        mlp_input = self.mlp_mixer(state.sources(), state.source_grads(), self.pre_mlp_layernorm,  # Norm(h)
                                   pair=None if pair is None else pair.second)
        mlp = self.mlp(mlp_input, padding_mask=padding_mask) if padding_mask is not None else self.mlp(mlp_input)
        return state.add(self._output(mlp), close=self.closes[1])
