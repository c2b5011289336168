"""PyTorch reference of one fused AdamW step (the maths of ``torch.optim.AdamW``, fp32)."""

import torch


@torch.no_grad()
def adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, model_param, *, lr, beta1, beta2, eps,
                         weight_decay, grad_scale=1.0):
    """In place, ``step`` already incremented (fp32 scalar tensor, as torch's fused AdamW keeps it):
    ``g = grad * grad_scale`` in fp32 (a bf16/fp16 ``grad`` is widened first, exactly); decoupled decay;
    moments; bias-corrected update; ``model_param`` (the low-precision copy the forward reads, or ``None``)
    gets the new value rounded once. ``grad_scale``: a number or a one-element tensor."""
    if isinstance(grad_scale, torch.Tensor):
        grad_scale = grad_scale.reshape(())  # a [1] norm would widen a 0-d parameter's update
    g = grad.float() * grad_scale
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    t = float(step)
    bias_correction1 = 1 - beta1**t
    bias_correction2_sqrt = (1 - beta2**t) ** 0.5
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if model_param is not None:
        model_param.copy_(param)
