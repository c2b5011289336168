"""Atomic dist_checkpointing saves: exact round trip, resharded loads, RNG, and crash safety."""

import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_ext.training import checkpointing as ckpt
from tests._dist import free_port, run_distributed

ROWS, COLS = 8, 6


def _reference(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, COLS, generator=g), torch.randn(5, generator=g)


def _sharded(weight_local, bias, rank, world):
    """The weight is split by rows over the ranks; the bias is replicated on every rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        "model": {
            "weight": ShardedTensor.from_rank_offsets("weight", weight_local, (0, rank, world)),
            "bias": ShardedTensor.from_rank_offsets("bias", bias, replica_id=rank),
        }
    }


def _seed_all(seed):
    """Python, NumPy, torch and a Megatron model-parallel RNG stream."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_ext import cpu_compat

    cpu_compat.install()  # Megatron's RNG tracker forks the CUDA generator; on CPU the CPU one
    random.seed(seed), torch.manual_seed(seed), np.random.seed(seed)
    get_cuda_rng_tracker().reset()
    get_cuda_rng_tracker().add("model-parallel-rng", seed + 10_000)


def _draws():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork("model-parallel-rng"):
        tracked = torch.rand(3)
    return random.random(), float(np.random.rand()), torch.rand(3), tracked


def _save_worker(rank, world, save_dir, seed, iteration):
    weight, bias = _reference(seed)
    local = weight.chunk(world, dim=0)[rank].clone()
    _seed_all(seed + rank)
    common = {"consumed_samples": 64 * iteration, "scheduler": {"num_steps": iteration}}
    path = ckpt.save_checkpoint(save_dir, iteration, _sharded(local, bias, rank, world), common,
                                config={"lr": 0.1, "seq_length": 32})
    # What each RNG yields right after the save: a restored run must yield the same.
    return path, _draws()


