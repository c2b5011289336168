"""Fused LM cross-entropy: Triton kernels vs the PyTorch reference through autograd (CPU: Triton interpreter,
fp32/fp16, in a subprocess started by ``test_cases_under_interpreter``; GPU: bf16 against fp32). The
tensor-parallel path: tests/kernels/test_cross_entropy_tp.py; the model's loss: tests/test_lm_loss.py."""

import pytest
import torch

from kimi_kernels.cross_entropy import cross_entropy, cross_entropy_reference
from kimi_kernels.cross_entropy import naive
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


def make_case(shape, vocab, dtype, seed=0, device="cpu", scale=8.0):
    """Logits over a wide range (N(0, scale) plus a per-row offset and a few spikes), targets that include
    each row's max and min column, a random cotangent."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * scale + torch.randn(*shape, 1, generator=g) * 20
    flat = logits.view(-1, vocab)
    spikes = torch.randint(0, vocab, (flat.shape[0],), generator=g)
    flat[torch.arange(flat.shape[0]), spikes] += 40.0
    target = torch.randint(0, vocab, shape, generator=g)
    t = target.view(-1)
    if t.numel() >= 2:
        t[0] = flat[0].argmax()  # the row's max (its spike)
        t[1] = flat[1].argmin()
    if t.numel() >= 3:
        t[-1] = vocab - 1  # the last column: in the last, partial tile
    cotangent = torch.randn(shape, generator=g)
    return [x.to(device) for x in (logits.to(dtype), target, cotangent)]


def run(logits, target, cotangent, fn):
    """(loss, dlogits) of ``fn(logits, target)`` through autograd."""
    x = logits.clone().requires_grad_()
    loss = fn(x, target)
    (loss * cotangent).sum().backward()
    return loss, x.grad


def kernel(x, t):
    return cross_entropy(x, t, use_kernel=True)


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


# V off the 4096-column tile (1000: one partial tile; 5000: one full + one partial; 7: tiny), on it
# (32768: 8 tiles) with few rows; 1-D, 2-D ([s, b]) leading shapes.
SHAPES = [((7,), 1000), ((3, 2), 1000), ((4,), 5000), ((5,), 7), ((3,), 32768), ((2, 2), 32768)]


@interpreter_case
@pytest.mark.parametrize("shape,vocab", SHAPES, ids=str)
def test_kernel_matches_reference_fp32(shape, vocab):
    case = make_case(shape, vocab, torch.float32, seed=vocab)
    (loss, grad), (ref_loss, ref_grad) = run(*case, kernel), run(*case, cross_entropy_reference)
    assert loss.shape == ref_loss.shape == shape and loss.dtype == torch.float32
    assert grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@interpreter_case
@pytest.mark.parametrize("shape,vocab", [((7,), 1000), ((4,), 5000), ((3,), 32768)], ids=str)
def test_kernel_fp16_computes_in_fp32(shape, vocab):
    """fp16 logits (smaller range: fp16 tops out at 65504), against the fp32 reference on the same rounded
    values: the loss is fp32 maths, the gradient rounded to fp16 once."""
    logits, target, cotangent = make_case(shape, vocab, torch.float16, seed=1, scale=4.0)
    loss, grad = run(logits, target, cotangent, kernel)
    ref_loss, ref_grad = run(logits.float(), target, cotangent, cross_entropy_reference)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    assert rel_err(grad, ref_grad) < 1e-3


@interpreter_case
def test_target_at_the_row_max_and_min():
    """The target's own logit is the max (loss ~ 0, gradient ~ 0 at the target) or the min (loss ~ the gap)."""
    logits, target, cotangent = make_case((2,), 1000, torch.float32, seed=2)
    assert logits[0, target[0]] == logits[0].max() and logits[1, target[1]] == logits[1].min()
    (loss, grad), (ref_loss, ref_grad) = run(logits, target, cotangent, kernel), run(
        logits, target, cotangent, cross_entropy_reference)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert loss[1] > 40  # the min is far below the spiked max


@interpreter_case
def test_inplace_backward_non_contiguous_and_no_rows():
    logits, target, cotangent = make_case((4, 3), 1000, torch.float32, seed=3)
    ref = run(logits, target, cotangent, cross_entropy_reference)
    inplace = run(logits, target, cotangent, lambda x, t: cross_entropy(x, t, use_kernel=True, inplace_backward=True))
    xt, tt, ct = logits.transpose(0, 1), target.t(), cotangent.t()  # [3, 4, V] strided
    strided = run(xt, tt, ct, kernel)
    for (loss, grad), name in ((inplace, "inplace"), (strided, "strided")):
        if name == "strided":
            loss, grad = loss.t(), grad.transpose(0, 1)
        torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=1e-5, msg=name)
        torch.testing.assert_close(grad, ref[1], rtol=1e-5, atol=1e-6, msg=name)
    empty = run(*make_case((0, 2), 64, torch.float32), kernel)
    assert empty[0].shape == (0, 2) and empty[1].shape == (0, 2, 64)


