"""Fused AdamW step: the Triton kernel vs the PyTorch reference (CPU: Triton interpreter, fp32 with an fp16
model copy, in a subprocess started by ``test_cases_under_interpreter``; GPU: bf16 model copy), and the
reference vs ``torch.optim.AdamW``. A bf16 (or fp16) gradient must give exactly the update of its fp32 copy
(the kernel widens it in registers; Megatron's optimizer would have made that copy)."""

import pytest
import torch

import kimi_kernels.adamw
from kimi_kernels.adamw import adamw_multi_step_, adamw_step_, adamw_step_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)
HYPER = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def make_state(n, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randn(n, generator=gen).to(device)  # noqa: E731
    return dict(param=draw(), grad=draw(), exp_avg=0.1 * draw(), exp_avg_sq=0.01 * draw().abs(),
                step=torch.tensor(3.0, device=device))


def run(state, model_dtype, use_kernel, grad_scale, hyper=HYPER, grad_dtype=torch.float32):
    s = {k: v.clone() for k, v in state.items()}
    s["grad"] = s["grad"].to(grad_dtype)
    model = torch.empty_like(s["param"], dtype=model_dtype) if model_dtype is not None else None
    adamw_step_(s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s["step"], model, **hyper,
                grad_scale=grad_scale, use_kernel=use_kernel)
    return s, model


@interpreter_case
@pytest.mark.parametrize("n", [1, 2047, 2048, 5000])  # one element, a tile edge, two-and-a-half tiles
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_kernel_matches_reference(n, grad_scale):
    state = make_state(n, seed=n)
    ours, model = run(state, torch.float16, True, grad_scale)
    ref, model_ref = run(state, torch.float16, False, grad_scale)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)  # fp32 bias corrections
        assert not torch.equal(ours[key], state[key])  # it moved
    torch.testing.assert_close(model, ours["param"].half(), rtol=0, atol=0)  # its own fp32 result rounded once


def low_precision_grad_state(n, seed, grad_dtype, device="cpu"):
    """A state whose fp32 gradient holds exactly representable ``grad_dtype`` values (as a bf16 gradient
    widened into Megatron's fp32 main_grad would)."""
    state = make_state(n, seed=seed, device=device)
    state["grad"] = state["grad"].to(grad_dtype).float()
    return state


