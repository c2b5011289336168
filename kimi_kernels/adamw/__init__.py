"""AdamW steps fused with gradient clipping and the master-to-model copy.

Entry points: :func:`adamw_step_` (one tensor) and :func:`adamw_multi_step_` (a list of tensors in one
launch): the Triton kernels (``fused.py``) for CUDA tensors, the PyTorch reference (``naive.py``) otherwise.
Same update as ``torch.optim.AdamW`` (amsgrad and maximize off); the caller increments ``step`` first
(torch's fused AdamW keeps it as an fp32 device scalar). Used by
:func:`megatron_ext.speed_patches.use_fused_adamw_step` inside Megatron's mixed-precision optimizer.
"""

from collections import OrderedDict

import torch

from kimi_kernels.adamw.naive import adamw_step_reference

__all__ = ["adamw_step_", "adamw_multi_step_", "adamw_step_reference", "GRAD_DTYPES"]

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Multi-step plans kept per process: one per (param group, gradient dtype, model dtype) the optimizer steps.
PLAN_CACHE_SIZE = 32
_plans: "OrderedDict[tuple, object]" = OrderedDict()


def _check(param, grad, exp_avg, exp_avg_sq, step, model_param) -> None:
    tensors = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if model_param is not None:
        tensors["model_param"] = model_param
    for name, t in {"param": param, **tensors}.items():
        if t.shape != param.shape or not t.is_contiguous() or t.device != param.device:
            raise ValueError(f"{name} must be contiguous with param's shape {tuple(param.shape)} on {param.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
        if name == "grad" and t.dtype not in GRAD_DTYPES:
            raise ValueError(f"grad must be fp32, bf16 or fp16, got {t.dtype}")
        if name not in ("grad", "model_param") and t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32, got {t.dtype}")
    if step.dtype != torch.float32 or step.numel() != 1 or step.device != param.device:
        raise ValueError(f"step must be an fp32 scalar tensor on {param.device}, got {step.dtype} "
                         f"{tuple(step.shape)} on {step.device}")


def _check_betas(beta1, beta2) -> None:
    if not (0.0 < beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise ValueError(f"betas must be in (0, 1), got ({beta1}, {beta2})")


def _check_grad_scale(grad_scale, device) -> None:
    if isinstance(grad_scale, torch.Tensor) and (
            grad_scale.dtype != torch.float32 or grad_scale.numel() != 1 or grad_scale.device != device):
        raise ValueError(f"a tensor grad_scale must be one fp32 element on {device}, got {grad_scale.dtype} "
                         f"{tuple(grad_scale.shape)} on {grad_scale.device}")


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: torch.Tensor, model_param: torch.Tensor | None, *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, grad_scale: float | torch.Tensor = 1.0,
                use_kernel: bool | None = None) -> None:
    """Update ``param``, ``exp_avg``, ``exp_avg_sq`` (fp32, contiguous, same shape) in place from ``grad``
    (fp32, or bf16/fp16: widened to fp32 in the kernel, so a bf16 gradient gives the update of its exact fp32
    copy while moving 2 bytes per element less) times ``grad_scale`` (a number, or a one-element fp32 tensor on
    ``param``'s device that the kernel reads: no host sync), and write the result into ``model_param`` (same
    shape, any float dtype) when given. ``use_kernel`` defaults to ``param.is_cuda``."""
    _check(param, grad, exp_avg, exp_avg_sq, step, model_param)
    _check_betas(beta1, beta2)
    _check_grad_scale(grad_scale, param.device)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    if param.is_cuda if use_kernel is None else use_kernel:
        from kimi_kernels.adamw.fused import adamw_step

        adamw_step(param, grad, exp_avg, exp_avg_sq, step, model_param, **kw)
    else:
        adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, model_param, **kw)


def adamw_multi_step_(items: list, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      grad_scale: float | torch.Tensor = 1.0, use_kernel: bool | None = None) -> None:
    """:func:`adamw_step_` for every ``(param, grad, exp_avg, exp_avg_sq, step, model_param)`` of ``items`` in
    one kernel launch. The items share one device, one gradient dtype and either all have a model copy (of one
    dtype) or none. The launch plan (a device table of the tensors' addresses) is built and checked the first
    time a list is seen and reused while every tensor keeps its storage."""
    if not items:
        return
    _check_betas(beta1, beta2)
    _check_grad_scale(grad_scale, items[0][0].device)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    if not (items[0][0].is_cuda if use_kernel is None else use_kernel):
        for item in items:
            _check(*item)
            adamw_step_reference(*item, **kw)
        return
    from kimi_kernels.adamw import fused

    key = fused.multi_step_key(items)
    plan = _plans.get(key)
    if plan is None:
        for item in items:
            _check(*item)
        kinds = {(grad.dtype, None if model is None else model.dtype, param.device)
                 for param, grad, _, _, _, model in items}
        if len(kinds) > 1:
            raise ValueError("adamw_multi_step_ needs one device, gradient dtype and model dtype, got "
                             f"{sorted(map(str, kinds))}")
        plan = _plans[key] = fused.MultiStepPlan(items)
        while len(_plans) > PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    fused.adamw_multi_step(plan, **kw)
