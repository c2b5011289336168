"""tools/bench_e2e.py --smoke: every variant's training step on the CPU, the JSON, the profile table."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench_e2e import format_table, write_json
from tools.e2e_rows import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"name", "gpus", "seq", "tokens_per_sec", "tflops", "mfu", "peak_gb"}


def _start(tmp_path, *flags):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "tools" / "bench_e2e.py"), "--smoke", *flags],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_smoke_times_every_variant_and_profiles_one(tmp_path):
    out_json, out_md = tmp_path / "e2e.json", tmp_path / "profile.md"
    # The two runs are independent processes: run them side by side to halve the wall time.
    bench = _start(tmp_path, "--out", str(out_json))
    profile = _start(tmp_path, "--profile", "ours_full", "--profile-out", str(out_md))
    stdout = _finish(bench)
    _finish(profile)

    result = json.loads(out_json.read_text())
    assert {"rows", "device", "date", "peak_tflops_measured"} <= set(result) and result["device"] == "cpu"
    assert result["peak_tflops_measured"] > 0
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == list(VARIANTS)
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert ROW_KEYS <= set(row) and row["gpus"] == 1
        assert row["tokens_per_sec"] > 0 and row["tflops"] > 0 and row["mfu"] > 0, name
    assert rows["ours_base_16k"]["seq"] == 2 * rows["ours_base"]["seq"]
    # One formula for every row: stock and ours_base have the same layers, so the same FLOPs.
    assert rows["stock"]["flops_per_token"] == rows["ours_base"]["flops_per_token"]
    assert rows["ours_full"]["flops_per_token"] != rows["ours_base"]["flops_per_token"]
    assert stdout.rstrip().splitlines()[-1].split("|")[0].strip() == "ours_full_16k"  # the table is last

    table = out_md.read_text()
    assert "ours_full" in table and "| 1 | `" in table and "| 30 | `" in table
    # the per-operator view names backward nodes
    assert "Top 40 operators" in table and "| bwd: " in table and "host-side entries" in table


def test_failed_row_is_shown_and_other_gpu_counts_are_kept(tmp_path):
    path = tmp_path / "e2e.json"
    ep2 = {"name": "stock", "gpus": 2, "seq": 64, "micro_batch": 2, "step_ms": 1.0, "tokens_per_sec": 1.0,
           "tflops": 1.0, "mfu": 0.1, "peak_gb": 1.0}
    failed = {"name": "stock", "gpus": 1, "seq": 64, "micro_batch": 2, "step_ms": None, "tokens_per_sec": None,
              "tflops": None, "mfu": None, "peak_gb": None, "error": "OutOfMemoryError: CUDA out of memory"}
    write_json(str(path), {"rows": [ep2], "date": "old"})
    write_json(str(path), {"rows": [failed], "date": "new"})
    merged = json.loads(path.read_text())
    assert merged["date"] == "new" and [r["gpus"] for r in merged["rows"]] == [2, 1]
    write_json(str(path), {"rows": [failed], "date": "newer"})  # same GPU count: replaced, not appended
    assert [r["gpus"] for r in json.loads(path.read_text())["rows"]] == [2, 1]
    assert "failed: OutOfMemoryError" in format_table([failed])


def test_two_gpu_rows_get_their_scaling_efficiency(tmp_path):
    path = tmp_path / "e2e.json"
    one = {"name": "ours_base", "gpus": 1, "seq": 64, "tokens_per_sec": 1000.0}
    two = {"name": "ours_base", "gpus": 2, "seq": 64, "tokens_per_sec": 1800.0}
    two_stock = {"name": "stock", "gpus": 2, "seq": 64, "tokens_per_sec": 900.0}  # no one-GPU row: none
    write_json(str(path), {"rows": [one]})
    write_json(str(path), {"rows": [two, two_stock]})
    rows = {(r["name"], r["gpus"]): r for r in json.loads(path.read_text())["rows"]}
    assert rows[("ours_base", 2)]["scaling_efficiency"] == 0.9
    assert "scaling_efficiency" not in rows[("stock", 2)] and "scaling_efficiency" not in rows[("ours_base", 1)]


def test_eager_rows_parse_with_repeats_and_the_routing_layout_follows_the_flags(capsys, monkeypatch):
    import torch.distributed as dist

    from tools.bench_e2e import parse_args
    from tools.e2e_rows import GPU_SIZES, routing_layout, variant_shape

    args = parse_args(["--variants", "ours_full_16k,ours_full_16k+eager,ours_full_16k,ours_full_16k+eager"])
    assert args.variants == ["ours_full_16k", "ours_full_16k+eager"] * 2  # ABAB stays in order
    assert variant_shape("ours_full_16k+eager", GPU_SIZES) == variant_shape("ours_full_16k", GPU_SIZES)
    assert variant_shape("ours_full+eager", GPU_SIZES) == (GPU_SIZES["seq"], GPU_SIZES["micro_batch"])
    with pytest.raises(SystemExit):
        parse_args(["--variants", "ours_base+eager"])  # the base rows have no capacity routing
    assert "apply to the ours_full rows" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # kernel layouts are no row option: another commit is the A/B
        parse_args(["--variants", "ours_full@state-bv32"])
    assert "unknown row 'ours_full@state-bv32'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--variants", "ours_ful"])
    assert "unknown row 'ours_ful'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--qb-cuda-graph", "on"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--qb-cuda-graph", "on", "--qb-host-reads", "on"])

    def layout(name, *flags, cuda=True):
        return routing_layout(name, parse_args(list(flags)), cuda)

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)  # a one-GPU run
    assert layout("ours_full_16k") == (False, True)  # auto: graphs on one GPU
    assert layout("ours_full_16k", cuda=False) == (None, False)  # the CPU smoke run keeps the defaults
    assert layout("ours_full_16k+eager") == (None, False)
    assert layout("ours_full", "--qb-cuda-graph", "off") == (None, False)
    assert layout("ours_full", "--qb-host-reads", "on") == (True, False)  # reads asked for: no graphs
    assert layout("ours_full", "--qb-cuda-graph", "off", "--qb-host-reads", "off") == (False, False)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)  # EP2: HybridConfig's defaults
    assert layout("ours_full_16k") == (None, False)


def test_row_names_split_into_base_and_options(monkeypatch):
    """``+torch-rounds`` is the row's config (``moe_qb_rounds_impl``), no module constant."""
    import torch.distributed as dist

    from tools.bench_e2e import parse_args
    from tools.e2e_rows import SMOKE_SIZES, ours_config, qb_rounds_impl, split_variant

    name = "ours_full_16k+eager+torch-rounds"
    assert parse_args(["--variants", name]).variants == [name]
    assert split_variant(name) == ("ours_full_16k", {"eager", "torch-rounds"})
    assert (qb_rounds_impl(name), qb_rounds_impl("ours_full_16k")) == ("torch", None)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    config = ours_config(SMOKE_SIZES, 64, techniques=True, cuda=False, qb_rounds_impl=qb_rounds_impl(name))
    assert config.moe_qb_rounds_impl == "torch"
    assert ours_config(SMOKE_SIZES, 64, techniques=True, cuda=False).moe_qb_rounds_impl == "auto"


