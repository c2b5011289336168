import pytest

from tests._dist import run_distributed
from tests.parallel import harness


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ref_dense"))
    run_distributed(harness.save_reference, 1, ckpt, False)
    windows = harness.make_batches()
    (one,) = run_distributed(harness.run_layout, 1, {}, ckpt, False, windows)
    return ckpt, windows, one


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        (2, dict(pipeline_model_parallel_size=2)),
        (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
        (2, dict()),  # DP2
        (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2)),
    ],
)
def test_dense_layout_matches_one_rank(reference, world, layout):
    ckpt, windows, one = reference
    results = run_distributed(harness.run_layout, world, layout, ckpt, False, windows)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(l - one["loss"]) < 1e-5 for l in losses), (losses, one["loss"])
    harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=1e-6)
