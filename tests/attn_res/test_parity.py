"""Block AttnRes under parallel layouts and activation recompute == one rank (loss and grads).

One reference checkpoint (random depth mixers and norm weights) serves every block count: the
parameters do not depend on N. One-rank results are computed once per N, with the norms fused
into the depth mixes (the default); one PP2 run has them separate.
"""

import functools

import pytest

from tests._dist import run_distributed
from tests.attn_res import runner
from tests.parallel import harness

BLOCKS_OF_4 = dict(attn_res=True, attn_res_num_blocks=2)  # PP boundaries 2, 6 cut a block
BLOCKS_OF_2 = dict(attn_res=True, attn_res_num_blocks=4)  # boundary widths 2, 3, 4: all differ


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ref_attn_res"))
    run_distributed(harness.save_reference, 1, ckpt, False, BLOCKS_OF_4, runner.randomise_mixers_and_norms)
    windows = harness.make_batches()

    @functools.cache
    def one_rank(blocks: int):
        (one,) = run_distributed(harness.run_layout, 1, {}, ckpt, False, windows, dict(attn_res=True, attn_res_num_blocks=blocks))
        return one

    return ckpt, windows, one_rank


PP2 = dict(pipeline_model_parallel_size=2)


# Recompute runs ride on pipeline layouts (one process start each on a 2-core machine): a
# recompute run equal to the plain one-rank run shows both the layout and the recompute exact.
RECOMPUTE_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
RECOMPUTE_BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)


@pytest.mark.parametrize(
    "world,layout,overrides",
    [
        (2, PP2, dict(BLOCKS_OF_4, **RECOMPUTE_UNIFORM)),
        (4, dict(pipeline_model_parallel_size=4), BLOCKS_OF_4),
        # Interleaved with two ranks: activation and gradient of different widths share p2p calls.
        (
            2,
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            dict(BLOCKS_OF_2, **RECOMPUTE_BLOCK),
        ),
        (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), BLOCKS_OF_4),
        # The norms run separately (attn_res_fuse_norm off) vs the fused one-rank run.
        (2, PP2, dict(BLOCKS_OF_4, attn_res_fuse_norm=False)),
    ],
    ids=["pp2-recompute-uniform", "pp4", "pp2-interleaved-recompute-block", "tp2-sp", "pp2-norm-unfused"],
)
def test_layout_matches_one_rank(reference, world, layout, overrides):
    ckpt, windows, one_rank = reference
    one = one_rank(overrides["attn_res_num_blocks"])
    results = run_distributed(harness.run_layout, world, layout, ckpt, False, windows, overrides)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(l - one["loss"]) < 1e-5 for l in losses), (losses, one["loss"])
    harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=1e-6)