@pytest.mark.parametrize("name,message", [("ours_full+fast", "unknown option '\\+fast'"),
                                          ("ours_base+eager", "apply to the ours_full rows"),
                                          ("ours_full_16k@state-bv32", "unknown row")])
def test_unknown_or_misplaced_row_options_are_refused(name, message, capsys):
    from tools.bench_e2e import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--variants", name])
    assert re.search(message, capsys.readouterr().err)


def test_no_attnres_rows_build_the_same_model_with_standard_residuals(monkeypatch):
    """``ours_full+no-attnres``: AttnRes off, everything else as the ours_full row (its overhead A/B)."""
    import dataclasses

    import torch.distributed as dist

    from tools.bench_e2e import parse_args
    from tools.e2e_rows import SMOKE_SIZES, ours_config, split_variant

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    assert parse_args(["--variants", "ours_full_16k+no-attnres"]).variants == ["ours_full_16k+no-attnres"]
    assert "no-attnres" in split_variant("ours_full_16k+no-attnres")[1]
    with_attn_res = ours_config(SMOKE_SIZES, 64, techniques=True, cuda=False)
    without = ours_config(SMOKE_SIZES, 64, techniques=True, cuda=False, attn_res=False)
    assert with_attn_res.attn_res and not without.attn_res
    differing = {f.name for f in dataclasses.fields(without)
                 if not callable(getattr(without, f.name))  # init functions: a new closure per config
                 and getattr(without, f.name) != getattr(with_attn_res, f.name)}
    assert differing == {"attn_res"}
