"""use_fused_adamw_step: Megatron's mixed-precision optimizer stepping with kimi_kernels.adamw (AdamW + the clip
coefficient + the bf16 model copy in one pass) gives the update of Megatron's own three-pass step; with bf16
main grads (read in place, no fp32 copy) the same update and grad norm as fp32 main grads of the same values."""

import subprocess
import sys

import pytest
import torch

from tests._dist import free_port

SCRIPT = """
import sys
import torch, torch.distributed as dist
from megatron_ext import cpu_compat, speed_patches
assert cpu_compat.install()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

GRAD_SCALES = (30.0, 0.01, 3.0)  # clipping on, off, on: Adam's update depends on it through eps and history

def build(fused, clip):
    g = torch.Generator().manual_seed(0)
    bf16 = [torch.nn.Parameter(torch.randn(*s, generator=g).bfloat16()) for s in ((33, 7), (5,), (4, 4, 9))]
    fp32 = torch.nn.Parameter(torch.randn(6, generator=g))  # kept fp32 in the model (like A_log)
    groups = [dict(params=bf16[:2] + [fp32], weight_decay=0.1, wd_mult=1.0),  # wd_mult: how Megatron matches
              dict(params=bf16[2:], weight_decay=0.0, wd_mult=0.0)]       # groups on load
    inner = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-3)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=clip, params_dtype=torch.float32)
    opt = Float16OptimizerWithFloat16Params(inner, config, None, lambda *a, **k: None)
    if fused:
        assert speed_patches.use_fused_adamw_step(opt) == 1
        speed_patches.scoped_fast_fallbacks(opt)
    return bf16 + [fp32], opt

def train(fused, clip, grads="fp32", norms=None):
    # grads: "fp32" main grads, "bf16" ones for the bf16 params (bf16 main grads), or "fp32_of_bf16": fp32 main
    # grads holding exactly those bf16 values (what an fp32 buffer holds after one bf16 gradient).
    params, opt = build(fused, clip)
    g = torch.Generator().manual_seed(1)
    for scale in GRAD_SCALES:
        for p in params:
            p.main_grad = torch.randn(p.shape, generator=g) * scale
            if grads != "fp32" and p.dtype == torch.bfloat16:
                p.main_grad = p.main_grad.bfloat16()
                if grads == "fp32_of_bf16":
                    p.main_grad = p.main_grad.float()
        ok, norm, _ = opt.step()
        assert ok and (norm > 0 or clip == 0)  # Megatron reports no norm when not clipping
        # the fused step's norm stays on the device (no host read); Megatron's own path reads it
        assert isinstance(norm, torch.Tensor) == (fused and clip > 0), type(norm)
        if norms is not None:
            norms.append(norm)
        if grads == "bf16" and fused:  # read in place: no fp32 copy on the main params
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model, main in zip(models, mains):
                    assert main.grad is None and model.grad is model.main_grad
    masters = [m.detach().clone() for group in opt.fp32_from_float16_groups for m in group]
    return [p.detach().clone() for p in params], masters, opt

stock, stock_masters, _ = train(False, 1.0)
fused, fused_masters, opt = train(True, 1.0)
unclipped, _, _ = train(False, 0.0)
start, _ = build(False, 1.0)
for a, b, c, s in zip(fused, stock, unclipped, start):
    assert a.dtype == b.dtype and (a.float() - s.float()).abs().max() > 1e-3  # it moved
    tol = dict(rtol=1e-5, atol=1e-6) if a.dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(a, b, **tol)
    assert (b.float() - c.float()).abs().max() > 1e-3  # this test would notice a step that skipped the clip
for a, b in zip(fused_masters, stock_masters):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
for p, m in zip(fused, fused_masters):  # the model copy is written by the same kernel
    assert torch.equal(p, m.to(p.dtype))
for group in opt.optimizer.param_groups:
    for p in group["params"]:
        assert float(opt.optimizer.state[p]["step"]) == len(GRAD_SCALES)
try:
    speed_patches.use_fused_adamw_step(opt)
    raise SystemExit("switching after a step must fail")
except ValueError as err:
    assert "before the optimizer's first step" in str(err)
# bf16 main grads (wrap_ddp(main_grad_dtype="bf16")): the fused step and the grad norm read them in place and
# give bit for bit the update and norm of fp32 main grads holding the same values; Megatron's own step (it
# copies them to fp32) too.
for fused_step in (True, False):
    norms_wide, norms_narrow = [], []
    wide, wide_masters, _ = train(fused_step, 1.0, "fp32_of_bf16", norms_wide)
    narrow, narrow_masters, _ = train(fused_step, 1.0, "bf16", norms_narrow)
    assert norms_wide == norms_narrow, (norms_wide, norms_narrow)
    for a, b in zip(wide + wide_masters, narrow + narrow_masters):
        assert torch.equal(a, b), "bf16 main grads changed the update"
# Resume: two steps, Megatron's state_dict into a fresh fused optimizer, one more step == three steps.
def grads_for(params, step, bf16_grads):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.main_grad = torch.randn(p.shape, generator=g) * GRAD_SCALES[step]
        if bf16_grads and p.dtype == torch.bfloat16:
            p.main_grad = p.main_grad.bfloat16()

for bf16_grads in (False, True):  # the optimizer state is the same either way
    through, through_opt = build(True, 1.0)
    for step in range(3):
        grads_for(through, step, bf16_grads)
        through_opt.step()
    first, first_opt = build(True, 1.0)
    for step in range(2):
        grads_for(first, step, bf16_grads)
        first_opt.step()
        first_opt.zero_grad()
    state = first_opt.state_dict()
    resumed, resumed_opt = build(True, 1.0)
    with torch.no_grad():
        for dst, src in zip(resumed, first):
            dst.copy_(src)
    resumed_opt.load_state_dict(state)
    grads_for(resumed, 2, bf16_grads)
    resumed_opt.step()
    for a, b in zip(resumed, through):
        assert torch.equal(a, b), "resume changed the update"
# Under the NaN guard the update's host work runs before the guard's one host read (the device then has only
# launches to wait for), and a skipped step (a NaN gradient) leaves nothing prepared behind for the next:
# apply, skip, apply gives bit for bit the update of apply, apply.
from megatron_ext.training.nonfinite_guard import NonFiniteGuard

def guarded(grad_sets):
    params, opt = build(True, 1.0)
    guard, events, applied = NonFiniteGuard(opt), [], []
    prepare = opt.prepare_step_with_ready_grads
    opt.prepare_step_with_ready_grads = lambda: (events.append("prepare"), prepare())
    tolist = torch.Tensor.tolist
    def read(t):  # the guard's read (through the CPU shim's torch-function mode it comes back here once more)
        if sys._getframe(1).f_code.co_filename.endswith("nonfinite_guard.py"):
            events.append("read")
        return tolist(t)
    torch.Tensor.tolist = read
    try:
        for grads in grad_sets:
            for p, grad in zip(params, grads):
                p.main_grad = grad.clone()
            applied.append(guard.step(torch.tensor(2.5))[0])
    finally:
        torch.Tensor.tolist = tolist
    return params, opt, applied, events

g = torch.Generator().manual_seed(7)
sets = [[torch.randn(p.shape, generator=g) * scale for p in build(False, 1.0)[0]] for scale in GRAD_SCALES]
poisoned = [grad.clone() for grad in sets[1]]
poisoned[1][0] = float("nan")
skipping, skipping_opt, applied, events = guarded([sets[0], poisoned, sets[2]])
assert applied == [True, False, True], applied
assert events == ["prepare", "read"] * 3, events
straight, straight_opt, _, _ = guarded([sets[0], sets[2]])
plain, plain_opt = build(True, 1.0)  # no guard: the step prepares its own host work
for grads in (sets[0], sets[2]):
    for p, grad in zip(plain, grads):
        p.main_grad = grad.clone()
    plain_opt.step()
for a, b, c in zip(skipping, straight, plain):
    assert torch.equal(a, b), "a skipped step changed the next update"
    assert torch.equal(b, c), "the prepared update differs from the unprepared one (clip coefficients?)"
for group in skipping_opt.optimizer.param_groups:
    for p in group["params"]:
        assert float(skipping_opt.optimizer.state[p]["step"]) == 2
# Megatron's own clip is back outside the scoped step and still scales whatever it is given.
from megatron.core.optimizer import optimizer as mcore_optimizer
assert mcore_optimizer.clip_grad_by_total_norm_fp32.__module__ == "megatron.core.optimizer.clip_grads"
print("ok")
"""


