"""Block AttnRes on one rank: the model equals the definition, N = 1 and zero-query properties."""

import pytest
import torch

from tests._dist import run_distributed
from tests.attn_res import single_rank


@pytest.fixture(scope="module")
def results():
    (out,) = run_distributed(single_rank.run_all, 1)
    return out


def assert_logits_and_grads_close(got, want, rtol=1e-4):
    (got_logits, got_grads), (want_logits, want_grads) = got, want
    torch.testing.assert_close(got_logits, want_logits, rtol=rtol, atol=1e-6)
    assert set(got_grads) == set(want_grads)
    for name, want_grad in want_grads.items():
        scale = float(want_grad.abs().max())
        assert scale > 0, f"{name}: zero grad, the comparison would be vacuous"
        torch.testing.assert_close(
            got_grads[name], want_grad, rtol=rtol, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("key", ["reference_full", "reference_blocks"])
def test_model_equals_plain_definition(results, key):
    """N = 2L (Full AttnRes) and N = 2 (blocks of 4) vs the plain reference, random mixers."""
    got, want = results[key]
    # The first attention sublayer mixes one source: its mixer grads are exactly zero.
    for grads in (got[1], want[1]):
        grads.pop("decoder.layers.0.attn_mixer.query")
        grads.pop("decoder.layers.0.attn_mixer.key_norm_weight")
    assert_logits_and_grads_close(got, want)


def test_one_block_with_zero_queries_equals_standard_residual(results):
    """N = 1, zero pseudo-queries, eps -> 0: same logits and layer grads as standard residuals.

    Sources are [b_0, partial]; the uniform mix (b_0 + partial) / 2 is the standard stream
    halved, and every consumer is an RMSNorm (scale-invariant), so only eps differs.
    """
    (std_logits, std_grads), (ar_logits, ar_grads) = results["one_block_zero_queries"]
    shared = set(std_grads) & set(ar_grads)
    assert shared == set(std_grads), set(std_grads) - shared
    assert_logits_and_grads_close(
        (ar_logits, {k: ar_grads[k] for k in shared}), (std_logits, std_grads), rtol=1e-4
    )


def test_one_block_with_learned_queries_is_not_standard_residual(results):
    """The N = 1 equivalence is a property of zero queries only (what the docs state)."""
    (std_logits, _), (ar_logits, _) = results["one_block_random_queries"]
    assert (std_logits - ar_logits).abs().max() > 1e-2


@pytest.mark.parametrize("key", ["init_mixers", "init_mixers_fused_norm"])
def test_zero_queries_give_uniform_average_with_block_schedule(results, key):
    """At init every sublayer input is the norm of the mean of its sources; the source counts
    follow DESIGN (blocks of S = 4: b_0, finished block sums, then the partial sum if non-empty)."""
    seen = results[key]
    counts = [len(sources) for _, sources, _, _ in seen]
    assert counts == [1, 2, 2, 2, 2, 3, 3, 3, 3], counts
    for name, sources, out, expected in seen:
        if len(sources) > 1:
            assert (sources[0] - sources[-1]).abs().max() > 1e-3, f"{name}: sources not distinct"
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_activation_memory_is_one_mixed_input_per_sublayer_more_than_standard(results):
    """Full AttnRes (the most sources) saves at most one extra [s, b, h] per depth mix (its
    output, which the sublayer's norm keeps, as the standard model keeps its residual stream);
    no stacked sources, keys or logits are kept. 4 layers: 8 sublayer mixes + the final one."""
    standard, one = results["saved_bytes_standard"]
    attn_res, _ = results["saved_bytes_full_attn_res"]
    assert attn_res - standard <= 9 * one, (attn_res - standard) / one


def _assert_fused_equals_unfused(result, rtol, atol):
    (off_logits, off_grads), (on_logits, on_grads), fused = result
    assert fused == 2 * 4 + 1, fused  # 4 layers x 2 sublayer norms + the final norm
    torch.testing.assert_close(on_logits, off_logits, rtol=rtol, atol=atol)
    assert set(on_grads) == set(off_grads)
    norm_grads = [n for n in off_grads if "layernorm" in n]
    assert len(norm_grads) == 9, norm_grads  # every norm weight got a grad through the fused op
    for name, off in off_grads.items():
        scale = float(off.abs().max())
        if "layers.0.attn_mixer" in name:  # one source: the softmax is constant, exactly zero grads
            assert scale == 0 and torch.equal(on_grads[name], off), name
            continue
        assert scale > 0, f"{name}: zero grad, the comparison would be vacuous"
        torch.testing.assert_close(on_grads[name], off, rtol=rtol, atol=atol * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("key", ["fuse_norm_blocks", "fuse_norm_full", "fuse_norm_recompute", "fuse_norm_no_inplace"])
def test_fused_norm_equals_separate_norm(results, key):
    """attn_res_fuse_norm on vs off (fp32, CPU, the torch path; random mixers and norm weights):
    the same logits and every grad, the norm weights' included."""
    _assert_fused_equals_unfused(results[key], rtol=1e-6, atol=1e-6)


def test_fused_norm_equals_separate_norm_triton_interpreter(monkeypatch):
    """The same with the Triton kernels (fused forward/backward vs mix kernel + separate norm),
    under Triton's CPU interpreter in a fresh process. The fused backward takes ``c = dout . out``
    in closed form (the unfused one as a dot product of nearly orthogonal rows), so the mixers'
    grads, sums of cancelling terms, differ by fp32 rounding: up to ~1.1e-5 of their largest entry."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (result,) = run_distributed(single_rank.run_fuse_norm_triton, 1)
    _assert_fused_equals_unfused(result, rtol=1e-5, atol=3e-5)


def test_pair_backward_equals_separate_backwards_triton_interpreter(monkeypatch):
    """attn_res_pair_backward on vs off with the Triton kernels under the CPU interpreter (fresh
    process; random mixers and norm weights): every layer's two mixers ran one backward pass over
    their shared blocks, and the logits and every grad are those of separate backwards up to fp32
    rounding, amplified: the shared blocks' grads are summed in another order, and the paired second
    call takes the softmax backward's c from its stored output where the unpaired preload kernel sums it
    from the sources (docs/attn_res.md, Precision of c); the mixers' grads are sums of cancelling terms,
    so the bound is 1e-3 of each grad's largest entry (the stored-output c alone moved a two-source
    mix's grads by 1.9e-4 in fp32 in the kernel benchmark's smoke run)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (result,) = run_distributed(single_rank.run_pair_backward_triton, 1)
    for key, layers_paired in (("blocks_of_2", 4), ("full", 4), ("recompute", 4)):
        (off_logits, off_grads), (on_logits, on_grads), paired = result[key]
        assert paired == layers_paired, (key, paired)
        torch.testing.assert_close(on_logits, off_logits, rtol=1e-5, atol=1e-6)
        assert set(on_grads) == set(off_grads)
        for name, off in off_grads.items():
            scale = float(off.abs().max())
            torch.testing.assert_close(on_grads[name], off, rtol=1e-5, atol=1e-3 * max(scale, 1e-6),
                                       msg=lambda m, n=name, k=key: f"{k} {n}: {m}")


@pytest.mark.parametrize(
    "key,expected_counts",
    [
        # 4 layers = 8 sublayers. Blocks of 4: b_0 read by all 8 mixes and the final one, b_1 by
        # sublayers 4..7 and the final mix, b_2 by the final mix only.
        ("inplace_blocks", [9, 5, 1]),
        # Full AttnRes: b_k (k >= 1) closes after sublayer k - 1 and is read by the 8 - k later
        # sublayers and the final mix.
        ("inplace_full", [9, 8, 7, 6, 5, 4, 3, 2, 1]),
        # Layer 0 checkpointed: outside, b_0 is read by sublayers 2..7 and the final mix (7)
        # and passed to the checkpoint (an ordinary autograd grad); the recompute tracks its own
        # b_0 (read by sublayers 0, 1), then b_1 (5) and b_2 (1) as before.
        ("inplace_recompute", [7, 5, 1, 2]),
    ],
)
def test_inplace_source_grads_equal_autograd_sums(results, key, expected_counts):
    """In-place source-grad sums on vs off (fp32, CPU, random mixers): the same logits and
    grads, and every tracked block got one contribution from each depth mix that reads it (a
    mix not passing its SourceGrads, or one dropped, would change a count or a grad)."""
    (off_logits, off_grads), (on_logits, on_grads), counts = results[key]
    assert counts == expected_counts, counts
    assert torch.equal(on_logits, off_logits)
    assert set(on_grads) == set(off_grads)
    exact = key != "inplace_recompute"  # there b_0's in-place sum and the checkpoint's grad are added last
    for name, off in off_grads.items():
        if exact:
            assert torch.equal(on_grads[name], off), name
        else:
            torch.testing.assert_close(on_grads[name], off, rtol=1e-6, atol=1e-7 * float(off.abs().max()))