@interpreter_case
def test_kernel_partials_match_the_reference_split():
    """A vocab shard (columns [1000, 2000) of a vocab of 3000): targets in and out of the shard."""
    logits, target, _ = make_case((6,), 1000, torch.float32, seed=4)
    target = torch.tensor([0, 999, 1000, 1500, 1999, 2999])
    from kimi_kernels.cross_entropy import fused

    got, want = fused.cross_entropy_partials(logits, target, 1000), naive.cross_entropy_partials(logits, target, 1000)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2][[0, 1, 5]], torch.zeros(3))  # targets owned by other ranks contribute 0
    lse, dloss = torch.randn(6) + 50, torch.randn(6)
    torch.testing.assert_close(fused.cross_entropy_grad(logits, target, 1000, lse, dloss),
                               naive.cross_entropy_grad(logits, target, 1000, lse, dloss), rtol=1e-5, atol=1e-7)


def test_reference_path_is_the_cpu_default_and_matches_autograd():
    logits, target, cotangent = make_case((5, 3), 300, torch.float32, seed=5)
    (loss, grad), (ref_loss, ref_grad) = run(logits, target, cotangent, cross_entropy), run(
        logits, target, cotangent, cross_entropy_reference)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_reference_equals_the_definition():
    """fp64 from the definition ``-log softmax(x)[target]``, and torch's own cross entropy."""
    logits, target, _ = make_case((6,), 50, torch.float32, seed=6)
    x64 = logits.double()
    want = -(x64.exp() / x64.exp().sum(-1, keepdim=True)).log()[torch.arange(6), target]
    torch.testing.assert_close(cross_entropy_reference(logits, target).double(), want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(cross_entropy_reference(logits, target),
                               torch.nn.functional.cross_entropy(logits, target, reduction="none"))


@pytest.mark.parametrize("logits_shape,target_shape,match", [
    ((4, 16), (4, 1), r"target must have the logits' leading shape \(4,\)"),
    ((2, 3, 16), (3, 2), r"leading shape \(2, 3\)"),
    ((), (), r"logits must be \[\.\.\., V\]"),
    ((4, 0), (4,), r"V > 0"),
])
def test_bad_shapes_are_refused(logits_shape, target_shape, match):
    with pytest.raises(ValueError, match=match):
        cross_entropy(torch.randn(logits_shape), torch.zeros(target_shape, dtype=torch.long))


@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "kernel"])
def test_bad_dtypes_and_targets_are_refused(use_kernel):
    x, t = torch.randn(4, 16), torch.tensor([0, 3, 15, 2])
    with pytest.raises(ValueError, match="target must be int64 or int32"):
        cross_entropy(x, t.float(), use_kernel=use_kernel)
    with pytest.raises(ValueError, match="logits must be fp32/fp16/bf16"):
        cross_entropy(x.long(), t, use_kernel=use_kernel)
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 16\), got min 0, max 16"):
        cross_entropy(x, torch.tensor([0, 3, 16, 2]), use_kernel=use_kernel)
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 16\), got min -1"):
        cross_entropy(x, torch.tensor([0, -1, 1, 2]), use_kernel=use_kernel)
    with pytest.raises(ValueError, match="vocab_start=16 must be in"):
        cross_entropy(x, t, vocab_start=16, use_kernel=use_kernel)
    if use_kernel:
        with pytest.raises(ValueError, match="logits must be fp32/fp16/bf16"):
            cross_entropy(x.double(), t, use_kernel=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,vocab", [((4096, 2), 32768), ((301,), 1000), ((7, 3), 50257)], ids=str)
def test_gpu_bf16_matches_fp32_reference(shape, vocab):
    """bf16 logits on CUDA (8192 tokens x 32768: the profiled size) vs the fp32 reference on the same values."""
    logits, target, cotangent = make_case(shape, vocab, torch.bfloat16, device="cuda")
    loss, grad = run(logits, target, cotangent, lambda x, t: cross_entropy(x, t))  # CUDA: the kernel
    ref_loss, ref_grad = run(logits.float(), target, cotangent, cross_entropy_reference)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert rel_err(loss, ref_loss) < 1e-2
    assert rel_err(grad, ref_grad) < 1e-2
    again = run(logits, target, cotangent, lambda x, t: cross_entropy(x, t, inplace_backward=True))
    assert torch.equal(loss, again[0]) and torch.equal(grad, again[1])
