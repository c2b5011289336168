import json

import pytest

from tests._dist import run_distributed


def _bench(rank, world, out):
    from tools import bench_moe

    return bench_moe.main(["--smoke", "--out", out])


@pytest.mark.slow
def test_bench_smoke_times_every_variant_on_one_rank(tmp_path):
    from tools.bench_moe import VARIANTS

    out = tmp_path / "moe.json"
    (returned,) = run_distributed(_bench, 1, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    assert set(result) >= {"rows", "device", "date"} and result["device"] == "cpu"
    (row,) = result["rows"]
    assert (row["E"], row["gpus"], row["tokens_per_rank"]) == (8, 1, 64)
    for variant in VARIANTS:
        assert f"{variant}_error" not in row, row.get(f"{variant}_error")
        assert row[f"{variant}_ms"] > 0, variant
