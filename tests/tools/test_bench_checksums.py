"""tools/dev/bench_checksums.py on a small file: both manifests verify the same bytes and the JSON holds both rows."""

import json

from tools.dev.bench_checksums import main


def test_bench_times_both_manifests(tmp_path):
    out = tmp_path / "checksums.json"
    result = main(["--gb", "0.07", "--files", "2", "--repeat", "1", "--dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["block_bytes"] for r in result["rows"]] == [None, 64 << 20]
    assert result["bytes"] == 2 * (64 << 20) and all(r["verify_s"] > 0 for r in result["rows"])
    assert list(tmp_path.iterdir()) == [out]  # its files removed
