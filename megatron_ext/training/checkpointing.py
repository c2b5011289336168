"""Atomic distributed checkpoints on ``megatron.core.dist_checkpointing``.

Layout of ``save_dir``::

    latest_checkpointed_iteration.txt   # "100": the newest complete checkpoint
    iter_0000100/                        # one dist_checkpointing (torch_dist) checkpoint
    iter_0000200.tmp/                    # a save in progress (or one that crashed)

A save writes everything into ``iter_XXXXXXX.tmp``; after every rank finished (barrier),
rank 0 fsyncs it, renames it to ``iter_XXXXXXX`` and atomically replaces the tracker
(write tmp + fsync + ``os.replace``). A crash at any point leaves the previous checkpoint and
tracker untouched; leftover ``.tmp`` directories are ignored by ``find_latest_checkpoint`` and
deleted by rank 0 at the next save. Before the rename the ranks record every file's size and
CRC-32 in ``checksums.json`` (``checkpoint_integrity``); ``load_checkpoint`` verifies them and
falls back to the next older complete checkpoint when one is damaged.

What goes in: the caller's sharded state dict (model / optimizer ``ShardedTensor``s, whose
global layout lets ``load_checkpoint`` reshard across TP/PP/EP), the common state (identical on
all ranks: iteration, consumed samples, scheduler, merged config; stored once by
dist_checkpointing), and each rank's RNG states (Python, NumPy, torch CPU, CUDA when present)
and Megatron's model-parallel RNG tracker streams,
as a ``ShardedObject`` of global shape ``(world_size,)`` at offset ``(rank,)`` — per-rank state
cannot live in the common part, which only rank 0 writes. RNG is restored only when the world
size is unchanged; a resharded run reseeds instead.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext import checkpoint_fixes
from megatron_ext.training.checkpoint_integrity import damaged_files, write_manifest

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_COMMON_KEY = "common"
_RNG_KEY = "rng_state"


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _require_process_group(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed initialised (a 1-rank gloo group "
                           "is enough): dist_checkpointing coordinates ranks through it")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(os.path.abspath(path)))


def is_complete_checkpoint(path: str) -> bool:
    # dist_checkpointing writes metadata.json last (after all shards), so it marks completion.
    return os.path.isfile(os.path.join(path, "metadata.json"))


# ------------------------------------------------------------------------------------ RNG


def get_rng_state() -> dict:
    """This process's RNG states as plain lists/tensors (safe for ``weights_only`` loading)."""
    version, keys, gauss = random.getstate()
    algo, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(keys), gauss],
        "numpy": [algo, torch.from_numpy(np_keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "megatron_tracker": None,
    }
    tracker = _megatron_rng_tracker()
    streams = tracker.get_states() if hasattr(tracker, "get_states") else {}
    if streams:
        # Megatron's named model-parallel RNG streams (dropout/init inside TP regions).
        state["megatron_tracker"] = {k: v.clone() for k, v in streams.items() if isinstance(v, torch.Tensor)}
    return state


def _megatron_rng_tracker():
    """Megatron's CUDA RNG tracker when the model already imported it, else None."""
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    return None if module is None else module.get_cuda_rng_tracker()


def set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    algo, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((algo, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _megatron_rng_tracker()
    if state.get("megatron_tracker") and tracker is not None:
        tracker.set_states(state["megatron_tracker"])


# ------------------------------------------------------------------------------ save / load


def check_save_dir(save_dir: str) -> None:
    """Create ``save_dir`` and write a file into it, so an unusable ``--save`` fails at start rather
    than at the first save; raises ``ConfigError`` naming the directory and the reason."""
    from megatron_ext.errors import ConfigError

    probe = os.path.join(save_dir, f".write_test.{os.getpid()}")
    try:
        os.makedirs(save_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"save: cannot write checkpoints to {save_dir}: {exc.strerror or exc}") from None


def sharded_training_state(chunks, optimizer, *, for_loading: bool, with_optimizer: bool) -> dict:
    """What a training checkpoint holds, as a sharded state dict: each model chunk's (``model0``, ``model1``, ...)
    and, ``with_optimizer``, the optimizer's (moments, fp32 main weights, step) sharded like the model, so that
    both reshard across TP/PP/EP/DP. ``for_loading`` builds the dict to load into (it may allocate optimizer
    state). ``chunks`` are the DDP-wrapped model chunks."""
    model = {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(chunks)}
    state = dict(model)
    if with_optimizer:
        merged = {k: v for sd in model.values() for k, v in sd.items()}
        state["optimizer"] = optimizer.sharded_state_dict(
            merged, is_loading=for_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"},
        )
    return state


def save_checkpoint(
    save_dir: str,
    iteration: int,
    sharded_state_dict: dict,
    common_state: Optional[dict] = None,
    *,
    config: Optional[dict] = None,
    save_rng: bool = True,
    keep_last: Optional[int] = None,
) -> str:
    """Save atomically to ``save_dir/iter_XXXXXXX``; every rank must call it. Returns the path.

    ``common_state`` holds small picklable values (ints, floats, str, lists, dicts, tensors)
    that are the same on every rank; ``config`` is the merged config dict
    (``LoadedConfig.to_dict()``), stored with it. ``keep_last``: once this save is complete and
    tracked, delete the older complete checkpoints beyond the newest ``keep_last`` (this one
    counted; None keeps all): :func:`prune_checkpoints`.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    _require_process_group("save_checkpoint")
    checkpoint_fixes.keep_write_results_in_process()  # no Manager process per rank (see there)
    checkpoint_fixes.quiet_sync_save_deprecation()  # not an async save
    if not torch.cuda.is_available():
        # dist_checkpointing's writer calls torch.cuda.synchronize() after its device-to-host
        # copies (filesystem_async.preload_tensors); cpu_compat makes that a no-op on the CPU.
        from megatron_ext import cpu_compat

        cpu_compat.install()
    world, rank = dist.get_world_size(), dist.get_rank()
    final = os.path.join(save_dir, checkpoint_name(iteration))
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        remove_stale_temp_dirs(save_dir)
        os.makedirs(tmp)
    _barrier()
    state = dict(sharded_state_dict)
    state[_COMMON_KEY] = {**(common_state or {}), "iteration": iteration, "world_size": world,
                          "config": config}
    if save_rng:
        state[_RNG_KEY] = ShardedObject(_RNG_KEY, get_rng_state(), (world,), (rank,), replica_id=0)
    dist_checkpointing.save(state, tmp)
    _barrier()
    write_manifest(tmp)
    _barrier()
    if rank == 0:
        _fsync_tree(tmp)
        if os.path.exists(final):  # re-saving an iteration (e.g. after a restart): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_path(save_dir)
        _write_atomic(os.path.join(save_dir, TRACKER_FILE), f"{iteration}\n")
        if keep_last is not None:
            prune_checkpoints(save_dir, keep_last, keep=final)
    _barrier()
    return final


def prune_checkpoints(save_dir: str, keep_last: int, keep: str) -> list[str]:
    """Delete the complete checkpoints of ``save_dir`` beyond the ``keep_last`` newest by iteration,
    never ``keep`` (the one just saved, counted among them); rank 0 only. Only after a save is
    complete and tracked, so a crash never leaves fewer loadable checkpoints than asked for; ``.tmp``
    and incomplete directories are not touched. Returns the deleted paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    newest = sorted(complete_checkpoints(save_dir), reverse=True)
    others = [path for _, path in newest if path != keep]
    doomed = others[keep_last - 1:]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_stale_temp_dirs(save_dir: str) -> list[str]:
    """Delete ``iter_*.tmp`` directories (interrupted saves); rank 0 only. Returns them."""
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name.startswith("iter_") and name.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def complete_checkpoints(load_dir: str) -> list[tuple[int, str]]:
    """(iteration, path) of every complete checkpoint in ``load_dir``, the one to load first first.

    That is the one the tracker names when it points at a complete ``iter_`` directory (a
    missing, stale or corrupt tracker is ignored), then the others, newest first. ``.tmp``
    directories and directories without ``metadata.json`` never count.
    """
    if not os.path.isdir(load_dir):
        return []
    found = []
    for name in os.listdir(load_dir):
        match = _ITER_RE.match(name)
        if match and is_complete_checkpoint(os.path.join(load_dir, name)):
            found.append((int(match.group(1)), os.path.join(load_dir, name)))
    found.sort(reverse=True)
    try:
        with open(os.path.join(load_dir, TRACKER_FILE)) as f:
            tracked = int(f.read().strip())
    except (OSError, ValueError):
        return found
    return sorted(found, key=lambda item: item[0] != tracked)  # stable: the rest stay newest first


def find_latest_checkpoint(load_dir: str) -> Optional[tuple[int, str]]:
    """(iteration, path) of the checkpoint to load from ``load_dir`` (see ``complete_checkpoints``), or None."""
    found = complete_checkpoints(load_dir)
    return found[0] if found else None


class DamagedCheckpointError(RuntimeError):
    """Every complete checkpoint in the directory failed its checksums."""


def load_checkpoint(
    load_dir: str,
    sharded_state_dict: Union[dict, Callable[[], dict]],
    *,
    iteration: Optional[int] = None,
    load_rng: bool = True,
    strict: str = "assume_ok_unexpected",
    check_common: Optional[Callable[[str, dict], None]] = None,
    log: Callable[[str], None] = print,
) -> Optional[tuple[dict, dict]]:
    """Load the newest complete and intact checkpoint (or ``iteration``) into the layout of
    ``sharded_state_dict``; every rank must call it.

    ``sharded_state_dict`` may be a function that builds it, called only once there is a
    checkpoint to load (building an optimizer's loading state dict initialises its state).
    A checkpoint whose files fail their checksums is skipped, saying so through ``log``, for the
    next older one (``DamagedCheckpointError`` when none is left; with ``iteration``, at once).
    ``check_common(path, common_state)`` may refuse a checkpoint by raising before anything is
    loaded. Returns ``(state_dict, common_state)``: the loaded tensors/objects keyed like
    ``sharded_state_dict`` (copy them into the model/optimizer) and the common state (with
    ``iteration``, ``world_size``, ``config`` and the caller's keys), or None when there is no
    checkpoint. RNG states are restored when ``load_rng`` and the world size matches.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if iteration is None:
        candidates = complete_checkpoints(load_dir)
        if not candidates:
            return None
    else:
        path = os.path.join(load_dir, checkpoint_name(iteration))
        if not is_complete_checkpoint(path):
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no metadata.json)")
        candidates = [(iteration, path)]
    _require_process_group("load_checkpoint")
    path = first_intact_checkpoint(candidates, log)
    world, rank = dist.get_world_size(), dist.get_rank()
    common = dist_checkpointing.load_common_state_dict(path)[_COMMON_KEY]
    if check_common is not None:
        check_common(path, common)
    request = dict(sharded_state_dict() if callable(sharded_state_dict) else sharded_state_dict)
    restore_rng = load_rng and common["world_size"] == world
    if restore_rng:
        request[_RNG_KEY] = ShardedObject(_RNG_KEY, None, (world,), (rank,), replica_id=0)
    loaded = dist_checkpointing.load(request, path, strict=strict)
    if restore_rng:
        set_rng_state(loaded.pop(_RNG_KEY))
    loaded.pop(_COMMON_KEY, None)
    return loaded, common


def first_intact_checkpoint(candidates: list[tuple[int, str]], log: Callable[[str], None]) -> str:
    """The path of the first candidate whose files pass their checksums (every rank checks a share)."""
    refused = []
    for _, path in candidates:
        damaged = damaged_files(path)
        if damaged is None:
            log(f"> {path} has no checksums (saved by an older version); loading it unverified")
            return path
        if not damaged:
            return path
        refused.append(f"{path} ({'; '.join(damaged)})")
        log(f"> refusing damaged checkpoint {refused[-1]}"
            + ("; falling back to the previous one" if len(refused) < len(candidates) else ""))
    raise DamagedCheckpointError("no intact checkpoint to load: " + ", ".join(refused))


def common_state_of(path: str) -> dict[str, Any]:
    """The common state of one checkpoint directory (no process group needed)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(path)[_COMMON_KEY]