def test_fused_step_equals_megatrons_clip_adamw_and_copy():
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(port=free_port())], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


GPU_SCRIPT = """
import torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron_ext import speed_patches

g = torch.Generator().manual_seed(0)
# a large tensor (its own launch) and small ones (one launch per list)
params = [torch.nn.Parameter(torch.randn(*s, generator=g).bfloat16().cuda()) for s in ((4096, 1024), (33, 7), (5,))]
inner = torch.optim.AdamW([dict(params=params, weight_decay=0.1, wd_mult=1.0)], lr=1e-2, betas=(0.9, 0.95))
config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=0.5, params_dtype=torch.float32)
opt = Float16OptimizerWithFloat16Params(inner, config, None, lambda *a, **k: None)
assert speed_patches.use_fused_adamw_step(opt) == 1
speed_patches.scoped_fast_fallbacks(opt)
for p in params:  # DDP's gradient buffer: the same storage every step (the multi-tensor plan is keyed on it)
    p.main_grad = torch.empty_like(p)
for step in range(3):
    for p in params:
        p.main_grad.copy_((torch.randn(p.shape, generator=g) * 10).bfloat16())
    before = [p.detach().clone() for p in params]
    torch.cuda.synchronize()
    # the first step builds the multi-tensor plan (a host -> device table); later ones must not read the device
    torch.cuda.set_sync_debug_mode("error" if step else "default")
    try:
        ok, norm, _ = opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ok and isinstance(norm, torch.Tensor) and norm.is_cuda and float(norm) > 0.5, norm  # clipped
    assert all(not torch.equal(a, p) for a, p in zip(before, params))
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_step_on_gpu_makes_no_host_sync():
    """The whole ``optimizer.step()`` (grad norm, clip coefficient, AdamW launches) without reading the device:
    the norm is returned as a device tensor and the kernels read the clip coefficient themselves."""
    result = subprocess.run([sys.executable, "-c", GPU_SCRIPT.format(port=free_port())], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
