"""tools/eval_lengths.py, tools/gmin_sweep.py and tools/text_corpus.py on the CPU at the tiny size
(configs/gmin-sweep-tiny.yaml): properties of their outputs, not numbers (a smoke test, not a benchmark)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gmin-sweep-tiny.yaml"
PY = sys.executable


def _run(*cmd, timeout=600):
    return subprocess.run([PY, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """Two steps of the tiny hybrid model through launch/train.py (one process), saved without optimizer."""
    run = tmp_path_factory.mktemp("tiny")
    result = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", ROOT / "launch" / "train.py",
                  "--config", TINY, "--train-iters", "2", "--metrics-dir", run, "--save", run / "ckpt",
                  "--no-save-optim")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run / "ckpt"


def _check_rows(result, lengths, train_length):
    from tools.eval_lengths import ROW_KEYS

    assert [r["length"] for r in result["rows"]] == lengths
    for row in result["rows"]:
        assert set(ROW_KEYS) <= set(row)
        assert math.isfinite(row["loss"]) and row["loss"] > 0 and row["nonfinite"] == 0
        assert row["ppl"] == pytest.approx(math.exp(row["loss"]))
        assert row["windows"] >= 1 and row["tokens"] == row["windows"] * row["length"]
        assert (row["loss_beyond_train"] is None) == (row["length"] <= train_length)


@pytest.mark.slow
def test_eval_lengths_on_the_stdlib_split(tiny_checkpoint, tmp_path):
    out, plot = tmp_path / "lengths.json", tmp_path / "lengths.png"
    result = _run(ROOT / "tools" / "eval_lengths.py", tiny_checkpoint, "--multiples", "1,2,4", "--tokens", "256",
                  "--out", out, "--plot", plot)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "length      64 (1x)" in result.stdout and "past training length" in result.stdout
    data = json.loads(out.read_text())
    assert data["tool"] == "eval_lengths" and data["iteration"] == 2 and data["train_length"] == 64
    assert data["device"] == "cpu" and data["dtype"] == "fp32" and "stdlib" in data["data"]
    _check_rows(data, [64, 128, 256], 64)
    assert plot.stat().st_size > 0


@pytest.mark.slow
def test_eval_lengths_on_indexed_data(tiny_checkpoint, tmp_path):
    """--data-path: the validation documents of an indexed dataset built by tools/preprocess_data.py."""
    docs = tmp_path / "docs.jsonl"
    with open(docs, "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"Document {i}. " + "The decay gate keeps the state bounded. " * 20}) + "\n")
    prefix = tmp_path / "docs"
    assert _run(ROOT / "tools" / "preprocess_data.py", "--input", docs, "--output-prefix", prefix).returncode == 0
    out = tmp_path / "lengths.json"
    result = _run(ROOT / "tools" / "eval_lengths.py", tiny_checkpoint / "iter_0000002", "--lengths", "32,96",
                  "--tokens", "192", "--data-path", prefix, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "validation documents" in data["data"]
    _check_rows(data, [32, 96], 64)


def test_split_document_range_matches_megatron():
    from tools.eval_lengths import split_document_range

    assert split_document_range(1000, "969,30,1") == (969, 999)
    assert split_document_range(50, "98,2,0") == (49, 50)
    assert split_document_range(10, "1") == (10, 10)


@pytest.mark.parametrize("args,names", [
    (["/nonexistent/ckpt"], "checkpoint /nonexistent/ckpt is not a directory"),
    ([".", "--multiples", "1,x"], "--multiples='1,x'"),
    ([".", "--tokens", "0"], "--tokens=0"),
])
def test_eval_lengths_bad_arguments_are_named(args, names):
    result = _run(ROOT / "tools" / "eval_lengths.py", *args)
    assert result.returncode == 2 and names in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("args,names", [
    (["--settings", "gmin-5,gmin-x"], "--settings: unknown setting 'gmin-x'"),
    (["--settings", "gmin-5,gmin-5"], "names a setting twice"),
    (["--config", "/nonexistent.yaml"], "--config: /nonexistent.yaml does not exist"),
    (["--steps", "0"], "--steps=0"),
    (["--data-path", "/nonexistent/prefix"], "--data-path: /nonexistent/prefix.idx not found"),
])
def test_gmin_sweep_bad_arguments_are_named(args, names, tmp_path):
    result = _run(ROOT / "tools" / "gmin_sweep.py", "--config", TINY, "--out-dir", tmp_path, *args)
    assert result.returncode == 2 and names in result.stderr, result.stderr[-2000:]


def test_setting_names_and_kernel_paths():
    from tools.gmin_settings import kernel_path, parse_setting

    assert parse_setting("gmin-12")["g_min"] == -12.0
    assert "--kda-gate-lower-bound" in parse_setting("gmin-3")["overrides"]
    assert kernel_path(parse_setting("gmin-5")).startswith("dense")
    assert kernel_path(parse_setting("gmin-8")).startswith("per-position")
    assert kernel_path(parse_setting("softplus")).startswith("per-position")
    assert kernel_path(parse_setting("rope-full")) == "no KDA layers"


@pytest.mark.slow
def test_sweep_trains_and_evaluates_every_setting(tmp_path):
    """The six default settings at the tiny size, 2 steps each: every field reported, plot and table written."""
    from tools.gmin_sweep import DEFAULT_SETTINGS, SETTING_KEYS

    out = tmp_path / "sweep.json"
    result = _run(ROOT / "tools" / "gmin_sweep.py", "--config", TINY, "--out-dir", tmp_path / "runs", "--steps", "2",
                  "--multiples", "1,2", "--eval-tokens", "128", "--json", out, "--time-budget", "1500",
                  timeout=1600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert [s["name"] for s in data["settings"]] == DEFAULT_SETTINGS.split(",")
    assert data["train_length"] == 64 and data["device"] == "cpu"
    for s in data["settings"]:
        assert set(SETTING_KEYS) <= set(s), set(SETTING_KEYS) - set(s)
        assert s["status"] == "done" and s["steps"] == 2 and math.isfinite(s["train_loss"])
        assert [r["length"] for r in s["lengths"]] == [64, 128]
        assert all(math.isfinite(r["loss"]) for r in s["lengths"])
        assert s["heldout_loss_train_length"] == s["lengths"][0]["loss"]
        assert s["nonfinite"] == dict(logged_nonfinite_loss=0, logged_nonfinite_grad_norm=0, skipped_steps=0)
        assert "skipped" in s["kernel_ms"]  # timed on CUDA only
    by_name = {s["name"]: s for s in data["settings"]}
    assert by_name["gmin-12"]["kernel_path"].startswith("per-position")
    assert by_name["gmin-5"]["kernel_path"].startswith("dense")
    assert os.path.getsize(out.with_suffix(".png")) > 0
    assert "setting    steps" in result.stdout and "rope-full" in result.stdout.splitlines()[-1]
    replot = tmp_path / "again.png"
    again = _run(ROOT / "tools" / "gmin_sweep.py", "--replot", out, "--plot", replot)
    assert again.returncode == 0 and replot.stat().st_size > 0


@pytest.mark.slow
def test_sweep_cuts_a_setting_at_its_time_and_still_evaluates_it(tmp_path):
    """A budget far below the steps asked (no machine trains 100k steps in a minute): the trainer gets SIGTERM,
    saves, and the sweep evaluates that."""
    out = tmp_path / "sweep.json"
    result = _run(ROOT / "tools" / "gmin_sweep.py", "--config", TINY, "--out-dir", tmp_path / "runs", "--settings",
                  "gmin-8", "--steps", "100000", "--multiples", "1", "--eval-tokens", "128", "--json", out,
                  "--time-budget", "90", "--eval-reserve", "30", timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (s,) = json.loads(out.read_text())["settings"]
    assert s["status"] == "cut by the time budget (SIGTERM); saved", s["status"]
    assert 0 < s["steps"] < 100000 and s["saved"] and s["eval_iteration"] == s["steps"]
    assert math.isfinite(s["lengths"][0]["loss"])


def test_text_corpus_is_deterministic_and_deduplicated(tmp_path, monkeypatch):
    from tools import text_corpus

    root = tmp_path / "py"
    (root / "pkg-1.0.dist-info").mkdir(parents=True)
    (root / "pkg-1.0.dist-info" / "METADATA").write_text("Summary of the package. " * 20)
    (root / "README.md").write_text("# Read me\n" + "A real sentence about the library. " * 20)
    (root / "COPY.md").write_text("# Read me\n" + "A real sentence about the library. " * 20)  # a duplicate
    (root / "tiny.txt").write_text("short")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "mod.py").write_text('"""Module docstring. ' + "Words about it. " * 20 + '"""\n'
                                                   'def f():\n    """Function docstring."""\n')
    monkeypatch.setattr(text_corpus, "python_roots", lambda: [str(root)])
    monkeypatch.setattr(text_corpus, "usr_share_doc", lambda: iter(()))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    manifest = text_corpus.build(str(a), 1.0, log=lambda *_: None)
    text_corpus.build(str(b), 1.0, log=lambda *_: None)
    assert a.read_bytes() == b.read_bytes()
    docs = [json.loads(line) for line in a.read_text().splitlines()]
    assert manifest["documents"] == len(docs) == 3  # METADATA, one README copy, the docstrings
    assert {d["source"] for d in docs} == {"docs", "docstrings"}
    assert any("Function docstring." in d["text"] for d in docs)
