"""Correctness patches to Megatron-Core 0.19.2's checkpoints (the third and last patch module, beside
``megatron_ext/cpu_compat.py`` and ``megatron_ext/speed_patches.py``): the optimizer's sharded state and, last,
the writer's results queue (:func:`keep_write_results_in_process`) and a deprecation line it logs for
synchronous saves (:func:`quiet_sync_save_deprecation`).

``Float16OptimizerWithFloat16Params.sharded_state_dict`` (Megatron's mixed-precision optimizer without the
distributed optimizer) matches the inner optimizer's parameters to the model's sharded tensors by position: it
numbers ``chain(float16_groups)``, while torch numbers *every* parameter of its ``param_groups``, and it zips
each group's ids with the group's fp32 main copies. A bf16 model that keeps some parameters in fp32 (KDA's
``A_log`` and ``dt_bias``, by design) sits in both lists in another order, so the save fails with
``Optimizer shape ((4,) does not match model shape ((16,))`` or, where shapes happen to agree, writes one
parameter's moments under another's name. :func:`fix_optimizer_checkpoints` replaces the method on each
such optimizer instance with :func:`_sharded_state_dict`, which numbers the parameters exactly as torch does
and maps each one to the model parameter it trains (a bf16 one's fp32 main copy to the bf16 model parameter, an
fp32 one to itself). The saved layout (keys, shapes, the shared ``common_step``) is Megatron's, so a
checkpoint written with the fix loads through Megatron's own ``load_state_dict``
(``tests/training/test_checkpoint_bf16.py``).

Megatron's ``DistributedOptimizer`` without Transformer Engine or Apex has three more faults on the checkpoint
path, fixed per instance by the same function:

* it finds a parameter's main shard and moments at ``(group, position)`` from ``model_param_group_index_map``,
  numbered in the group's original order, while the inner optimizer's group holds the fp32 parameters' shards
  first and the bf16 ones' main copies after them: a bf16 model with fp32 parameters saves one parameter's state
  into another's slot (``The size of tensor a (16) must match the size of tensor b (64)``). The map is rebuilt
  in the order the groups really have (:func:`_reindex_groups`);
* loading copies every tensor of torch Adam's per-parameter state from the checkpoint, ``step`` included, which
  the checkpoint keeps per group, not per parameter (``KeyError: 'step'``): only the parameter and its moments
  are copied; ``step`` comes back through the param groups as Megatron intends (:func:`_set_main_param_and_moments`);
* loading first reads the common ``step`` from the inner optimizer's state (``assert len(steps) == 1``), which
  torch creates only at the first step, so a fresh job cannot resume: the state is created as the first step
  would create it (``step`` 0, zero moments), without stepping, and the checkpoint then overwrites all of it
  (:func:`_loading_into_fresh_state`);
* loading gives every parameter's state the *same* ``step`` tensor (``s["step"] = step`` in a loop; torch keeps it
  as is when its dtype and device already fit), and the fused Adam step then adds 1 to it once per parameter:
  after a resume, bias correction ran with step 2 + number of parameters. Each parameter gets its own copy
  (:func:`_loading_with_own_steps`).
"""

from __future__ import annotations

import functools
import queue
import types

import torch


def fix_optimizer_checkpoints(optimizer) -> int:
    """Patch every Megatron optimizer inside ``optimizer`` (chained or not) that needs it, as the module docstring
    says: the mixed-precision one gets the position-correct ``sharded_state_dict`` (harmless for an all-bf16 model:
    same numbering), the distributed one over torch Adam(W) its four fixes. Returns how many were patched."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    patched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if type(opt) is Float16OptimizerWithFloat16Params:
            opt.sharded_state_dict = types.MethodType(_sharded_state_dict, opt)
            patched += 1
        elif isinstance(opt, DistributedOptimizer) and isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW):
            if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                continue  # Transformer Engine's FusedAdam path: none of the faults above
            _reindex_groups(opt)
            opt._set_main_param_and_optimizer_states = types.MethodType(_set_main_param_and_moments, opt)
            opt.sharded_state_dict = _loading_into_fresh_state(opt.sharded_state_dict, opt.optimizer)
            opt.load_state_dict = _loading_with_own_steps(opt.load_state_dict, opt.optimizer)
            patched += 1
    return patched


def _reindex_groups(opt) -> None:
    """``model_param_group_index_map`` in the inner optimizer's order: per group, the fp32 parameters' shards
    first, then the bf16 parameters' fp32 main shards (``DistributedOptimizer._build_model_and_main_param_groups``)."""
    index = {}
    for group, (fp32_params, float16_params) in enumerate(zip(opt.model_fp32_groups, opt.model_float16_groups)):
        for position, model_param in enumerate([*fp32_params, *float16_params]):
            index[model_param] = (group, position)
    assert index.keys() == opt.model_param_group_index_map.keys(), "a parameter moved between groups"
    opt.model_param_group_index_map = index


