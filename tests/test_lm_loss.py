"""The model's LM loss with ``fused_cross_entropy`` on vs off (Megatron's ``vocab_parallel_cross_entropy``):
the tiny CPU model, standard and Block AttnRes, on one rank and with TP2 (each rank half the vocab), the
same per-token ``[b, s]`` loss and the same parameter gradients, from the same seed's weights."""

import pytest
import torch

from tests._dist import run_distributed
from tests.parallel import harness


def _loss_and_grads(fused: bool, layout: dict, **overrides):
    from megatron_ext.layers import lm_loss
    from megatron_ext.model import build_model

    calls, fused_ce = [], lm_loss.cross_entropy
    lm_loss.cross_entropy = lambda *a, **k: calls.append(k) or fused_ce(*a, **k)
    config = harness.tiny_config(layout, False, fused_cross_entropy=fused, **overrides)
    torch.manual_seed(harness.SEED)
    model = build_model(config)
    mb = harness.microbatches_for_rank(harness.make_batches())[0]
    try:
        loss = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
    finally:
        lm_loss.cross_entropy = fused_ce
    assert len(calls) == int(fused), calls  # the fused path ran (only) when on
    assert all(k["vocab_start"] == config.padded_vocab_size() // config.tensor_model_parallel_size
               * torch.distributed.get_rank() for k in calls), calls
    probe = torch.rand(loss.shape, generator=torch.Generator().manual_seed(7))
    (loss * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return type(model).__name__, loss.detach(), mb["labels"].shape, grads


def _run(rank, world_size, layout):
    from megatron_ext import cpu_compat
    from megatron_ext.parallel import initialize_parallel

    cpu_compat.install()
    initialize_parallel(harness.tiny_config(layout, False), harness.SEED)
    cases = {"standard": {}, "attn_res": dict(attn_res=True, attn_res_num_blocks=2)}
    return {name: [_loss_and_grads(fused, layout, **kw) for fused in (False, True)] for name, kw in cases.items()}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def results(request):
    tp = request.param
    return run_distributed(_run, tp, dict(tensor_model_parallel_size=tp) if tp > 1 else {})


@pytest.mark.slow
@pytest.mark.parametrize("name,model_class", [("standard", "HybridGPTModel"), ("attn_res", "AttnResGPTModel")])
def test_fused_loss_equals_megatron_loss(results, name, model_class):
    for rank_result in results:
        (stock_class, stock_loss, labels_shape, stock_grads), (cls, loss, _, grads) = rank_result[name]
        assert stock_class == cls == model_class
        assert loss.shape == stock_loss.shape == labels_shape and loss.dtype == torch.float32  # [b, s]
        torch.testing.assert_close(loss, stock_loss, rtol=1e-6, atol=1e-6)
        assert set(grads) == set(stock_grads)
        for key, want in stock_grads.items():
            scale = float(want.abs().max())
            if scale == 0:  # AttnRes at init: zero queries, a uniform mix, exactly zero key-norm grads
                assert "mixer" in key and torch.equal(grads[key], want), key
                continue
            torch.testing.assert_close(grads[key], want, rtol=1e-5, atol=1e-6 * scale, msg=lambda m, k=key: f"{k}: {m}")
    torch.testing.assert_close(results[0][name][1][1], results[-1][name][1][1])  # TP ranks agree


def test_config_field():
    from megatron_ext.config import USER_FIELDS, ConfigError

    assert harness.tiny_config({}, False).fused_cross_entropy is True
    assert "fused_cross_entropy" in USER_FIELDS
    with pytest.raises(ConfigError, match=r"^fused_cross_entropy='yes' must be true or false"):
        harness.tiny_config({}, False, fused_cross_entropy="yes")
