"""The KDA layer under tensor (and sequence) parallelism equals one rank (CPU, gloo, fp32); the
hybrid model's layouts (KDA + MoE, TP/PP/EP/DP) are checked in tests/parallel/test_parity.py."""

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


def test_tp2_layer_input_crosses_tp_once_each_way():
    """The layer's input is gathered once for its four column projections (q, k, v, beta), and their
    input gradients are summed before one reduction, as attention's fused QKV does: one hidden-wide
    collective each way for the input, one each way for the output (o_proj)."""
    for counts in run_distributed(runner.layer_collectives, 2):
        assert counts[True] == {"all_gather": 2, "reduce_scatter": 2}, f"sp: {counts[True]}"
        assert counts[False] == {"all_reduce": 2}, f"no sp: {counts[False]}"