def _load_worker(rank, world, load_dir, iteration=None):
    empty = torch.zeros(ROWS // world, COLS)
    _seed_all(999)
    result = ckpt.load_checkpoint(load_dir, _sharded(empty, torch.zeros(5), rank, world), iteration=iteration)
    if result is None:
        return None
    state, common = result
    return state["model"]["weight"], state["model"]["bias"], common, _draws()


def _save_then_load_worker(rank, world, save_dir, seed, iteration):
    saved = _save_worker(rank, world, save_dir, seed, iteration)
    return saved, _load_worker(rank, world, save_dir)


def test_save_on_two_ranks_load_on_one_and_two(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_save_then_load_worker, 2, save_dir, 7, 100)
    saved = [r[0] for r in results]
    assert saved[0][0] == os.path.join(save_dir, "iter_0000100")
    assert open(os.path.join(save_dir, ckpt.TRACKER_FILE)).read().strip() == "100"
    assert sorted(os.listdir(save_dir)) == ["iter_0000100", ckpt.TRACKER_FILE]
    weight, bias = _reference(7)
    for rank, (_, (w, b, common, draws)) in enumerate(results):
        assert torch.equal(w, weight.chunk(2)[rank]) and torch.equal(b, bias)
        expected = saved[rank][1]
        assert draws[:2] == expected[:2]  # per-rank RNG: Python, NumPy, torch, Megatron tracker
        assert torch.equal(draws[2], expected[2]) and torch.equal(draws[3], expected[3])

    (w1, b1, common, draws1), = run_distributed(_load_worker, 1, save_dir)
    assert torch.equal(w1, weight) and torch.equal(b1, bias)
    assert common["iteration"] == 100 and common["consumed_samples"] == 6400
    assert common["scheduler"] == {"num_steps": 100} and common["config"]["seq_length"] == 32
    assert common["world_size"] == 2
    assert draws1[0] != saved[0][1][0]  # world size changed: RNG not restored


def _save_and_list_children(rank, world, save_dir):
    import multiprocessing

    _save_worker(rank, world, save_dir, 3, 1)
    return [child.name for child in multiprocessing.active_children()]


def test_a_save_starts_no_process(tmp_path):
    """Megatron's writer would start a Manager server process per rank at the first save, which outlives a rank
    killed by a signal (megatron_ext.checkpoint_fixes.keep_write_results_in_process)."""
    assert run_distributed(_save_and_list_children, 2, str(tmp_path / "ckpt")) == [[], []]


def _crash_during_save(save_dir, port):
    """Save iteration 1, then die (SIGKILL) after iteration 2's shards are written, before the rename."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing

    ckpt.save_checkpoint(save_dir, 1, _sharded(_reference(1)[0], _reference(1)[1], 0, 1), {"step": 1})
    real_save = dist_checkpointing.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    dist_checkpointing.save = save_then_die
    ckpt.save_checkpoint(save_dir, 2, _sharded(_reference(2)[0], _reference(2)[1], 0, 1), {"step": 2})


def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    code = ("import sys; from tests.training.test_checkpointing import _crash_during_save; "
            "_crash_during_save(sys.argv[1], int(sys.argv[2]))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log = tmp_path / "crash.log"
    with open(log, "w") as out:
        # Own session: dist_checkpointing's writer helper processes outlive a SIGKILLed parent,
        # so the whole group is killed afterwards.
        proc = subprocess.Popen([sys.executable, "-c", code, save_dir, str(free_port())], cwd=root,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=240)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert os.path.isdir(os.path.join(save_dir, "iter_0000002.tmp"))  # the partial save
    # Also a directory that looks final but never got its metadata (e.g. copied by hand).
    os.makedirs(os.path.join(save_dir, "iter_0000003"))
    assert ckpt.find_latest_checkpoint(save_dir) == (1, os.path.join(save_dir, "iter_0000001"))
    os.remove(os.path.join(save_dir, ckpt.TRACKER_FILE))  # even without the tracker
    assert ckpt.find_latest_checkpoint(save_dir)[0] == 1

    (loaded, bad_iteration, empty), = run_distributed(_recover_worker, 1, save_dir, str(tmp_path / "none"))
    w, b, common, _ = loaded
    assert common["step"] == 1 and torch.equal(w, _reference(1)[0]) and torch.equal(b, _reference(1)[1])
    assert "not a complete checkpoint" in bad_iteration and empty is None
    assert not os.path.exists(os.path.join(save_dir, "iter_0000002.tmp"))  # cleaned by the next save
    assert ckpt.find_latest_checkpoint(save_dir)[0] == 4
    assert ckpt.find_latest_checkpoint(str(tmp_path / "nothing")) is None


def _recover_worker(rank, world, save_dir, empty_dir):
    loaded = _load_worker(rank, world, save_dir)
    try:
        _load_worker(rank, world, save_dir, 3)
        bad_iteration = "loaded"
    except FileNotFoundError as exc:
        bad_iteration = str(exc)
    empty = _load_worker(rank, world, empty_dir)
    _save_worker(rank, world, save_dir, 5, 4)
    return loaded, bad_iteration, empty


def _save_keeping_worker(rank, world, save_dir, keep_last):
    weight, bias = _reference(rank)
    kept = []
    for iteration in (1, 2, 3, 4):
        ckpt.save_checkpoint(save_dir, iteration, _sharded(weight.chunk(world)[rank].clone(), bias, rank, world),
                             keep_last=keep_last)
        kept.append(sorted(it for it, _ in ckpt.complete_checkpoints(save_dir)))
    return kept


def test_keep_last_deletes_older_checkpoints_only_after_a_complete_save(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    kept = run_distributed(_save_keeping_worker, 2, save_dir, 2)
    assert kept[0] == kept[1] == [[1], [1, 2], [2, 3], [3, 4]]
    assert ckpt.find_latest_checkpoint(save_dir)[0] == 4
    # Unit cases: a .tmp save and an incomplete directory are left alone; the one just saved is kept even
    # when a newer one is there (a run restarted from an older checkpoint into the same directory).
    os.makedirs(os.path.join(save_dir, "iter_0000009.tmp"))
    os.makedirs(os.path.join(save_dir, "iter_0000008"))
    assert ckpt.prune_checkpoints(save_dir, 1, keep=os.path.join(save_dir, "iter_0000003")) == [
        os.path.join(save_dir, "iter_0000004")]
    assert sorted(os.listdir(save_dir)) == ["iter_0000003", "iter_0000008", "iter_0000009.tmp", ckpt.TRACKER_FILE]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ckpt.prune_checkpoints(save_dir, 0, keep=os.path.join(save_dir, "iter_0000003"))


def _damage_then_load_worker(rank, world, save_dir):
    from megatron_ext.training.checkpoint_integrity import damaged_files

    _save_worker(rank, world, save_dir, 11, 1)
    path = _save_worker(rank, world, save_dir, 12, 2)[0]
    intact = damaged_files(path)
    if rank == 0:  # one shard changed in place (same size), the other gone
        with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
            f.seek(64)
            f.write(torch.randn(256).numpy().tobytes())
        os.remove(os.path.join(path, "__0_0.distcp"))
    dist.barrier()
    damaged = damaged_files(path)
    said = []
    empty = torch.zeros(ROWS // world, COLS)
    state, common = ckpt.load_checkpoint(save_dir, lambda: _sharded(empty, torch.zeros(5), rank, world),
                                         log=said.append)
    return intact, damaged, said, state["model"]["weight"], common["iteration"]


def test_a_damaged_checkpoint_is_named_and_the_previous_one_loads(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_damage_then_load_worker, 2, save_dir)
    path = os.path.join(save_dir, "iter_0000002")
    assert "checksums.json" in os.listdir(path)
    for rank, (intact, damaged, said, weight, iteration) in enumerate(results):
        assert intact == []
        assert damaged == [f"{path}/__0_0.distcp: missing",
                           f"{path}/__1_0.distcp: contents changed since the save (CRC-32 mismatch)"]
        assert said == [f"> refusing damaged checkpoint {path} ({'; '.join(damaged)}); falling back to the "
                        "previous one"]
        assert iteration == 1 and torch.equal(weight, _reference(11)[0].chunk(2)[rank])


def test_the_structural_model_keys_are_model_config_keys():
    """A renamed model key must not silently drop out of the checkpoint's model check."""
    from megatron_ext.config import USER_FIELDS
    from megatron_ext.training.checkpoint_compat import STRUCTURAL_MODEL_KEYS, model_differences

    assert set(STRUCTURAL_MODEL_KEYS) <= set(USER_FIELDS)
    # the MLA layer's sizes and KDA's output-gate bias change parameter shapes too
    assert {"kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
            "kda_output_gate_bias"} <= set(STRUCTURAL_MODEL_KEYS)
    saved = {"num_layers": 4, "hidden_size": 64, "lr": 0.1, "tensor_model_parallel_size": 1}
    now = {"num_layers": 4, "hidden_size": 32, "lr": 0.2, "tensor_model_parallel_size": 2}
    assert model_differences(saved, now) == ["hidden_size: 64 in the checkpoint, 32 now"]


def _save_with_log(rank, world, save_dir):
    import logging

    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    torch_strategy._logged_mcore_async_deprecation = False  # as in a fresh process
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(torch_strategy.__name__).addHandler(handler)
    _save_worker(rank, world, save_dir, 3, 1)
    return [record.getMessage() for record in records]


def test_a_synchronous_save_logs_no_async_deprecation(tmp_path):
    """Megatron's synchronous save goes through its async path and would log "MCore's async save is deprecated"
    on every rank (megatron_ext.checkpoint_fixes.quiet_sync_save_deprecation)."""
    logged = run_distributed(_save_with_log, 2, str(tmp_path / "ckpt"))
    assert not [m for messages in logged for m in messages if "async save is deprecated" in m], logged
