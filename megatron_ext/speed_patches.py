"""The GPU-speed patches to Megatron-Core we opt into (the CPU ones are ``megatron_ext/cpu_compat.py``).

Opted into, not installed: :func:`scoped_fast_fallbacks` wraps *our* optimizer's ``step``
(``megatron_ext.parallel.build_optimizer``) so that, inside it only, Megatron's no-Apex stand-ins for Apex's
multi-tensor kernels are replaced by torch's foreach ops: ``local_multi_tensor_l2_norm`` (per-tensor norms
gathered with ``torch.tensor(list)``: one host sync per parameter tensor) and ``local_multi_tensor_scale``
(``dst.copy_(src * scale)``: an fp32 temporary per tensor when clipping), and the grad norm stays on the
device (Megatron's own path when Transformer Engine's tensor-scale kernel exists: ``step`` returns the norm as
a one-element tensor and nothing in the step reads the device). Same values (``tests/test_cpu_compat.py``,
``tests/parallel/test_fused_adamw_step.py``); stock Megatron optimizers built elsewhere in the process keep
Megatron's own path; with Apex or Transformer Engine present it does nothing.

:func:`use_fused_adamw_step` goes further for Megatron's mixed-precision (non-distributed) optimizer: its
``step_with_ready_grads`` runs ``kimi_kernels.adamw`` (one pass per tensor: AdamW, the clip coefficient and the
fp32-to-bf16 model copy; Megatron makes three; the small tensors one launch per list), and inside the scoped
step Megatron's ``clip_grad_by_total_norm_fp32`` hands those optimizers' coefficient to that kernel instead of
scaling the gradients in a pass of its own. Same update as torch's AdamW after Megatron's clipping (tested). The
step's host work (which tensors, their state, the launch lists) can run ahead of the update: the optimizer's
``prepare_step_with_ready_grads``, which the NaN guard calls before its host read (tested: same update). When DDP's
``main_grad`` has the model parameter's own dtype (bf16 main grads: ``wrap_ddp(main_grad_dtype="bf16")``,
Megatron's ``grad_reduce_in_fp32=False``), Megatron's ``_copy_model_grads_to_main_grads`` would make an fp32
copy of every gradient (``main_grad.float()``); these optimizers instead point the model parameter's ``.grad``
at its bf16 ``main_grad`` (no copy), the grad norm reads it there (foreach norm accumulating in fp32) and the
AdamW kernel reads it as its gradient (widened in registers). Same update as the fp32 ``main_grad`` holding
the same values (tested bit for bit).

:func:`use_fresh_main_grads` changes Megatron DDP's gradient buffer for the first backward of a step: the
first gradient of each parameter is copied into ``main_grad`` (6 bytes per parameter for a bf16 gradient into
an fp32 buffer, 4 into a bf16 one) instead of zero-filling the whole buffer and adding into it (14; 8 in bf16); later micro-batches add as before, and a
parameter that got no gradient is zeroed before the grads are reduced (tested: identical grads).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Megatron's ``l2_norm_impl`` contract: ``([1] fp32 total L2 norm, None)``; no host sync. bf16/fp16
    tensors (bf16 main grads) are summed in fp32 and give fp32 per-tensor norms, as their fp32 copies would."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    # One foreach call per dtype: a list mixing dtypes (bf16 main grads beside fp32 ones such as KDA's A_log)
    # takes the per-tensor fallback on CUDA (163 norm launches a step in ours_full_16k's profile).
    positions: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        positions.setdefault(t.dtype, []).append(i)
    norms: list = [None] * len(tensors)
    for dtype, where in positions.items():
        group = [tensors[i] for i in where]
        group_norms = (torch._foreach_norm(group) if dtype == torch.float32
                       else torch._foreach_norm(group, 2, dtype=torch.float32))
        for i, norm in zip(where, group_norms):
            norms[i] = norm
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Megatron's ``multi_tensor_scale_impl`` contract: ``dst = src * scale``; in place when ``dst is src``.
    Also its ``multi_tensor_scale_tensor_impl``: ``scale`` a one-element device tensor, read on the device."""
    src, dst = tensor_lists
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(())  # foreach ops take a 0-d tensor as their scalar
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


# id -> main param of the optimizers on the fused AdamW step (weak: models built and freed in one process,
# as the benchmarks do, must not stay alive through this table)
_fused_main_params: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_pending_clip: dict[int, "float | torch.Tensor"] = {}  # id(main param) -> clip coefficient of the step under way


def _clip_coefficient(max_norm, total_norm):
    """Megatron's ``min(max_norm / (total_norm + 1e-6), 1)``: a number for a number, a one-element fp32 tensor
    on the norm's device for a norm left there (no host sync)."""
    if isinstance(total_norm, torch.Tensor):
        return (float(max_norm) / (total_norm.float().reshape(1) + 1.0e-6)).clamp_max_(1.0)
    return min(float(max_norm) / (float(total_norm) + 1.0e-6), 1.0)


