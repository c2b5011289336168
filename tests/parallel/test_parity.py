"""The tiny hybrid MoE model (3 KDA : 1 full attention, MoE layers) gives the one-rank loss and
gradients under every parallel layout.

fp32 on CPU over gloo; every layout loads the same one-rank weights (see harness.py).
"""

import pytest

from tests._dist import run_distributed
from tests.parallel import harness

SP_TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ref_moe"))
    run_distributed(harness.save_reference, 1, ckpt, True, harness.HYBRID)
    windows = harness.make_batches()
    (one,) = run_distributed(harness.run_layout, 1, {}, ckpt, True, windows, harness.HYBRID)
    keys = {key for key, *_ in one["grads"]}
    assert any(".self_attention.A_log" in k for k in keys), "the model has no KDA layer"
    assert any(".mlp.experts." in k for k in keys), "the model has no MoE layer"
    return ckpt, windows, one


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, SP_TP2),
        (2, dict(pipeline_model_parallel_size=2)),
        (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
        (2, dict()),  # DP2
        (2, dict(expert_model_parallel_size=2)),  # EP2 over the two data-parallel ranks
        (8, dict(**SP_TP2, pipeline_model_parallel_size=2, expert_model_parallel_size=2)),
    ],
    ids=["tp2-sp", "pp2", "pp2-vpp2", "dp2", "ep2", "tp2-pp2-ep2"],
)
def test_layout_matches_one_rank(reference, world, layout):
    ckpt, windows, one = reference
    results = run_distributed(harness.run_layout, world, layout, ckpt, True, windows, harness.HYBRID)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(l - one["loss"]) < 1e-5 for l in losses), (losses, one["loss"])
    harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=1e-6)


# All three techniques at once: KDA 3:1, quantile balancing (capacity + dual bias), Block AttnRes
# with random depth mixers (blocks of 2 sublayers, so the PP boundary cuts no block and both
# stages carry block sums), on TP2 x PP2 x EP2 = 8 processes.
ALL_THREE = dict(**harness.HYBRID, attn_res=True, attn_res_num_blocks=4, moe_balancer="qb_both",
                 moe_expert_capacity_factor=1.25)


def test_all_three_techniques_on_tp2_pp2_ep2_match_one_rank(tmp_path):
    from tests.attn_res.runner import randomise_mixers

    ckpt = str(tmp_path)
    run_distributed(harness.save_reference, 1, ckpt, True, ALL_THREE, randomise_mixers)
    windows = harness.make_batches()
    (one,) = run_distributed(harness.run_layout, 1, {}, ckpt, True, windows, ALL_THREE)
    layout = dict(**SP_TP2, pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    results = run_distributed(harness.run_layout, 8, layout, ckpt, True, windows, ALL_THREE)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(l - one["loss"]) < 1e-5 for l in losses), (losses, one["loss"])
    # fp32 reduction order differs (TP/SP all-reduces, depth mixes); 5e-6 absolute on grads ~1e-3.
    harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=5e-6)
