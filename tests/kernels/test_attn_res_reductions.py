"""Several sources' row sums in one reduction (``kimi_kernels/attn_res/reductions.py``): ``stack_rows`` joins B tensors
into one, ``unstack_sums`` splits its row sums back in the same order. A small kernel stacks B distinct random
rows and their squares, reduces them together (``row_sums2``: ``tl.reduce`` over the stacked tensors on the GPU,
one ``tl.sum`` each under the interpreter) and stores each source's two sums where that source's plain sums belong:
a mapping error (a swapped split, a wrong join order) puts another source's sum there. On the GPU the stacked sums
are also compared with one source per reduction bit for bit: the kernels' backward recomputes the forward's logits
with a batch size that may differ (``sources_per_reduction`` of the launch tables by each call's width), and the
softmax weights it rebuilds are exact only if the order of the additions does not depend on the batch.

The interpreter cases run in a ``TRITON_INTERPRET=1`` subprocess started by ``test_cases_under_interpreter``.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from kimi_kernels.attn_res.reductions import row_sums2, stack_rows, unstack_sums
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


@triton.jit
def _stacked_sums_kernel(x_ptr, sums_ptr, squares_ptr, T, H, B: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    xs, squares = (), ()
    for k in tl.static_range(B):
        x = tl.load(x_ptr + k * T * H + offs, mask=mask, other=0.0)
        xs, squares = xs + (x,), squares + (x * x,)
    total, total_squares = row_sums2(stack_rows(xs, B), stack_rows(squares, B))
    total, total_squares = unstack_sums(total, B), unstack_sums(total_squares, B)
    for k in tl.static_range(B):
        tl.store(sums_ptr + k * T + rows, total[k], mask=rows < T)
        tl.store(squares_ptr + k * T + rows, total_squares[k], mask=rows < T)


def _stacked_sums(x: torch.Tensor, batch: int, block_t: int, block_h: int):
    """Row sums of ``x [S, T, H]`` (fp32) and of its squares, ``batch`` sources per reduction: two ``[S, T]``."""
    sources, tokens, hidden = x.shape
    sums, squares = torch.empty(2, sources, tokens, device=x.device).unbind(0)
    for first in range(0, sources, batch):
        _stacked_sums_kernel[(triton.cdiv(tokens, block_t),)](
            x[first:first + batch], sums[first:first + batch], squares[first:first + batch], tokens, hidden,
            B=batch, BLOCK_T=block_t, BLOCK_H=block_h)
    return sums, squares


def _sources(device, tokens=7, hidden=40):
    gen = torch.Generator().manual_seed(5)
    # each source its own scale, so a sum in the wrong place is far off
    return (torch.randn(4, tokens, hidden, generator=gen) * torch.tensor([1.0, 3.0, 10.0, 30.0])[:, None, None]
            ).to(device)


@interpreter_case
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_stacked_row_sums_land_with_their_source(batch):
    x = _sources("cpu")
    sums, squares = _stacked_sums(x, batch, block_t=2, block_h=64)  # h = 40 pads to 64: masked columns
    torch.testing.assert_close(sums, x.sum(-1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(squares, (x * x).sum(-1), rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 4])
def test_stacked_row_sums_equal_one_source_per_reduction_bit_for_bit_on_the_gpu(batch):
    x = _sources("cuda", tokens=33, hidden=2048)
    one = _stacked_sums(x, 1, block_t=1, block_h=2048)
    stacked = _stacked_sums(x, batch, block_t=1, block_h=2048)
    torch.testing.assert_close(stacked[0], x.sum(-1), rtol=1e-5, atol=1e-3)
    for a, b in zip(stacked, one):
        assert torch.equal(a, b)


def test_per_width_settings_pick_the_entry_of_the_call_width():
    # fused.ByWidth: the launch tables' per-call choices (sources per reduction, a register cap) by the call's
    # source count: the value of the last step at or below it (the first step's below them all).
    import kimi_kernels.attn_res.fused as fused

    table = fused.ByWidth(((1, 1), (3, 2), (5, 4)))
    assert [table(n) for n in range(1, 10)] == [1, 1, 2, 2, 4, 4, 4, 4, 4]
    assert fused.ByWidth(((3, 128),))(1) == 128  # below the smallest step: that step's value
    assert [fused.ByWidth(((1, None), (7, 128)))(n) for n in (6, 7, 9)] == [None, 128, 128]
    with pytest.raises(ValueError, match="increasing"):
        fused.ByWidth(((3, 1), (1, 2)))
    with pytest.raises(ValueError, match="1, 2 or 4"):
        fused.BackwardLaunch(2048, 16, fused.ByWidth(((1, 3),)), None, 32, 16)
    # the tables are frozen: a launch choice is changed in the source, never at run time
    with pytest.raises(dataclasses.FrozenInstanceError):
        fused.FORWARD_LAUNCH.tile_elements = 4096