@interpreter_case
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_kernel_low_precision_grad_equals_its_fp32_copy(grad_dtype, grad_scale):
    state = low_precision_grad_state(2500, 11, grad_dtype)
    narrow, narrow_model = run(state, torch.float16, True, grad_scale, grad_dtype=grad_dtype)
    wide, wide_model = run(state, torch.float16, True, grad_scale)
    ref, _ = run(state, torch.float16, False, grad_scale, grad_dtype=grad_dtype)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(narrow[key], wide[key]), key  # widening is exact: the same fp32 maths
        torch.testing.assert_close(narrow[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.equal(narrow[key], state[key])
    assert torch.equal(narrow_model, wide_model)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_grad_equals_its_fp32_copy(grad_dtype):
    """The reference widens before scaling (a bf16 ``grad * scale`` would round the product to bf16)."""
    state = low_precision_grad_state(777, 12, grad_dtype)
    narrow, narrow_model = run(state, torch.bfloat16, False, 0.37, grad_dtype=grad_dtype)
    wide, wide_model = run(state, torch.bfloat16, False, 0.37)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(narrow[key], wide[key]), key
    assert torch.equal(narrow_model, wide_model)


@interpreter_case
def test_kernel_without_model_copy():
    state = make_state(300, seed=4)
    ours, _ = run(state, None, True, 1.0)
    ref, _ = run(state, None, False, 1.0)
    torch.testing.assert_close(ours["param"], ref["param"], rtol=1e-5, atol=1e-6)


MULTI_SIZES = (1, 1023, 1024, 2500, 7)  # one element, a tile edge either side, tiles and a tail, a small one


def multi_items(states, grad_dtype, model_dtype):
    """``adamw_multi_step_``'s items over clones of ``states``, with their model copies."""
    items = []
    for state in states:
        s = {k: v.clone() for k, v in state.items()}
        model = torch.empty_like(s["param"], dtype=model_dtype) if model_dtype is not None else None
        items.append((s["param"], s["grad"].to(grad_dtype), s["exp_avg"], s["exp_avg_sq"], s["step"], model))
    return items


@interpreter_case
@pytest.mark.parametrize("grad_dtype,model_dtype", [(torch.float32, torch.float16), (torch.float16, None)])
def test_multi_step_equals_one_launch_per_tensor(grad_dtype, model_dtype):
    """One launch over tensors of several sizes gives bit for bit each tensor's own kernel launch (the same
    update code), which matches the reference; each tensor got a different step count."""
    states = [make_state(n, seed=20 + i) for i, n in enumerate(MULTI_SIZES)]
    for i, state in enumerate(states):
        state["step"] = torch.tensor(float(i + 1))
    together = multi_items(states, grad_dtype, model_dtype)
    alone = multi_items(states, grad_dtype, model_dtype)
    reference = multi_items(states, grad_dtype, model_dtype)
    adamw_multi_step_(together, **HYPER, grad_scale=0.37, use_kernel=True)
    for item, ref in zip(alone, reference):
        adamw_step_(*item, **HYPER, grad_scale=0.37, use_kernel=True)
        adamw_step_reference(*ref, **HYPER, grad_scale=0.37)
    for t, a, r, state in zip(together, alone, reference, states):
        for j in (0, 2, 3) + ((5,) if model_dtype is not None else ()):
            assert torch.equal(t[j], a[j]), (t[0].numel(), j)
        torch.testing.assert_close(t[0], r[0], rtol=1e-5, atol=1e-6)
        assert not torch.equal(t[0], state["param"])


@interpreter_case
def test_multi_step_plan_is_reused_while_the_tensors_stay():
    """The second step over the same tensors reuses the launch plan and still reads their new values; a list
    with one tensor in new storage gets a plan of its own (the old one would write to the old storage)."""
    states = [make_state(n, seed=40 + i) for i, n in enumerate((5, 1500))]
    items = multi_items(states, torch.float32, torch.float16)
    mirror = multi_items(states, torch.float32, torch.float16)
    kimi_kernels.adamw._plans.clear()
    for scale in (1.0, 0.5):
        adamw_multi_step_(items, **HYPER, grad_scale=scale, use_kernel=True)
        for item in mirror:
            adamw_step_(*item, **HYPER, grad_scale=scale, use_kernel=True)
    assert len(kimi_kernels.adamw._plans) == 1
    for item, other in zip(items, mirror):
        assert torch.equal(item[0], other[0]) and torch.equal(item[5], other[5])
    moved = [tuple(t.clone() if t is not None else None for t in items[0])] + items[1:]
    adamw_multi_step_(moved, **HYPER, use_kernel=True)
    adamw_step_(*mirror[0], **HYPER, use_kernel=True)
    assert len(kimi_kernels.adamw._plans) == 2
    assert torch.equal(moved[0][0], mirror[0][0]) and not torch.equal(items[0][0], mirror[0][0])


def test_multi_step_refuses_mixed_dtypes():
    states = [make_state(n, seed=i) for i, n in enumerate((4, 6))]
    items = multi_items(states[:1], torch.float32, torch.bfloat16) + multi_items(states[1:], torch.bfloat16,
                                                                                  torch.bfloat16)
    with pytest.raises(ValueError, match="one device, gradient dtype and model dtype"):
        adamw_multi_step_(items, **HYPER, use_kernel=True)


@interpreter_case
@pytest.mark.parametrize("use_kernel", [True, False])
def test_grad_scale_in_a_tensor_equals_the_number(use_kernel):
    """A one-element fp32 tensor ``grad_scale`` (Megatron's grad norm left on the device) gives bit for bit the
    update of the same number, one tensor at a time and in one launch; a 0-d parameter keeps its shape."""
    states = [make_state(n, seed=60 + i) for i, n in enumerate((1500, 3))]
    number, in_tensor = 0.37, torch.tensor([0.37])
    for state in states:
        by_number = run(state, torch.float16, use_kernel, number)
        by_tensor = run(state, torch.float16, use_kernel, in_tensor)
        for a, b in zip(by_number, by_tensor):
            for key in ("param", "exp_avg", "exp_avg_sq") if isinstance(a, dict) else (None,):
                assert torch.equal(a[key], b[key]) if key else torch.equal(a, b), key
    together, alone = (multi_items(states, torch.float32, torch.float16) for _ in range(2))
    adamw_multi_step_(together, **HYPER, grad_scale=in_tensor, use_kernel=use_kernel)
    adamw_multi_step_(alone, **HYPER, grad_scale=number, use_kernel=use_kernel)
    for t, a in zip(together, alone):
        assert all(torch.equal(t[j], a[j]) for j in (0, 2, 3, 5))
    scalar = {k: v.reshape(()) if k != "step" else v for k, v in make_state(1, seed=70).items()}
    moved, _ = run(scalar, None, use_kernel, in_tensor)
    assert moved["param"].shape == () and not torch.equal(moved["param"], scalar["param"])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_reference_equals_torch_adamw(weight_decay):
    """Three steps from a fresh state, gradients scaled like clipping would, against torch.optim.AdamW."""
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(40, generator=gen)
    grads = [torch.randn(40, generator=gen) * s for s in (5.0, 0.2, 1.0)]
    scales = (0.25, 1.0, 0.6)
    hyper = dict(HYPER, weight_decay=weight_decay, eps=1e-3)  # a large eps makes the update scale-sensitive

    torch_param = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([torch_param], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                            eps=hyper["eps"], weight_decay=weight_decay)
    param, m, v, step = start.clone(), torch.zeros(40), torch.zeros(40), torch.zeros(())
    model = torch.empty(40, dtype=torch.bfloat16)
    for g, scale in zip(grads, scales):
        torch_param.grad = g * scale
        opt.step()
        step += 1
        adamw_step_reference(param, g, m, v, step, model, **hyper, grad_scale=scale)
    torch.testing.assert_close(param, torch_param.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, opt.state[torch_param]["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model, param.bfloat16(), rtol=0, atol=0)


def test_bad_inputs_are_refused():
    state = make_state(10)
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        adamw_step_(state["param"], state["grad"], state["exp_avg"][:5], state["exp_avg_sq"], state["step"], None,
                    **HYPER)
    with pytest.raises(ValueError, match="grad must be fp32, bf16 or fp16"):
        adamw_step_(state["param"], state["grad"].double(), state["exp_avg"], state["exp_avg_sq"], state["step"],
                    None, **HYPER)
    with pytest.raises(ValueError, match="exp_avg must be fp32"):
        adamw_step_(state["param"], state["grad"], state["exp_avg"].bfloat16(), state["exp_avg_sq"], state["step"],
                    None, **HYPER)
    for bad_scale in (torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.5, 0.5])):
        with pytest.raises(ValueError, match="a tensor grad_scale must be one fp32 element"):
            adamw_step_(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"], state["step"], None,
                        **HYPER, grad_scale=bad_scale)
    with pytest.raises(ValueError, match="step must be an fp32 scalar"):
        adamw_step_(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"], torch.tensor([1, 2]),
                    None, **HYPER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu_matches_reference():
    state = make_state(3_000_001, seed=9, device="cuda")
    ours, model = run(state, torch.bfloat16, True, 0.5)
    ref, model_ref = run(state, torch.bfloat16, False, 0.5)
    scale = torch.tensor([0.5], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a device grad_scale is read by the kernel, not by the host
    try:
        by_tensor, _ = run(state, torch.bfloat16, True, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(by_tensor[key], ours[key]), key
    for key in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
    assert (model.float() - model_ref.float()).abs().max() <= (model_ref.float().abs() * 2**-8).max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu_bf16_grad_equals_its_fp32_copy():
    """bf16 main grads: the kernel reading the bf16 gradient gives bit for bit the update of reading its fp32
    copy, and matches the reference."""
    state = low_precision_grad_state(3_000_001, 13, torch.bfloat16, device="cuda")
    narrow, narrow_model = run(state, torch.bfloat16, True, 0.5, grad_dtype=torch.bfloat16)
    wide, wide_model = run(state, torch.bfloat16, True, 0.5)
    ref, _ = run(state, torch.bfloat16, False, 0.5, grad_dtype=torch.bfloat16)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(narrow[key], wide[key]), key
        torch.testing.assert_close(narrow[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
    assert torch.equal(narrow_model, wide_model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_multi_step_on_gpu_equals_one_launch_per_tensor(grad_dtype):
    """bf16 model copies on the GPU: one launch over many tensors (the model's small ones: 2048-wide norms and
    queries, a 64 x 2048 router, odd sizes) matches the reference as one launch each does, and the two agree to
    fp32 rounding: the compiler vectorises and contracts the same update differently for the table's unaligned
    pointers (H200, 2026-12-01: bf16 gradients gave exp_avg_sq 1 ulp apart in 20% of elements, fp32 none)."""
    sizes = (2048, 2048, 64 * 2048, 1, 3001, 1024)
    states = [low_precision_grad_state(n, 60 + i, torch.bfloat16, device="cuda") for i, n in enumerate(sizes)]
    together = multi_items(states, grad_dtype, torch.bfloat16)
    alone = multi_items(states, grad_dtype, torch.bfloat16)
    reference = multi_items(states, grad_dtype, torch.bfloat16)
    adamw_multi_step_(together, **HYPER, grad_scale=0.5)
    for item, ref in zip(alone, reference):
        adamw_step_(*item, **HYPER, grad_scale=0.5)
        adamw_step_reference(*ref, **HYPER, grad_scale=0.5)
    for t, a, r, state in zip(together, alone, reference, states):
        for j in (0, 2, 3):
            torch.testing.assert_close(t[j], r[j], rtol=1e-5, atol=1e-6)  # as test_kernel_on_gpu_matches_reference
            torch.testing.assert_close(t[j], a[j], rtol=1e-6, atol=1e-7)
        assert not torch.equal(t[0], state["param"])
        assert ((t[5].float() - a[5].float()).abs() <= a[5].float().abs() * 2**-8).all()  # one bf16 ulp at most
