import json

import pytest

from tests._dist import run_distributed

MICRO = ["--iters", "2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--num-experts", "4", "--topk", "2", "--moe-ffn-hidden-size", "16", "--seq-length", "16",
         "--micro-batch-size", "2", "--num-microbatches", "2", "--stdlib-max-mb", "0.2", "--last-n", "2"]


def _study(rank, world, out_dir):
    from tools import balance_study

    balance_study.main(MICRO + ["--out-dir", out_dir])
    return True


@pytest.mark.slow
def test_study_runs_every_balancer_and_writes_the_schema(tmp_path):
    from tools.balance_study import BALANCERS

    run_distributed(_study, 1, str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "bench" / "balance.json").read_text())
    assert set(result) >= {"balancers", "capacity_factor", "config", "date", "device"}
    assert result["device"] == "cpu" and result["config"]["iters"] == 2
    assert list(result["balancers"]) == list(BALANCERS)
    for name, run in result["balancers"].items():
        assert len(run["maxvio"]) == 2 and all(v >= 0 for v in run["maxvio"]), name
        assert isinstance(run["final_loss"], float) and run["final_loss"] > 0, name
        assert isinstance(run["dropped"], int) and run["dropped"] >= 0, name
    for name in ("qb_capacity", "qb_both"):  # the capacity guarantee, on every layer and iteration
        assert max(result["balancers"][name]["maxvio_max"]) <= result["capacity_factor"] - 1 + 1e-9
    table = (tmp_path / "bench" / "balance.md").read_text()
    assert all(f"| {name} |" in table for name in BALANCERS)
    svg = (tmp_path / "balance_study.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == len(BALANCERS)