def _clip_into_fused_step(original):
    """Megatron's ``clip_grad_by_total_norm_fp32`` with the fused optimizers' parameters left unscaled: their
    coefficient (Megatron's ``max_norm / (total_norm + 1e-6)``, applied when below 1) goes to the AdamW
    kernel as its gradient scale."""

    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not use_decoupled_grad:
            coeff = _clip_coefficient(max_norm, total_norm)
            others = []
            for p in params:
                if _fused_main_params.get(id(p)) is p:
                    _pending_clip[id(p)] = coeff
                else:
                    others.append(p)
            params = others
        if params:
            original(params, max_norm, total_norm, use_decoupled_grad=use_decoupled_grad)

    return clip


def use_fused_adamw_step(optimizer) -> int:
    """Put every ``Float16OptimizerWithFloat16Params`` (Megatron's mixed-precision, non-distributed optimizer)
    over a torch ``AdamW`` (no amsgrad/maximize) inside ``optimizer`` (chained or not) on the fused step of
    ``kimi_kernels.adamw``; the others keep theirs. Must run before the first step; returns how many switched.
    The optimizer state stays torch's (``step``, ``exp_avg``, ``exp_avg_sq`` per main param), so
    checkpoints are unchanged. Takes effect with :func:`scoped_fast_fallbacks` around ``step``."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    switched, prepares = 0, []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if type(opt) is not Float16OptimizerWithFloat16Params or getattr(opt, "is_stub_optimizer", False):
            continue
        if type(inner) is not torch.optim.AdamW or any(g["amsgrad"] or g["maximize"] for g in inner.param_groups):
            continue
        if inner.state:
            raise ValueError("use_fused_adamw_step must run before the optimizer's first step")
        model_of = {id(main): model for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                    for model, main in zip(models, mains)}
        for group in inner.param_groups:
            _fused_main_params.update({id(p): p for p in group["params"]})
        opt.step_with_ready_grads = lambda opt=opt, model_of=model_of: _fused_adamw_step(opt, model_of)
        prepares.append(functools.partial(_stash_prepared_step, opt, model_of))
        # bf16 main grads read in place, unless something reads the main params' .grad: Megatron's zero count,
        # or a grad scaler's unscale and inf check.
        if not opt.config.log_num_zeros_in_grad and opt.grad_scaler is None:
            opt._copy_model_grads_to_main_grads = lambda opt=opt: _copy_model_grads_without_widening(opt)
            opt._filter_grads_for_norm = _grads_for_norm_via_model_params(opt._filter_grads_for_norm, model_of)
        switched += 1
    if prepares:
        # For the NaN guard (megatron_ext/training/nonfinite_guard.py): this step's host work before its host
        # read, so that the device does not wait for it after the read.
        optimizer.prepare_step_with_ready_grads = lambda: [prepare() for prepare in prepares]
    return switched


def _stash_prepared_step(opt, model_of: dict) -> None:
    _prepared[id(opt)] = _prepare_fused_step(opt, model_of)


def _is_low_precision_grad(grad, model_param) -> bool:
    return grad is not None and grad.dtype == model_param.dtype and grad.dtype != torch.float32


def _copy_model_grads_without_widening(opt) -> None:
    """Megatron's ``_copy_model_grads_to_main_grads`` for an optimizer on the fused step: a gradient in the model
    parameter's own dtype (a bf16 ``main_grad``, or a bf16 ``.grad`` without DDP) stays where it is, as the
    model parameter's ``.grad`` (a view: no copy), and the main parameter's ``.grad`` is ``None``; the fused step
    and the grad norm find it through the model parameter (:func:`_main_grad_of`). Any other gradient goes to
    the main parameter as Megatron puts it (``.float()``: no copy for an fp32 ``main_grad``). Like Megatron's
    own fp32 parameters' ``.grad``, the view lives until the optimizer's ``zero_grad``."""
    for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        for model, main in zip(models, mains):
            grad = model.main_grad if hasattr(model, "main_grad") else model.grad
            if _is_low_precision_grad(grad, model):
                model.grad, main.grad = grad, None
            else:
                main.grad = None if grad is None else grad.float()
                model.grad = None
    for models in opt.fp32_from_fp32_groups:
        for model in models:
            model.grad = model.main_grad


def _main_grad_of(main, model):
    """The gradient the fused step applies to ``main``: its ``.grad``, or its model parameter's low-precision
    ``.grad`` left there by :func:`_copy_model_grads_without_widening`; ``None`` when it got none."""
    if main.grad is not None or model is None:
        return main.grad
    return model.grad if _is_low_precision_grad(model.grad, model) else None


def _grads_for_norm_via_model_params(filter_grads, model_of: dict):
    """Megatron's ``_filter_grads_for_norm`` with each main parameter whose gradient stayed on its model parameter
    represented by that model parameter: it carries the same attributes the filter reads (shared, tensor- and
    expert-parallel duplicates, grad-norm group), and its ``.grad`` is the bf16 gradient."""

    def filter_grads_for_norm(params, param_filter=None):
        swapped = []
        for p in params:
            model = model_of.get(id(p))
            swapped.append(model if p.grad is None and model is not None and _main_grad_of(p, model) is not None
                           else p)
        return filter_grads(swapped, param_filter=param_filter)

    return filter_grads_for_norm


# Tensors up to this size step together, one launch per (group, gradient dtype, model dtype, clip scale): for
# them the launch costs the host more than the update costs the GPU (4 MB of fp32 moves in ~10 us on an H200,
# a Triton launch takes the host ~20-30 us). Larger ones keep a launch each, where the kernel is specialised
# to their aligned pointers.
SMALL_TENSOR_NUMEL = 1 << 20


# Host work of a fused step done ahead by ``prepare_step_with_ready_grads`` (the NaN guard calls it before its
# host read, while the device still runs the backward), taken by the update that follows; one step's only.
_prepared: dict[int, list] = {}  # id(optimizer) -> _prepare_fused_step's result


@torch.no_grad()
def _prepare_fused_step(opt, model_of: dict) -> list:
    """The host side of :func:`_fused_adamw_step`: per param group, its step counters, hyper-parameters, the
    large tensors (one launch each) and the lists of small ones, with the clip coefficients this step set.
    Creates the moments on the first step (torch's lazy init; zeros, so a step skipped after it changes no
    number). Launches nothing else."""
    inner = opt.optimizer
    prepared = []
    for group in inner.param_groups:
        grads = {id(p): _main_grad_of(p, model_of.get(id(p))) for p in group["params"]}
        params = [p for p in group["params"] if grads[id(p)] is not None]
        states = [inner.state[p] for p in params]
        for p, state in zip(params, states):  # torch's lazy init (fused: fp32 step on the device)
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            elif state["step"].device != p.device or state["step"].dtype != torch.float32:
                state["step"] = state["step"].to(p.device, torch.float32)  # e.g. loaded by a non-fused optimizer
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"])
        large, small = [], {}
        for p, state in zip(params, states):
            model, grad, scale = model_of.get(id(p)), grads[id(p)], _pending_clip.pop(id(p), 1.0)
            item = (p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], model)
            if p.numel() <= SMALL_TENSOR_NUMEL:
                small.setdefault((grad.dtype, None if model is None else model.dtype, scale), []).append(item)
            else:
                large.append((item, scale))
        large.sort(key=lambda entry: -entry[0][0].numel())  # the longest update first: the device is busy with
        # it while the host launches the others (a ~4M-element tensor updates in about one launch's host time)
        prepared.append(([s["step"] for s in states], hyper, large, small))
    return prepared


@torch.no_grad()
def _fused_adamw_step(opt, model_of: dict) -> bool:
    """Megatron's ``step_with_ready_grads`` (inner step, then main -> model copy) as fused AdamW launches: one
    per large tensor, one per list of small ones; the host work prepared ahead when it was."""
    from kimi_kernels.adamw import adamw_multi_step_, adamw_step_

    prepared = _prepared.pop(id(opt), None)
    for steps, hyper, large, small in prepared if prepared is not None else _prepare_fused_step(opt, model_of):
        if steps:
            torch._foreach_add_(steps, 1.0)
        for item, scale in large:
            adamw_step_(*item, **hyper, grad_scale=scale)
        for (_, _, scale), items in small.items():
            adamw_multi_step_(items, **hyper, grad_scale=scale)
    return True


def use_fresh_main_grads(ddp) -> bool:
    """Megatron ``DistributedDataParallel``: skip the buffer's zero fill in ``zero_grad_buffer``; instead each
    parameter's first gradient of the step is copied into its ``main_grad`` by a tensor hook (it runs before
    autograd's accumulation and DDP's post-hook, which then skips its add through Megatron's own
    ``grad_added_to_main_grad`` flag). Later gradients of the step (micro-batches, re-entrant recompute) are
    added by DDP as usual; ``finish_grad_sync`` first zeroes any parameter that got none. The buffer's
    padding is never written, so it stays zero from allocation. Returns False (nothing changed) under
    Transformer Engine CUDA graphs, whose captured hooks own that flag."""
    if getattr(ddp.config, "cuda_graph_impl", "none") == "transformer_engine" or getattr(
            ddp.ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return False  # CUDA graphs own the flag; mxfp8 reuses the grad buffer for param gathers
    params = [p for p in ddp.params_with_grad if p in ddp.param_to_bucket_group]
    for p in params:
        p._main_grad_fresh, p._main_grad_copied = False, False
        p.register_hook(functools.partial(_first_grad_into_main_grad, p))
    finish_grad_sync = ddp.finish_grad_sync

    def zero_grad_buffer_without_fill():
        # Megatron 0.19.2's zero_grad_buffer minus the buffers' grad_data.zero_().
        for p in ddp.params_with_grad:
            p.grad_added_to_main_grad = False
        for p in params:
            p._main_grad_fresh, p._main_grad_copied = True, False
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            for grad in buffer.extra_main_grads:
                grad.zero_()
        for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            bucket_group.reset()

    def finish_grad_sync_after_zeroing_unused(*args, **kwargs):
        for p in params:
            if p._main_grad_fresh:  # no gradient this step: Megatron's zero fill, for this one
                p.main_grad.zero_()
                p._main_grad_fresh = False
        return finish_grad_sync(*args, **kwargs)

    ddp.zero_grad_buffer = zero_grad_buffer_without_fill
    ddp.finish_grad_sync = finish_grad_sync_after_zeroing_unused
    return True


@torch.no_grad()
def _first_grad_into_main_grad(param, grad):
    if param._main_grad_fresh:
        from kimi_kernels.cast_copy import widening_copy_

        widening_copy_(param.main_grad, grad)
        param._main_grad_fresh, param._main_grad_copied = False, True
        param.grad_added_to_main_grad = True  # DDP's post-hook: already in main_grad
    elif param._main_grad_copied:
        param._main_grad_copied = False
        param.grad_added_to_main_grad = False  # the next gradients: DDP adds them


@contextlib.contextmanager
def fast_fallbacks():
    """Inside: Megatron's clip_grads module uses :func:`foreach_l2_norm` / :func:`foreach_scale` in place of
    its no-Apex stand-ins, and :func:`foreach_scale` as its tensor-scale kernel, so the grad norm stays a device
    tensor (what Megatron does with Transformer Engine: the optimizer's ``step`` returns it as a one-element
    tensor, read when logged). Left alone when Apex or Transformer Engine supplies the real kernels."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    _pending_clip.clear()  # a step that returned early (inf/nan) leaves nothing behind
    _prepared.clear()
    saved_clip = mcore_optimizer.clip_grad_by_total_norm_fp32
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_into_fused_step(saved_clip)
    no_apex = clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm
    saved = clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, clip_grads.multi_tensor_scale_tensor_impl
    if no_apex:
        # A tensor-scale kernel switches Megatron's get_grad_norm_fp32 to returning the norm as a device tensor
        # (its Transformer Engine path) instead of reading it to the host: no sync in the step.
        clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl = foreach_l2_norm, foreach_scale
        clip_grads.multi_tensor_scale_tensor_impl = foreach_scale
    try:
        yield
    finally:
        _prepared.clear()  # a skipped update's preparation is not the next step's
        (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
         clip_grads.multi_tensor_scale_tensor_impl) = saved
        mcore_optimizer.clip_grad_by_total_norm_fp32 = saved_clip


