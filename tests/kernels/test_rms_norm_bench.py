"""The RMSNorm benchmark script runs end to end in --smoke mode (CPU Triton interpreter)."""

from tests.kernels.bench_smoke import run_smoke


def test_bench_smoke_writes_agreeing_results(tmp_path):
    report = run_smoke("bench_rms_norm.py", tmp_path / "rms-norm-smoke.json")
    assert {"device", "date", "timing", "results"} <= report.keys()
    assert [(r["rows"], r["h"], r["gated"]) for r in report["results"]] == [(37, 2048, False), (45, 128, False),
                                                                           (45, 128, True)]
    for row in report["results"]:
        assert row["kernel_fwd_ms"] > 0 and row["reference_fwd_bwd_ms"] > 0
        names = {"y", "dx", "dweight"} | ({"dgate"} if row["gated"] else set())
        assert set(row["max_rel_error"]) == names
        assert max(row["max_rel_error"].values()) < 1e-5
