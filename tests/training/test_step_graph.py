"""cuda_graph_step (megatron_ext/training/step_graph.py): the step replayed from a graph computes what the eager
step computes, from each step's own inputs; layouts capture cannot handle are refused, naming the key.

On the CPU a stand-in graph re-runs the captured function at each replay (CUDA graphs need a GPU); the GPU test
trains through launch/train.py with the key on and off."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed

ROOT = Path(__file__).resolve().parents[2]


class ReplayingGraph:
    """CPU stand-in for ``CudaStepGraph``. On CUDA, capture runs no kernel and the replay right after it computes the
    step; here capture runs the function once (that step's computation) and its first replay does nothing; later
    replays run the function again and write its output into the captured one, in place, as a graph would."""

    def __init__(self, stream):
        assert stream is None  # the CPU has no streams

    def capture(self, fn):
        self.fn, self.output, self.fresh = fn, fn(), True
        return self.output

    def replay(self):
        if self.fresh:
            self.fresh = False
            return
        self.output.copy_(self.fn())


def _graphed_steps_equal_eager(rank, world, steps):
    from megatron_ext.parallel import wrap_ddp
    from megatron_ext.training.step import forward_backward
    from megatron_ext.training.step_graph import StepGraph
    from tests.parallel.harness import MICRO_BATCH, SEQ, collect_grads, make_batches, microbatches_for_rank, setup

    # qb_both without host reads: the routing one GPU runs by default, capacity binding (factor 1.0)
    config, chunks = setup({}, True, dict(moe_balancer="qb_both", moe_expert_capacity_factor=1.0,
                                          moe_qb_host_reads=False))
    chunks = wrap_ddp(chunks, config)
    batches = [microbatches_for_rank(make_batches(seed)) for seed in range(100, 100 + steps)]

    def one_step(run, batch):
        for c in chunks:
            c.zero_grad_buffer()
        loss = run(batch)
        return float(loss), {key: grad.clone() for key, _, _, grad in collect_grads(chunks)}

    eager = [one_step(lambda b: forward_backward(chunks, b, SEQ, MICRO_BATCH, read_loss=False), b) for b in batches]
    messages = []
    step = StepGraph(chunks, SEQ, MICRO_BATCH, warmup=2, graph_type=ReplayingGraph, log=messages.append)
    graphed, buffers = [], None
    for batch in batches:
        graphed.append(one_step(step, batch))
        pointers = [t.data_ptr() for b in step.static for t in b.values()]
        assert buffers in (None, pointers)  # the graph's inputs stay where they were captured
        buffers = pointers
    assert step.graph is not None and step.steps == steps
    # one line, at the capture (the third step: two eager ones first)
    assert len(messages) == 1 and messages[0].startswith("> step graph: forward and backward of "), messages
    assert "microbatch(es) captured at step 3 in " in messages[0], messages
    return eager, graphed


@pytest.mark.slow
def test_graphed_steps_compute_the_eager_steps_each_from_its_own_batch():
    ((eager, graphed),) = run_distributed(_graphed_steps_equal_eager, 1, 6, timeout=600)
    losses = [loss for loss, _ in eager]
    assert len(set(losses)) == len(losses)  # six different batches: a stale input would repeat a loss
    for index, ((loss, grads), (graphed_loss, graphed_grads)) in enumerate(zip(eager, graphed)):
        assert graphed_loss == loss, index
        assert grads.keys() == graphed_grads.keys()
        for key in grads:
            assert torch.equal(grads[key], graphed_grads[key]), (index, key)


def test_a_step_of_other_shapes_is_refused():
    from megatron_ext.training.step_graph import StepGraph

    model = torch.nn.Linear(2, 2)
    step = StepGraph([model], 4, 1, warmup=1, graph_type=ReplayingGraph)
    batch = {"tokens": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    step._load([batch])
    with pytest.raises(ValueError, match="microbatch 0 'tokens' is torch.int64 \\(1, 8\\)"):
        step._load([{**batch, "tokens": torch.zeros(1, 8, dtype=torch.long)}])
    with pytest.raises(ValueError, match="2 microbatches, the captured step 1"):
        step._load([batch, batch])
    with pytest.raises(ValueError, match="keys"):
        step._load([{"tokens": batch["tokens"]}])
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        StepGraph([model], 4, 1, warmup=0)


@pytest.mark.parametrize("world, cuda, overrides, match", [
    (1, False, {}, "needs a CUDA GPU"),
    (2, True, {}, "one process"),
    (1, True, dict(moe_balancer="qb_both", moe_qb_host_reads=True, num_moe_experts=8, bf16=True),
     "moe_qb_host_reads"),
    (1, True, dict(num_moe_experts=8, bf16=False), "needs bf16"),  # the fp32 expert loop reads counts on the host
])
def test_layouts_capture_cannot_handle_are_refused_naming_the_key(world, cuda, overrides, match):
    from types import SimpleNamespace

    from megatron_ext.errors import ConfigError
    from megatron_ext.training.step_graph import check_step_graph

    with pytest.raises(ConfigError, match=f"cuda_graph_step.*{match}"):
        check_step_graph(True, SimpleNamespace(**overrides), world, cuda)
    check_step_graph(False, SimpleNamespace(**overrides), world, cuda)  # off: nothing to check
    check_step_graph(True, SimpleNamespace(moe_balancer="qb_both", moe_qb_host_reads=None, num_moe_experts=8,
                                           bf16=True), 1, True)
    check_step_graph(True, SimpleNamespace(num_moe_experts=None, bf16=False), 1, True)  # a dense fp32 model


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_train_refuses_the_key_at_start_on_the_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--expert-model-parallel-size", "1", "--cuda-graph-step", "--save", ""]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=dict(os.environ, WORLD_SIZE="1"))
    assert result.returncode != 0 and "cuda_graph_step: true needs a CUDA GPU" in result.stderr, result.stderr[-2000:]


def _train(tmp: Path, *flags: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(ROOT / "launch" / "train.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--expert-model-parallel-size", "1", "--train-iters", "8", "--lr-warmup-iters", "2", "--log-interval", "1",
           "--eval-iters", "1", "--eval-interval", "4", "--save", "", "--tensorboard-dir", "",
           "--metrics-dir", str(tmp), "--moe-balancer", "qb_both", "--moe-expert-capacity-factor", "1.25", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-6000:]
    records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return [r["lm_loss"] for r in records if "lm_loss" in r]


@pytest.mark.gpu
def test_training_with_the_step_graph_follows_the_eager_run(tmp_path):
    """launch/train.py on one GPU, tiny config with qb_both in bf16 (the step graph needs it with MoE layers):
    eight iterations with ``--cuda-graph-step`` (two eager, then captured and replayed) against the same run
    eager: the same losses, to the rounding of reordered bf16 sums, also in and after the (eager) evaluations at
    iterations 4 and 8 between replays."""
    eager = _train(tmp_path / "eager", "--bf16")
    graphed = _train(tmp_path / "graphed", "--cuda-graph-step", "--bf16")
    assert len(eager) == len(graphed) == 8 + 2 and all(math.isfinite(x) for x in graphed)
    tolerance = 2e-2
    for index, (a, b) in enumerate(zip(eager, graphed)):
        assert abs(a - b) <= tolerance * abs(a), (index, eager, graphed)