def chained_grad_norm(chained):
    """``ChainedOptimizer.get_grad_norm`` whose sub-optimizers keep their own grad-stats groups (the expert
    optimizer's group differs from the dense one's, even on one GPU): Megatron combines their norms with
    ``_grad_norm if _grad_norm else 0.0`` and ``math.sqrt``, three host reads a step; this is the same
    ``sqrt(sum(norm ** 2))`` (a missing norm counts 0) on whatever the norms are, device tensors included."""
    if len(chained.chained_optimizers) == 1 or chained.grads_states_parallel_group_is_shared():
        return type(chained).get_grad_norm(chained)
    total = 0.0
    for optimizer in chained.chained_optimizers:
        norm = optimizer.get_grad_norm()
        if norm is not None:
            total = total + norm**2
    return total**0.5


def scoped_fast_fallbacks(optimizer):
    """Run ``optimizer.step`` (a Megatron optimizer instance) inside :func:`fast_fallbacks`; a chained one
    combines its norms with :func:`chained_grad_norm`."""
    if hasattr(optimizer, "chained_optimizers"):
        optimizer.get_grad_norm = functools.partial(chained_grad_norm, optimizer)
    step = optimizer.step

    def step_with_fast_fallbacks(*args, **kwargs):
        with fast_fallbacks():
            return step(*args, **kwargs)

    optimizer.step = step_with_fast_fallbacks
    return optimizer
