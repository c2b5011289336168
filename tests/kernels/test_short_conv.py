"""Causal short conv + SiLU: Triton kernels vs the PyTorch reference (CPU: Triton interpreter, fp32/fp16,
in a subprocess started by ``test_cases_under_interpreter``; GPU: bf16 against the fp32 reference)."""

import pytest
import torch

from kimi_kernels.short_conv import causal_conv_silu, causal_conv_silu_group, causal_conv_silu_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


def make_case(seq, batch, channels, kernel_size, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, channels, generator=g).to(dtype)
    weight = torch.randn(channels, kernel_size, generator=g) * 0.5 + 0.1  # fp32, as the parameter
    cotangent = torch.randn(batch, seq, channels, generator=g)
    return [t.to(device) for t in (x, weight, cotangent)]


def run(x, weight, cotangent, use_kernel):
    xx, ww = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = causal_conv_silu(xx, ww, use_kernel=use_kernel)
    (y.float() * cotangent).sum().backward()
    return y, xx.grad, ww.grad


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


# (s, b, C, K): s off the time tiles (and over one backward chunk of 128 in the last case), C off the
# channel tile of 128, b = 1 and 3, K = 2, 3, 4 (and s < K - 1 steps of history at the start of each).
SHAPES = [(37, 3, 200, 4), (5, 1, 7, 2), (70, 1, 130, 3), (19, 3, 64, 3), (150, 1, 33, 4)]


@interpreter_case
@pytest.mark.parametrize("seq,batch,channels,kernel_size", SHAPES)
def test_kernel_matches_reference_fp32(seq, batch, channels, kernel_size):
    case = make_case(seq, batch, channels, kernel_size, torch.float32, seed=seq)
    ours, ref = run(*case, use_kernel=True), run(*case, use_kernel=False)
    for a, b, name in zip(ours, ref, ("y", "dx", "dweight")):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 1e-5, name
    y, dx, dw = ours
    assert y.is_contiguous() and dx.shape == (seq, batch, channels) and dw.dtype == torch.float32


@interpreter_case
@pytest.mark.parametrize("seq,batch,channels,kernel_size", [(37, 3, 200, 4), (70, 1, 130, 2)])
def test_kernel_fp16_computes_in_fp32(seq, batch, channels, kernel_size):
    """fp16 activations, fp32 weight, against the fp32 reference on the same fp16-rounded inputs: y and dx
    are rounded to fp16 once; dweight is summed in fp32 but from the fp16-rounded dy autograd hands in."""
    x, weight, cotangent = make_case(seq, batch, channels, kernel_size, torch.float16, seed=1)
    ours = run(x, weight, cotangent, use_kernel=True)
    ref = run(x.float(), weight, cotangent, use_kernel=False)
    assert ours[0].dtype == torch.float16 and ours[1].dtype == torch.float16 and ours[2].dtype == torch.float32
    assert rel_err(ours[0], ref[0]) < 2e-3 and rel_err(ours[1], ref[1]) < 2e-3 and rel_err(ours[2], ref[2]) < 2e-3


def reference_grads(x, weight, cotangent):
    xx, ww = x.clone().requires_grad_(), weight.clone().requires_grad_()
    (causal_conv_silu_reference(xx, ww) * cotangent).sum().backward()
    return xx.grad, ww.grad


# (s, b, C, K, chunks): the backward program walks T = chunk steps (+ K-1 past them) in groups of U = 8
# (U = 4 above K = 4). T = 1 and 2 (the K-1 halos cross several chunks), T + K - 1 off and on a multiple
# of U, T over s (one chunk, s shorter than one group), the last chunk partial; K = 1 (no window), K = 8.
BWD_CHUNK_CASES = [
    (23, 2, 130, 4, (1, 2, 5, 7, 13, 22, 23, 40)),
    (9, 3, 33, 3, (1, 4, 6, 9, 50)),
    (12, 1, 20, 1, (1, 3, 8, 12)),
    (30, 2, 17, 8, (1, 3, 4, 11, 29, 31)),
    (3, 2, 8, 4, (1, 2, 5)),
]


@interpreter_case
@pytest.mark.parametrize("seq,batch,channels,kernel_size,chunks", BWD_CHUNK_CASES)
def test_backward_chunks_match_reference(seq, batch, channels, kernel_size, chunks):
    """conv_bwd at any chunk length T: the chunk boundaries (halo rows, g from the next chunk, the walk
    past the chunk and past the sequence) leave dx and dweight as the reference's."""
    from kimi_kernels.short_conv.fused import conv_bwd

    x, weight, cotangent = make_case(seq, batch, channels, kernel_size, torch.float32, seed=seq + kernel_size)
    ref_dx, ref_dw = reference_grads(x, weight, cotangent)
    for chunk in (None, *chunks):
        (dx,), (dw,) = conv_bwd([cotangent.contiguous()], [x], [weight], chunk=chunk)
        assert rel_err(dx, ref_dx) < 1e-5 and rel_err(dw, ref_dw) < 1e-5, chunk


def run_group(xs, weights, cotangents, use_kernel):
    xs = [x.clone().requires_grad_() for x in xs]
    weights = [w.clone().requires_grad_() for w in weights]
    ys = causal_conv_silu_group(xs, weights, use_kernel=use_kernel)
    sum((y.float() * c).sum() for y, c in zip(ys, cotangents)).backward()
    return ys, [x.grad for x in xs], [w.grad for w in weights]


