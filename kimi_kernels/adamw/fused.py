"""Triton AdamW step: one pass reads the fp32 master weight, its gradient (fp32, or bf16/fp16 widened to fp32
in registers) and both moments, and writes the weight, the moments and the bf16/fp16 model copy the forward
reads.

Megatron's step without Apex/TE makes three passes for the same update: the clip scaling of the
gradients, the optimizer kernel, and the master-to-model copy (42 bytes per parameter against 30 here).
The clip coefficient comes in as ``grad_scale``: a number, or a one-element fp32 device tensor read by the
kernel (Megatron's grad norm left on the device: no host sync between the norm and the update); the bias
corrections are computed from the device-side step count, so nothing is read back to the host.

Two launchers share the update (:func:`_update`): :func:`adamw_step` for one tensor (a large one: the
compiler sees its pointers' 16-byte alignment and vectorises), and :func:`adamw_multi_step` for a list of
tensors in one launch, each program finding its tensor and offset in a table of pointers built once and kept
on the device (:class:`MultiStepPlan`). The list form is for the many small tensors (norm weights, AttnRes
pseudo-queries, routers, KDA's gates): one launch each costs the host more than the GPU work they carry.
"""

import torch
import triton
import triton.language as tl

# Elements per program: 4 warps, 8 per thread, vectorised 16-byte accesses. Swept on one H200
# (2026-12-01, .ab-style one-off, 268M/134M/4M elements): 1024 x 4 warps ran at 4.03/3.92/1.99 TB/s
# (30 bytes per element, fp32 gradient), 2048 x 4 at 3.93/3.85/1.94, 8192 x 8 at 3.33/3.27/1.81; a plain
# fp32 copy reached 4.04/3.93 TB/s. A bf16 gradient makes it 28 bytes per element (not swept separately).
BLOCK = 1024
NUM_WARPS = 4
# The multi-tensor table's row: the pointers of param, grad, exp_avg, exp_avg_sq, step, model_param, then numel.
TABLE_COLUMNS = 7


@triton.jit
def _update(param, grad, exp_avg, exp_avg_sq, step, model_param, offs, ok, lr, beta1, beta2, eps, weight_decay,
            grad_scale, HAS_MODEL: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr):
    p = tl.load(param + offs, mask=ok)
    scale = tl.load(grad_scale) if SCALE_IN_MEMORY else grad_scale
    g = tl.load(grad + offs, mask=ok).to(tl.float32) * scale  # exact widening: as an fp32 copy
    m = tl.load(exp_avg + offs, mask=ok)
    v = tl.load(exp_avg_sq + offs, mask=ok)
    t = tl.load(step)
    bias_correction1 = 1.0 - tl.exp(t * tl.log(beta1))
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.log(beta2)))
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)  # lerp, as torch computes it
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * (m / denom)
    tl.store(param + offs, p, mask=ok)
    tl.store(exp_avg + offs, m, mask=ok)
    tl.store(exp_avg_sq + offs, v, mask=ok)
    if HAS_MODEL:
        tl.store(model_param + offs, p.to(model_param.dtype.element_ty), mask=ok)


@triton.jit
def adamw_step_kernel(param, grad, exp_avg, exp_avg_sq, step, model_param, n, lr, beta1, beta2, eps,
                      weight_decay, grad_scale, HAS_MODEL: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _update(param, grad, exp_avg, exp_avg_sq, step, model_param, offs, offs < n, lr, beta1, beta2, eps,
            weight_decay, grad_scale, HAS_MODEL, SCALE_IN_MEMORY)


@triton.jit
def adamw_multi_step_kernel(table, block_tensor, block_start, lr, beta1, beta2, eps, weight_decay, grad_scale,
                            GRAD_DTYPE: tl.constexpr, MODEL_DTYPE: tl.constexpr, HAS_MODEL: tl.constexpr,
                            SCALE_IN_MEMORY: tl.constexpr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = table + tl.load(block_tensor + pid).to(tl.int64) * COLUMNS
    start = tl.load(block_start + pid)
    param = tl.load(row).to(tl.pointer_type(tl.float32))
    grad = tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE))
    exp_avg = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    step = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    model_param = tl.load(row + 5).to(tl.pointer_type(MODEL_DTYPE))
    offs = start + tl.arange(0, BLOCK)
    _update(param, grad, exp_avg, exp_avg_sq, step, model_param, offs, offs < tl.load(row + 6), lr, beta1, beta2,
            eps, weight_decay, grad_scale, HAS_MODEL, SCALE_IN_MEMORY)


def _scalars(lr, beta1, beta2, eps, weight_decay, grad_scale):
    """The kernels' scalar arguments; a tensor ``grad_scale`` goes as its pointer (``SCALE_IN_MEMORY``)."""
    scale = grad_scale if isinstance(grad_scale, torch.Tensor) else float(grad_scale)
    return float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), scale


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, model_param, *, lr, beta1, beta2, eps, weight_decay,
               grad_scale=1.0):
    n = param.numel()
    adamw_step_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, step, model_param if model_param is not None else param, n,
        *_scalars(lr, beta1, beta2, eps, weight_decay, grad_scale),
        HAS_MODEL=model_param is not None, SCALE_IN_MEMORY=isinstance(grad_scale, torch.Tensor), BLOCK=BLOCK,
        num_warps=NUM_WARPS)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class MultiStepPlan:
    """The device tables of one list of tensors: a row of pointers and the numel per tensor, and per program
    its tensor and first element. Valid for as long as the tensors keep their storage (the key says which)."""

    def __init__(self, items):
        device = items[0][0].device
        rows, block_tensor, block_start = [], [], []
        for i, (param, grad, exp_avg, exp_avg_sq, step, model_param) in enumerate(items):
            model_ptr = model_param.data_ptr() if model_param is not None else 0
            rows.append([param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                         step.data_ptr(), model_ptr, param.numel()])
            starts = range(0, param.numel(), BLOCK)
            block_tensor.extend([i] * len(starts))
            block_start.extend(starts)
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self.block_tensor = torch.tensor(block_tensor, dtype=torch.int32).to(device)
        self.block_start = torch.tensor(block_start, dtype=torch.int64).to(device)
        first = items[0]
        self.grad_dtype = _TL_DTYPES[first[1].dtype]
        self.model_dtype = _TL_DTYPES[first[5].dtype] if first[5] is not None else tl.float32
        self.has_model = first[5] is not None


def multi_step_key(items) -> tuple:
    """What a plan depends on: every tensor's address, and each parameter's size and dtypes."""
    return tuple((param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), step.data_ptr(),
                  model_param.data_ptr() if model_param is not None else 0, param.numel(), grad.dtype,
                  model_param.dtype if model_param is not None else None)
                 for param, grad, exp_avg, exp_avg_sq, step, model_param in items)


def adamw_multi_step(plan: MultiStepPlan, *, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0):
    adamw_multi_step_kernel[(plan.block_start.numel(),)](
        plan.table, plan.block_tensor, plan.block_start, *_scalars(lr, beta1, beta2, eps, weight_decay, grad_scale),
        GRAD_DTYPE=plan.grad_dtype, MODEL_DTYPE=plan.model_dtype, HAS_MODEL=plan.has_model,
        SCALE_IN_MEMORY=isinstance(grad_scale, torch.Tensor), COLUMNS=TABLE_COLUMNS, BLOCK=BLOCK,
        num_warps=NUM_WARPS)
