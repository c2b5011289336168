"""Checkpoint sharding and TP-local initialisation for parameters a module owns directly.

Megatron's default ``MegatronModule.sharded_state_dict`` treats a module's own parameters as
replicated. The KDA layer owns head-split parameters (``A_log``, ``dt_bias``, conv weights);
they carry Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes, and
:class:`TPShardedModule` turns exactly those attributes into the axis map of
``make_sharded_tensors_for_checkpoint``, so dist_checkpointing reshards them across TP sizes.
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron.core.utils import get_pg_rank, get_pg_size

from megatron_ext.errors import ConfigError


def param_device(config) -> torch.device:
    """Where Megatron's layers put parameters for ``config`` (CPU init or the current GPU)."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def full_sequence(x: torch.Tensor, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """``x`` for column-parallel heads that each read all of it: all-gathered over the sequence under
    sequence parallelism (reduce-scatter of the summed gradient in backward), else as it is (one
    all-reduce of the summed gradient in backward). One call serves every projection of ``x``."""
    if get_pg_size(tp_group) == 1:
        return x
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group=tp_group)
    return copy_to_tensor_model_parallel_region(x, group=tp_group)


def head_split_parameter(global_values: torch.Tensor, tp_group, device, dtype) -> torch.nn.Parameter:
    """This TP rank's contiguous dim-0 slice of ``global_values``, marked TP-split on dim 0.

    The global tensor is drawn on every rank from the same (default) generator and sliced, as
    Megatron's ``use_cpu_initialization`` path does: the initial model is the same under every TP
    size.
    """
    tp, rank = get_pg_size(tp_group), get_pg_rank(tp_group)
    local = global_values.shape[0] // tp
    param = torch.nn.Parameter(
        global_values[rank * local : (rank + 1) * local].to(device=device, dtype=dtype).clone()
    )
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    return param


class TPShardedModule(MegatronModule):
    """A ``MegatronModule`` whose own TP-split parameters are checkpointed as TP shards."""

    def _use_tp_group(self, pg_collection, layer_kind: str) -> None:
        """Take ``pg_collection``'s TP group (Megatron's global groups when None) as ``self.tp_group``; a
        context-parallel group of more than one rank is refused, naming ``layer_kind``."""
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        if get_pg_size(pg_collection.cp) > 1:
            raise ConfigError(f"{layer_kind} layers do not support context_parallel_size > 1 yet")
        self.tp_group = pg_collection.tp

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        axis_map = {
            name: p.partition_dim
            for name, p in self.named_parameters(recurse=False)
            if getattr(p, "tensor_model_parallel", False)
        }
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = make_sharded_tensors_for_checkpoint(
            own,
            prefix,
            tensor_parallel_layers_axis_map=axis_map,
            sharded_offsets=sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        for name, child in self.named_children():
            out.update(
                sharded_state_dict_default(
                    child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
            )
        return out
