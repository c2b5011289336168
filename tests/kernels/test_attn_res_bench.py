"""The AttnRes kernel benchmark script runs end to end in --smoke mode (CPU Triton interpreter)."""

from tests.kernels.bench_smoke import run_smoke


def test_bench_smoke_writes_agreeing_results(tmp_path):
    report = run_smoke("bench_attnres_kernel.py", tmp_path / "attnres-smoke.json", "--schedule", timeout=600)
    assert {"device", "date", "results"} <= report.keys()
    assert [row["n"] for row in report["results"]] == [2, 5, 9]
    for row in report["results"]:
        assert {"T", "h", "kernel_ms", "reference_ms", "kernel_fwd_ms", "reference_fwd_ms"} <= row.keys()
        assert row["kernel_ms"] > 0 and row["reference_ms"] > 0
        assert max(row["max_rel_error"].values()) < 1e-5
    schedule = report["schedule"]
    assert set(schedule["ms"]) == {"unpaired", "pair"}
    # the paired second call takes the softmax backward's c from its fp32 output, unpaired from the sources: they
    # differ by rounding only (docs/attn_res.md, "Precision of c")
    assert schedule["max_rel_diff_pair_vs_unpaired"] < 1e-3
