"""KDA under tensor/sequence/pipeline parallelism equals one rank (CPU, gloo, fp32)."""

import pytest
import torch

from tests._dist import run_distributed
from tests.kda import runner
from tests.parallel import harness


def _gather_sequence(shards):
    return torch.cat(shards, dim=0)


def test_tp2_layer_matches_one_rank(tmp_path):
    (one,) = run_distributed(runner.layer_reference, 1, str(tmp_path))
    ranks = run_distributed(runner.layer_tensor_parallel, 2, str(tmp_path))
    for sp in (True, False):
        results = [r[sp] for r in ranks]
        if sp:  # each rank holds its sequence shard of the output and of the input gradient
            out = _gather_sequence([r["out"] for r in results])
            dx = _gather_sequence([r["dx"] for r in results])
        else:  # replicated input/output; the input gradient is complete on every rank
            out, dx = results[0]["out"], results[1]["dx"]
            torch.testing.assert_close(results[0]["out"], results[1]["out"])
        torch.testing.assert_close(out, one["out"], rtol=1e-4, atol=1e-5, msg=f"sp={sp} output")
        torch.testing.assert_close(dx, one["dx"], rtol=1e-4, atol=1e-5, msg=f"sp={sp} input grad")
        harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def model_reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ref_kda_model"))
    windows = harness.make_batches()
    (one,) = run_distributed(runner.model_reference, 1, ckpt, windows)
    assert one["loss"] is not None and torch.isfinite(torch.tensor(one["loss"]))
    keys = {key for key, *_ in one["grads"]}
    assert any(".self_attention.A_log" in k for k in keys), "the model has no KDA layer"
    return ckpt, windows, one


@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(pipeline_model_parallel_size=2),
    ],
    ids=["tp2_sp", "pp2"],
)
def test_hybrid_model_layout_matches_one_rank(model_reference, layout):
    ckpt, windows, one = model_reference
    results = run_distributed(runner.model_layout, 2, layout, ckpt, windows)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(l - one["loss"]) < 1e-5 for l in losses), (losses, one["loss"])
    harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=1e-6)
