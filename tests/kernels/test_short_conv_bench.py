"""The short-conv benchmark script runs end to end in --smoke mode (CPU Triton interpreter)."""

from tests.kernels.bench_smoke import run_smoke


def test_bench_smoke_writes_agreeing_results(tmp_path):
    report = run_smoke("bench_short_conv.py", tmp_path / "short-conv-smoke.json")
    assert {"device", "date", "timing", "results"} <= report.keys()
    assert [(row["s"], row["b"], row["C"]) for row in report["results"]] == [(21, 2, 48), (13, 1, 130)]
    for row in report["results"]:
        assert row["kernel_fwd_ms"] > 0 and row["reference_fwd_bwd_ms"] > 0 and row["K"] == 4
        assert max(row["max_rel_error"].values()) < 1e-5
