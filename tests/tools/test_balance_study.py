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


def test_megatron_qb_adapter_routes_like_megatrons_qb_dual_update():
    import torch
    from megatron.core.transformer.moe.moe_utils import qb_dual_update
    from megatron_ext.moe.router import TopKRouter
    from tests.moe.test_moe_router import moe_config
    from tools.balance_study import use_megatron_quantile_balancing

    torch.manual_seed(0)
    router = TopKRouter(moe_config(moe_aux_loss_coeff=0.0), seed=3)
    use_megatron_quantile_balancing([torch.nn.ModuleList([router])])
    router.qb_beta.copy_(torch.randn(8) * 0.3)
    x = torch.randn(32, 16)  # 32 tokens x top-2 is divisible by 8 experts, as Megatron requires
    routing, counts = router(x)
    logits = x @ router.weight.t()
    indices, beta_local = qb_dual_update(logits, 2, router.qb_beta)
    assert torch.equal(routing.experts.sort(1).values, indices.sort(1).values)
    picked = logits.sigmoid().gather(1, routing.experts)
    torch.testing.assert_close(routing.gates, picked / picked.sum(1, keepdim=True))
    torch.testing.assert_close(router.qb_beta_accum, beta_local)
    assert int(router.qb_beta_count) == 1
    assert torch.equal(router.step_routed_counts, counts) and int(counts.sum()) == 64
