"""Fused AdamW step: the Triton kernel vs the PyTorch reference (CPU: Triton interpreter, fp32 with an fp16
model copy, in a subprocess started by ``test_cases_under_interpreter``; GPU: bf16 model copy), and the
reference vs ``torch.optim.AdamW``."""

import pytest
import torch

from kernels.adamw import adamw_step_, adamw_step_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)
HYPER = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def make_state(n, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randn(n, generator=gen).to(device)  # noqa: E731
    return dict(param=draw(), grad=draw(), exp_avg=0.1 * draw(), exp_avg_sq=0.01 * draw().abs(),
                step=torch.tensor(3.0, device=device))


def run(state, model_dtype, use_kernel, grad_scale, hyper=HYPER):
    s = {k: v.clone() for k, v in state.items()}
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


@interpreter_case
def test_kernel_without_model_copy():
    state = make_state(300, seed=4)
    ours, _ = run(state, None, True, 1.0)
    ref, _ = run(state, None, False, 1.0)
    torch.testing.assert_close(ours["param"], ref["param"], rtol=1e-5, atol=1e-6)


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
    with pytest.raises(ValueError, match="grad must be fp32"):
        adamw_step_(state["param"], state["grad"].half(), state["exp_avg"], state["exp_avg_sq"], state["step"],
                    None, **HYPER)
    with pytest.raises(ValueError, match="step must be an fp32 scalar"):
        adamw_step_(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"], torch.tensor([1, 2]),
                    None, **HYPER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu_matches_reference():
    state = make_state(3_000_001, seed=9, device="cuda")
    ours, model = run(state, torch.bfloat16, True, 0.5)
    ref, model_ref = run(state, torch.bfloat16, False, 0.5)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
    assert (model.float() - model_ref.float()).abs().max() <= (model_ref.float().abs() * 2**-8).max()
