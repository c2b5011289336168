"""tools/router_scores.py on a tiny trained checkpoint, and the benchmarks' ``--scores`` rows that route what it
records (CPU, fp32)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd, timeout=600):
    return subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Four steps of configs/tiny.yaml (MoE layers 2-4, 4 experts, top-2, qb_bias) through launch/train.py on one
    process, then router_scores on 1024 held-out tokens: (JSON, scores file)."""
    run = tmp_path_factory.mktemp("router-scores")
    trained = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", ROOT / "launch" / "train.py",
                   "--config", ROOT / "configs" / "tiny.yaml", "--expert-model-parallel-size", "1", "--train-iters",
                   "4", "--lr-warmup-iters", "0", "--metrics-dir", run, "--save", run / "ckpt", "--no-save-optim")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    out, scores = run / "router-scores.json", run / "scores.pt"
    result = _run(ROOT / "tools" / "router_scores.py", run / "ckpt", "--tokens", "1024", "--out", out,
                  "--scores-out", scores)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "top-k MaxVio" in result.stdout
    return json.loads(out.read_text()), scores


@pytest.mark.slow
def test_every_moe_layer_is_recorded_and_summarized_from_its_scores(recorded):
    from megatron_ext.moe.quantile import capacity_routing
    from tools.router_scores import LAYER_KEYS, max_vio

    result, path = recorded
    assert result["tool"] == "router_scores" and result["iteration"] == 4 and result["balancer"] == "qb_bias"
    assert result["device"] == "cpu" and "stdlib" in result["data"] and "1024 held-out tokens" in result["how"]
    data = torch.load(path)
    assert [row["layer"] for row in result["layers"]] == sorted(data["scores"]) == [2, 3, 4]  # moe_layer_freq
    for row in result["layers"]:
        assert set(LAYER_KEYS) <= set(row) and (row["experts"], row["topk"], row["tokens"]) == (4, 2, 1024)
        scores, bias = data["scores"][row["layer"]].float(), data["bias"][row["layer"]]
        assert scores.shape == (1024, 4) and bias.shape == (4,) and ((scores > 0) & (scores < 1)).all()
        # The file's fp16 scores give back the JSON's figures (fp32): up to a flipped choice or two.
        flips = 4 / (1024 * 2 / 4)  # MaxVio moves by 1 / mean load per pair moved
        assert max_vio((scores + bias).topk(2, dim=1).indices, 4) == pytest.approx(row["topk_max_vio"], abs=flips)
        assert max_vio(scores.topk(2, dim=1).indices, 4) == pytest.approx(row["unbiased_topk_max_vio"], abs=flips)
        assert row["unbiased_topk_max_vio"] > 0 and row["expert_logit_spread"] > 0 and row["token_logit_std"] > 0
        for factor, cap in row["capacity"].items():
            again = capacity_routing(scores, 2, float(factor), bias=bias, host_reads=True)
            assert cap["rounds"] >= 1 and 0 <= cap["dropped"] <= cap["rerouted"] + cap["dropped"] <= 1
            assert abs(int(again.rerouted) / 2048 - cap["rerouted"]) < 0.02, (row["layer"], factor)
            # the capacity caps every expert: max load <= cf * mean planned load (+ the ceil), over the kept mean
            assert cap["max_vio"] <= float(factor) / (1 - cap["dropped"]) - 1 + 4 / 2048, (row["layer"], factor)
    assert data["meta"]["topk"] == 2 and set(data["meta"]["topk_max_vio"]) == {2, 3, 4}


@pytest.mark.slow
def test_bench_routing_routes_the_recorded_scores(recorded, tmp_path):
    from tools.router_scores import load_scores

    result, path = recorded
    skewed = max(result["layers"], key=lambda row: row["topk_max_vio"])
    out = tmp_path / "routing.json"
    ran = _run(ROOT / "tools" / "dev" / "bench_routing.py", "--scores", path, "--num-tokens", "3000", "--repeats",
               "1", "--warmup", "0", "--capacity-factor", "1.25", "--out", out)
    assert ran.returncode == 0, ran.stderr[-3000:]
    bench = json.loads(out.read_text())
    assert bench["shape"]["num_experts"] == 4 and bench["shape"]["k"] == 2 and bench["shape"]["num_tokens"] == 3000
    assert bench["scores"]["layer"] == skewed["layer"] == load_scores(path)[2]["layer"]  # the most skewed by default
    topk = next(row for row in bench["results"] if row["op"] == "topk_routing")
    # 3000 rows drawn from the 1024 recorded ones: about the recorded skew
    assert topk["max_vio"] == pytest.approx(skewed["topk_max_vio"], abs=0.15)
    for row in bench["results"]:
        if row["op"].startswith("capacity"):
            assert row["max_vio"] <= 0.25 + 1e-6  # capacity factor 1.25 bounds every expert
    # the routing as training runs it (here the CPU's: reads, PyTorch rounds) routes as the lossless eager call
    rows = {row["op"]: row for row in bench["results"]}
    trained, eager = rows["capacity cf=1.25 as trained"], rows["capacity cf=1.25 reads torch"]
    assert {key: trained[key] for key in ("dropped", "rerouted", "max_vio")} == {
        key: eager[key] for key in ("dropped", "rerouted", "max_vio")}


def _moe_router_sees(rank, world, path, variant):
    from tools import bench_moe

    args = bench_moe.parse_args(["--smoke", "--scores", str(path)])
    bench_moe.init_distributed(True)
    layer, dtype, device = bench_moe.build_layer(args, args.experts[0], variant)
    x = torch.randn(args.tokens, 1, args.hidden)
    if variant == "megatron":
        probs, routing_map = layer.router(x)
        chosen = routing_map.nonzero()[:, 1].view(-1, args.topk)
        probs.sum().backward()
    else:
        routing, _ = layer.router(x.view(args.tokens, -1))
        chosen = routing.experts
        routing.gates.sum().backward()
        if variant == "qb_bias":
            assert torch.equal(layer.router.expert_bias, args.recorded["bias"])
    return chosen.sort(dim=1).values, layer.router.weight.grad is not None, args.tokens


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["topk", "megatron"])
def test_bench_moe_routes_the_recorded_scores_with_the_routers_gradient(recorded, variant):
    from tools.router_scores import load_scores, tile_rows

    _, path = recorded
    ((chosen, has_grad, tokens),) = run_distributed(_moe_router_sees, 1, path, variant, timeout=300)
    scores = tile_rows(load_scores(path)[0], tokens, seed=0)
    expected = scores.topk(2, dim=1).indices.sort(dim=1).values
    assert torch.equal(chosen, expected) and has_grad