def _set_main_param_and_moments(self, model_param, tensors) -> None:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` for torch Adam(W): the main shard and the
    moments from ``tensors`` (``param`` and ``optimizer_state_keys``); ``step`` is not per parameter there."""
    group, position = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group]["params"][position]
    destinations = {"param": main_param, **{key: self.optimizer.state[main_param][key]
                                            for key in self.optimizer_state_keys}}
    for key, destination in destinations.items():
        if isinstance(tensors[key], torch.Tensor):
            destination.copy_(tensors[key])


def _loading_with_own_steps(load_state_dict, inner):
    """``DistributedOptimizer.load_state_dict`` after which no two parameters share a ``step`` tensor."""

    @functools.wraps(load_state_dict)
    def with_own_steps(state_dict):
        load_state_dict(state_dict)
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    return with_own_steps


def _loading_into_fresh_state(sharded_state_dict, inner):
    """``DistributedOptimizer.sharded_state_dict`` that, when loading into a torch Adam(W) that has never stepped,
    first gives it the state its first step would create (``step`` 0, zero ``exp_avg``/``exp_avg_sq``)."""

    @functools.wraps(sharded_state_dict)
    def with_state(model_sharded_state_dict, is_loading: bool = False, **kwargs):
        if is_loading and not inner.state:
            for group in inner.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    inner.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
        return sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)

    return with_state


def _trained_model_params(opt) -> list:
    """The model parameter each inner-optimizer parameter trains, in torch's state-dict numbering (all groups'
    ``params`` in order): a fp32 main copy stands for its bf16 model parameter, an fp32 parameter for itself."""
    model_of_main = {id(main): model
                     for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                     for model, main in zip(models, mains)}
    return [model_of_main.get(id(p), p) for group in opt.optimizer.param_groups for p in group["params"]]


def _sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
    """Megatron's ``Float16OptimizerWithFloat16Params.sharded_state_dict`` with torch's parameter numbering."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    if is_loading:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    id_to_sharded_param = get_param_id_to_sharded_param_map(model_sharded_state_dict, _trained_model_params(self))

    # The fp32 main copies, per group, under the ids of the bf16 parameters they stand for.
    mains = {id(main) for group in self.fp32_from_float16_groups for main in group}
    state_dict["fp32_from_fp16_params"] = [
        [
            make_sharded_optimizer_tensor(id_to_sharded_param[param_id], param, prefix="optimizer.state.fp32_param")
            for param_id, param in zip(state_group["params"], group["params"])
            if id(param) in mains
        ]
        for group, state_group in zip(self.optimizer.param_groups, state_dict["optimizer"]["param_groups"])
    ]
    # As Megatron: one step shared by all parameters, the moments sharded like their parameters.
    step = self._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def keep_write_results_in_process() -> None:
    """Give Megatron's checkpoint writer an in-process results queue before the first save.

    ``filesystem_async.get_write_results_queue`` makes it, once per process, as a ``multiprocessing`` Manager queue
    in the spawn context: the first save starts a server process per rank that imports the training script again
    (~770 MB of host memory each) and that nothing stops when the rank dies by a signal. A SIGKILLed rank (a
    node's OOM killer, a failed GPU, torchrun tearing down the others) leaves it behind, one more at every restart
    (found as orphans of ``tests/training/test_faults.py``'s killed-rank test). Our saves are synchronous: the
    writer threads and the reader of their results run in the saving process (``AsyncRequest.execute_sync``), so a
    ``queue.Queue`` carries the same results and no process is started. An async save (a writer in another
    process) would need the Manager's queue; we have none."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def quiet_sync_save_deprecation() -> None:
    """Keep Megatron's "MCore's async save is deprecated" warning out of synchronous saves.

    ``TorchDistSaveShardedStrategy.save`` (the synchronous save, ours) runs through ``async_save(...,
    async_strategy="mcore")`` and ``execute_sync``, so the first save of every rank logs that async save is
    deprecated and to switch to NVRx: wrong for a job that saves synchronously, and one line per rank. The line is
    guarded by a module flag, set here as if it had been logged; an async save of ours would need it back."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    torch_strategy._logged_mcore_async_deprecation = True
