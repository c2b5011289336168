"""The Block AttnRes residual state, its block schedule and its pipeline packing.

Under Block Attention Residuals (DESIGN.md section 4) the residual stream is not one tensor but
a list of depth sources: the embedding ``b_0``, the finished block sums ``b_1..b_{n-1}`` and the
partial sum of the current block (absent right after a block closes). Sublayers are numbered
globally from 0 (layer ``k`` holds sublayers ``2k`` (attention) and ``2k + 1`` (MLP)); a block
is ``S`` consecutive sublayers, and it is closed right after its last sublayer, so the state
between any two sublayers is canonical and can be derived from the next sublayer's index alone:
entering sublayer ``j`` there are ``1 + j // S`` blocks and a partial sum iff ``j % S != 0``.

Pipeline stages exchange one tensor: the sources concatenated along the sequence dim,
``[n_sources * s, b, h]``, so every unpacked source is a contiguous view (no copy, and the
depth-attention op reads it in place).

In-place source grads (``attn_res_inplace_source_grads``): every block (the embedding, each
finished block sum, each block unpacked from a pipeline receive) is read by every later depth
mix. It is wrapped once, where it enters the state, by ``track_source_grad``; its
:class:`~kimi_kernels.attn_res.SourceGrad` rides along in ``block_grads`` and every mixer passes it
to ``depth_attention``, whose backwards add their contributions into one buffer. Blocks are
tracked only while autograd records (not in a checkpoint's no-grad forward, nor in inference);
the partial sum (read by one mix) is never tracked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_kernels.attn_res import SourceGrad, track_source_grad


def sublayers_per_block(config) -> int:
    """``S``: the block size in sublayers (``attn_res_block_size``, or ``2 L / attn_res_num_blocks``)."""
    if config.attn_res_block_size is not None:
        return config.attn_res_block_size
    return 2 * config.num_layers // config.attn_res_num_blocks


def closes_block(sublayer: int, block_size: int) -> bool:
    """Whether global sublayer ``sublayer`` is the last of its block."""
    return (sublayer + 1) % block_size == 0


def sources_entering(sublayer: int, block_size: int) -> tuple[int, bool]:
    """``(number of blocks incl. b_0, has partial sum)`` of the state entering ``sublayer``."""
    return 1 + sublayer // block_size, sublayer % block_size != 0


def _alike(tensor: torch.Tensor, first: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor``, contiguous, after checking it matches ``first`` (b_0) in shape, dtype, device."""
    if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
        raise ValueError(
            f"{what} {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} does not match the depth "
            f"sources ({tuple(first.shape)} {first.dtype} on {first.device})"
        )
    return tensor.contiguous()


def _track(block: torch.Tensor, enabled: bool) -> tuple[torch.Tensor, SourceGrad | None]:
    if enabled and block.requires_grad and torch.is_grad_enabled():
        return track_source_grad(block)
    return block, None


@dataclass
class DepthState:
    """Depth sources of one microbatch: ``blocks`` = [b_0, b_1, ...], ``partial`` or ``None``.

    All tensors are ``[s, b, h]`` (the local sequence shard under sequence parallelism), of one
    shape, dtype and device, contiguous (``add`` checks each new partial sum against ``b_0``, so
    the depth mixers can skip that per call). ``block_grads``: ``None`` (in-place source grads
    off) or one ``SourceGrad`` (or ``None``: not tracked) per block. Build states that take in
    new blocks with :meth:`entering` so those are tracked.
    """

    blocks: list[torch.Tensor]
    partial: torch.Tensor | None = None
    block_grads: list[SourceGrad | None] | None = None

    @staticmethod
    def entering(blocks, partial=None, track: bool = False, known: "DepthState | None" = None) -> "DepthState":
        """A state whose ``blocks`` after ``known``'s (all of them, without ``known``) are new here:
        with ``track`` each new block is wrapped by ``track_source_grad`` (where autograd records)."""
        blocks = list(blocks)
        start = len(known.blocks) if known is not None else 0
        for i in range(start, len(blocks)):
            blocks[i] = _alike(blocks[i], blocks[0], "block")
        if partial is not None:
            partial = _alike(partial, blocks[0], "partial sum")
        if not track:
            return DepthState(blocks, partial)
        grads = list(known.block_grads or [None] * start) if known is not None else []
        for i in range(start, len(blocks)):
            blocks[i], grad = _track(blocks[i], True)
            grads.append(grad)
        return DepthState(blocks, partial, grads)

    def sources(self) -> list[torch.Tensor]:
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def source_grads(self) -> list[SourceGrad | None] | None:
        """One ``SourceGrad`` or ``None`` per entry of :meth:`sources`; ``None`` if off."""
        if self.block_grads is None:
            return None
        return self.block_grads if self.partial is None else [*self.block_grads, None]

    def add(self, output: torch.Tensor, close: bool) -> "DepthState":
        """Add a sublayer's output to the partial sum; ``close`` ends the block with it."""
        partial = output if self.partial is None else self.partial + output
        partial = _alike(partial, self.blocks[0], "sublayer output")
        if not close:
            return DepthState(self.blocks, partial, self.block_grads)
        if self.block_grads is None:
            return DepthState([*self.blocks, partial], None)
        block, grad = _track(partial, True)
        return DepthState([*self.blocks, block], None, [*self.block_grads, grad])

    # -- flat form: for activation checkpointing, whose functions take and return tensors ----
    def flat(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.sources())

    @staticmethod
    def from_flat(tensors, num_blocks: int, track: bool = False) -> "DepthState":
        tensors = list(tensors)
        partial = tensors[num_blocks] if len(tensors) > num_blocks else None
        return DepthState.entering(tensors[:num_blocks], partial, track)

    def new_since(self, num_blocks_before: int) -> tuple[torch.Tensor, ...]:
        """Tensors created after a point where there were ``num_blocks_before`` blocks."""
        return tuple(self.blocks[num_blocks_before:]) + (
            () if self.partial is None else (self.partial,)
        )


def pack_for_pipeline(state: DepthState, slots: int) -> torch.Tensor:
    """One ``[slots * s, b, h]`` tensor for Megatron's p2p; unused slots are zero padding."""
    sources = state.sources()
    if len(sources) > slots:
        raise ValueError(f"{len(sources)} depth sources do not fit {slots} pipeline slots")
    pad = [torch.zeros_like(sources[0])] * (slots - len(sources))
    return torch.cat([*sources, *pad], dim=0)


def unpack_from_pipeline(
    packed: torch.Tensor, num_blocks: int, has_partial: bool, slots: int, track: bool = False
) -> DepthState:
    """Inverse of :func:`pack_for_pipeline`: contiguous ``[s, b, h]`` views of ``packed``
    (with ``track``, the blocks tracked as they enter the state)."""
    if packed.shape[0] % slots:
        raise ValueError(
            f"received pipeline tensor of shape {tuple(packed.shape)}; its first dim is not "
            f"{slots} depth sources of equal length (is variable_seq_lengths set?)"
        )
    views = packed.view(slots, packed.shape[0] // slots, *packed.shape[1:]).unbind(0)
    return DepthState.entering(views[:num_blocks], views[num_blocks] if has_partial else None, track)
