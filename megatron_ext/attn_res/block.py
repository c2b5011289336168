"""Block AttnRes decoder: a ``TransformerBlock`` that carries a :class:`DepthState` and the
``GPTModel`` that builds it.

Seams into Megatron-Core:

* the layers are :class:`AttnResTransformerLayer` (same submodules and checkpoint keys as the
  standard layer, plus two :class:`DepthMixer`);
* :class:`AttnResTransformerBlock` overrides ``forward`` only: it turns the embedding (first
  stage) or the received pipeline tensor (other stages) into a depth state, runs its layers on
  it (with Megatron-style "full" activation recompute), and returns either the final output
  (last stage: final depth mix, then the final norm) or the packed state for the next stage;
* :class:`AttnResGPTModel` is Megatron's ``GPTModel`` with that block as ``self.decoder`` (and our LM
  loss, ``megatron_ext.layers.lm_loss``).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import WrappedTensor, get_pg_rank, make_viewless_tensor

from megatron_ext.layers.lm_loss import HybridGPTModel
from megatron_ext.attn_res.layer import AttnResTransformerLayer, DepthMixer
from megatron_ext.attn_res.state import (
    DepthState,
    pack_for_pipeline,
    sources_entering,
    sublayers_per_block,
    unpack_from_pipeline,
)


def pipeline_slots(config, boundary_sublayer: int) -> int:
    """Sources packed into the pipeline tensor entering global sublayer ``boundary_sublayer``.

    Normally exactly the state's sources (Megatron exchanges the shapes: variable_seq_lengths).
    With two pipeline ranks and interleaving, one p2p call can carry an activation and a
    gradient to the same peer, and Megatron's shape exchange (batched, unlike the data
    exchange) can pair them the wrong way round; every boundary then uses the widest width so
    all shapes agree.
    """
    block_size = sublayers_per_block(config)
    exact = lambda j: sum(sources_entering(j, block_size))  # noqa: E731
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if pp != 2 or not vpp:
        return exact(boundary_sublayer)
    starts = {
        2 * get_transformer_layer_offset(config, vp_stage=v, pp_rank=r) for r in range(pp) for v in range(vpp)
    }
    return max(exact(j) for j in starts - {0})


def attn_res_block_spec(spec: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """The standard block spec with every layer built as :class:`AttnResTransformerLayer`."""
    layers = [dataclasses.replace(s, module=AttnResTransformerLayer) for s in spec.layer_specs]
    return dataclasses.replace(spec, layer_specs=layers)


class AttnResTransformerBlock(TransformerBlock):
    """The layers of one (virtual) pipeline stage under Block AttnRes."""

    def __init__(self, config, spec, *args, **kwargs):
        super().__init__(config, spec, *args, **kwargs)
        offset = get_transformer_layer_offset(config, self.vp_stage, get_pg_rank(self.pg_collection.pp))
        self.block_size = sublayers_per_block(config)
        self.first_sublayer = 2 * offset
        self.end_sublayer = 2 * (offset + len(self.layers))
        self.track = getattr(config, "attn_res_inplace_source_grads", True)  # in-place block grads
        # The final aggregation over all sources, before the final norm (last stage only).
        self.final_mixer = DepthMixer(config) if self.post_process else None

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        rotary_pos_emb=None,
        packed_seq_params=None,
        padding_mask=None,
        **unsupported,
    ):
        extra = {k for k, v in unsupported.items() if v is not None}
        if extra - {"rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "sequence_len_offset"}:
            raise NotImplementedError(f"attn_res decoder does not support {sorted(extra)}")
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        state = self._entry_state(hidden_states)
        layer_kwargs = dict(
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng:
            for start, end, checkpoint in self._layer_groups():
                state = self._run(start, end, checkpoint, state, layer_kwargs)
        if not self.post_process:
            return pack_for_pipeline(state, pipeline_slots(self.config, self.end_sublayer))
        out = self.final_mixer(state.sources(), state.source_grads(), self.final_layernorm)  # Norm(h)
        return make_viewless_tensor(inp=out, requires_grad=True, keep_graph=True)

    def _entry_state(self, hidden_states) -> DepthState:
        if self.pre_process:
            embedding = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
            return DepthState.entering([embedding], track=self.track)
        num_blocks, has_partial = sources_entering(self.first_sublayer, self.block_size)
        slots = pipeline_slots(self.config, self.first_sublayer)
        return unpack_from_pipeline(self.input_tensor, num_blocks, has_partial, slots, self.track)

    def _layer_groups(self) -> list[tuple[int, int, bool]]:
        """``(start, end, checkpointed)`` layer ranges, as Megatron's "full" recompute splits them."""
        n = len(self.layers)
        if self.config.recompute_granularity != "full" or not self.training:
            return [(0, n, False)]
        k = self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            return [(i, min(i + k, n), True) for i in range(0, n, k)]
        if self.config.recompute_method == "block":
            return [(i, i + 1, i < k) for i in range(n)]
        raise ValueError(f"recompute_method={self.config.recompute_method!r}; allowed: 'uniform', 'block'")

    def _run(self, start, end, checkpoint, state: DepthState, layer_kwargs) -> DepthState:
        layers = self.layers[start:end]
        if not checkpoint:
            for layer in layers:
                state = layer(state, **layer_kwargs)
            return state
        # Checkpoint functions take and return tensors: pass all sources in, get back only the
        # tensors the group created (closed blocks, then the partial sum if one is open). The
        # inner state tracks its blocks itself (only in the recompute: the checkpoint's forward
        # runs without grad); their sums reach the outer blocks through the checkpoint's grads.
        num_blocks = len(state.blocks)

        def run_group(*sources):
            inner = DepthState.from_flat(sources, num_blocks, self.track)
            for layer in layers:
                inner = layer(inner, **layer_kwargs)
            return inner.new_since(num_blocks)

        # distribute_saved_activations is off: it would shard its first input (b_0) in place,
        # and b_0 is still read by every later layer.
        created = tensor_parallel.checkpoint(run_group, False, *state.flat())
        created = (created,) if torch.is_tensor(created) else tuple(created)
        closed = sum(sum(layer.closes) for layer in layers)
        _, has_partial = sources_entering(2 * (layers[-1].layer_number), self.block_size)
        assert len(created) == closed + has_partial, (len(created), closed, has_partial)
        blocks = [*state.blocks, *created[:closed]]
        return DepthState.entering(blocks, created[closed] if has_partial else None, self.track, known=state)


class AttnResGPTModel(HybridGPTModel):
    """Megatron's ``GPTModel`` (our :class:`HybridGPTModel`) with :class:`AttnResTransformerBlock` as its
    decoder.

    ``GPTModel.__init__`` builds ``TransformerBlock`` itself; it is given a block spec with no
    layers (so nothing is built twice) and the decoder is then replaced by ours.
    """

    def __init__(self, config, transformer_layer_spec: TransformerBlockSubmodules, **kwargs):
        empty = dataclasses.replace(transformer_layer_spec, layer_specs=[])
        super().__init__(config=config, transformer_layer_spec=empty, **kwargs)
        self.transformer_layer_spec = transformer_layer_spec
        self.decoder = AttnResTransformerBlock(
            config=self.config,
            spec=transformer_layer_spec,
            pre_process=self.pre_process,
            post_process=self.post_process,
            pg_collection=self.pg_collection,
            vp_stage=kwargs.get("vp_stage"),
        )