@interpreter_case
@pytest.mark.parametrize("parts,chunk", [(3, None), (2, 3), (3, 7)])
def test_group_equals_one_call_per_part(parts, chunk, monkeypatch):
    """q, k and v of a KDA layer in one launch each way: every part's y, dx and dweight equal to its own call's,
    bit for bit (the same arithmetic; only the program's part and its dweight slots differ), also when the
    backward's time chunks split the sequence."""
    from kimi_kernels.short_conv import fused

    if chunk is not None:
        monkeypatch.setattr(fused, "bwd_chunk", lambda *args: chunk)
    cases = [make_case(29, 2, 150, 4, torch.float32, seed=10 + i) for i in range(parts)]
    xs, weights, cotangents = (list(t) for t in zip(*cases))
    grouped = run_group(xs, weights, cotangents, use_kernel=True)
    single = [run(x, w, c, use_kernel=True) for x, w, c in cases]
    for i in range(parts):
        for got, want, name in zip((grouped[0][i], grouped[1][i], grouped[2][i]), single[i], ("y", "dx", "dw")):
            assert torch.equal(got, want), (i, name)
    ref = [run(x, w, c, use_kernel=False) for x, w, c in cases]
    assert rel_err(grouped[2][1], ref[1][2]) < 1e-5  # and each is the reference's


@interpreter_case
def test_group_of_mixed_parts_runs_one_launch_each():
    """Parts of different shapes (or more than three) are taken one launch each, with the same results."""
    a = make_case(17, 2, 40, 3, torch.float32, seed=1)
    b = make_case(17, 2, 24, 3, torch.float32, seed=2)
    grouped = run_group([a[0], b[0]], [a[1], b[1]], [a[2], b[2]], use_kernel=True)
    for i, case in enumerate((a, b)):
        want = run(*case, use_kernel=True)
        assert torch.equal(grouped[0][i], want[0]) and torch.equal(grouped[1][i], want[1])
        assert torch.equal(grouped[2][i], want[2])


@interpreter_case
def test_kernel_takes_weight_in_activation_dtype():
    """A caller may cast the weight to the activations' dtype; its grad then comes back in that dtype."""
    x, weight, cotangent = make_case(21, 2, 40, 4, torch.float16, seed=2)
    ours = run(x, weight.half(), cotangent, use_kernel=True)
    ref = run(x.float(), weight.half().float(), cotangent, use_kernel=False)
    assert ours[2].dtype == torch.float16
    for a, b in zip(ours, ref):
        assert rel_err(a, b) < 2e-3


@interpreter_case
def test_samples_are_independent():
    """Changing one sample's input leaves the other samples' outputs and the causal prefix unchanged."""
    x, weight, _ = make_case(30, 3, 50, 4, torch.float32, seed=3)
    y = causal_conv_silu(x, weight, use_kernel=True)
    x2 = x.clone()
    x2[20:, 1] += 1.0
    y2 = causal_conv_silu(x2, weight, use_kernel=True)
    assert torch.equal(y[0], y2[0]) and torch.equal(y[2], y2[2]) and torch.equal(y[1, :20], y2[1, :20])
    assert not torch.equal(y[1, 20:], y2[1, 20:])


@pytest.mark.gpu
@pytest.mark.parametrize("seq,batch,channels,kernel_size", [(4096, 2, 2048, 4), (1000, 3, 200, 3)])
def test_gpu_bf16_matches_fp32_reference(seq, batch, channels, kernel_size):
    x, weight, cotangent = make_case(seq, batch, channels, kernel_size, torch.bfloat16, device="cuda")
    ours = run(x, weight, cotangent, use_kernel=None)  # CUDA: the kernel by default
    ref = run(x.float(), weight, cotangent, use_kernel=False)
    assert ours[0].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    # y and dx are rounded to bf16 once (relative 2^-8); dweight sums fp32 products of bf16 inputs.
    for a, b, name in zip(ours, ref, ("y", "dx", "dweight")):
        assert rel_err(a, b) < 1e-2, name


def test_reference_is_the_cpu_default():
    x, weight, _ = make_case(9, 2, 6, 3, torch.float32)
    assert torch.equal(causal_conv_silu(x, weight), causal_conv_silu_reference(x, weight))


@pytest.mark.parametrize("x_shape,w_shape,match", [
    ((8, 16), (16, 4), r"x must be sequence-first \[s, b, C\]"),
    ((8, 2, 16), (12, 4), r"weight must be \[C, K\] with C = 16"),
    ((8, 2, 16), (16, 4, 1), r"weight must be \[C, K\]"),
    ((8, 2, 16), (16, 9), r"kernel size K"),
])
def test_bad_shapes_are_refused(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        causal_conv_silu(torch.randn(x_shape), torch.randn(w_shape))


def test_group_refuses_a_missing_weight():
    with pytest.raises(ValueError, match="one weight per input: got 2 inputs and 1 weights"):
        causal_conv_silu_group([torch.randn(8, 2, 16)] * 2, [torch.randn(16, 4)])


def test_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match="weight fp32 or x's dtype"):
        causal_conv_silu(torch.randn(8, 2, 16).half(), torch.randn(16, 4).double())
    with pytest.raises(ValueError, match="x must be fp32/fp16/bf16"):
        causal_conv_silu(torch.randn(8, 2, 16).double(), torch.randn(16, 4))
