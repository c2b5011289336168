"""Count the PyTorch (aten) ops of one training step, by where they come from (CPU, tiny sizes).

On the GPU each non-view aten op is roughly one kernel launch (plus allocator and dispatcher host
time), so the op count of a step is a device-free proxy for the host cost that
``docs/profile-ours_full.md``'s host table shows. This tool builds a ``tools/bench_e2e.py``
variant at its ``--smoke`` sizes on the CPU (fp32, gloo, one rank), runs warm-up steps, then
records every aten op of one full step (zero grads, forward + backward through Megatron's
schedule, optimizer step, ``after_step``: the router-bias update) with a ``TorchDispatchMode``.

Each op is attributed to

* the module running it (forward: module hooks keep a stack of module paths, layer indices
  folded to ``*``; backward: the module that created the autograd node, tagged in the forward
  by a ``TorchFunctionMode``), with the module's class;
* the innermost Python function of this repository on the stack (``megatron_ext/``,
  ``kimi_kernels/``); else of Megatron-Core or torch; in backward without a Python frame, the
  autograd node's name (``MulBackward0``);
* the phase: ``zero_grad``, ``forward``, ``backward``, ``optimizer``, ``after_step``.

Ops under ``kimi_kernels/`` (and ``megatron_ext/kda/core.py``) run the PyTorch *reference* on the
CPU, where the GPU runs one or a few Triton kernels: they are marked ``CPU ref`` and summed
separately so readers can discount them. ``views`` counts view/alias ops (no kernel).

    .venv/bin/python tools/dev/count_ops.py --variant ours_full            # top-30 table + totals
    .venv/bin/python tools/dev/count_ops.py --variant ours_full --by module --json /tmp/ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import threading
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PHASES = ("zero_grad", "forward", "backward", "optimizer", "after_step")
_OWN_FILE = str(Path(__file__).resolve())
_REPO_DIRS = tuple(str(REPO / d) + os.sep for d in ("megatron_ext", "kimi_kernels"))
# Where the CPU runs a PyTorch reference of what the GPU does in Triton kernels.
_CPU_REF = (str(REPO / "kimi_kernels") + os.sep, str(REPO / "megatron_ext" / "kda" / "core.py"))
_MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")  # cpu_compat's mode: not a source
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _generic(path: str) -> str:
    """``module.module.decoder.layers.3.mlp`` -> ``decoder.layers.*.mlp`` (wrapper prefixes dropped)."""
    while path.startswith("module."):
        path = path[len("module."):]
    return _INDEX.sub("*", "" if path == "module" else path)


def _caller() -> tuple[str, bool]:
    """``(file:function, cpu_reference)`` of the innermost interesting Python frame."""
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _OWN_FILE and frame.f_code.co_name not in _MODE_HOOKS:
            if name.startswith(_REPO_DIRS):
                rel = os.path.relpath(name, REPO)
                return f"{rel}:{frame.f_code.co_name}", name.startswith(_CPU_REF)
            if fallback is None and ("megatron/core" in name or "torch/optim" in name):
                fallback = f"{name[name.index('megatron/core') if 'megatron/core' in name else name.index('torch/optim'):]}" \
                           f":{frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "", False


class _Tagger(TorchFunctionMode):
    """Forward: labels the autograd nodes of outputs with the running module (and, while active,
    those of custom ``autograd.Function`` outputs, whose ``apply`` no mode sees)."""

    def __init__(self, counter: "OpCounter"):
        super().__init__()
        self.counter = counter

    def tag(self, out) -> None:
        """Label new autograd nodes ``(module, creating function, cpu_ref)``: the running module in the
        forward; in a backward (a reference's backward that differentiates a recomputation), the
        label of the node being run."""
        if not torch.is_grad_enabled():
            return
        label = None
        for t in _tensors(out):
            node = t.grad_fn
            if node is None or "count_ops" in node.metadata:
                continue
            if label is None:
                parent = torch._C._current_autograd_node()
                if parent is not None:
                    label = parent.metadata.get("count_ops") or (f"<untagged {parent.name()}>", "", False)
                else:
                    module = self.counter.module_stack[-1] if self.counter.module_stack else f"<{self.counter.phase}>"
                    label = (module, *_caller())
            node.metadata["count_ops"] = label

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tag(out)
        return out

    def __enter__(self):
        original = torch.autograd.Function.__dict__["apply"]  # a (C) classmethod descriptor
        tagger = self

        def apply(cls, *args, **kwargs):
            out = original.__get__(None, cls)(*args, **kwargs)
            tagger.tag(out)
            return out

        # Torch function modes are off inside backward: a reference's backward that recomputes and
        # differentiates (``torch.autograd.grad``) has its nodes labelled here, as the parent node's.
        original_grad = torch.autograd.grad

        def grad(outputs, *args, **kwargs):
            parent = torch._C._current_autograd_node()
            if parent is not None:
                module = (parent.metadata.get("count_ops") or (f"<untagged {parent.name()}>",))[0]
                _label_graph(outputs, (module, *_caller()))
            return original_grad(outputs, *args, **kwargs)

        self._original, self._original_grad = original, original_grad
        torch.autograd.Function.apply = classmethod(apply)
        torch.autograd.grad = grad
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autograd.Function.apply = self._original
        torch.autograd.grad = self._original_grad
        return super().__exit__(*exc)


def _label_graph(outputs, label) -> None:
    """Label every unlabelled node reachable from ``outputs`` (stops at labelled ones)."""
    todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or "count_ops" in node.metadata:
            continue
        node.metadata["count_ops"] = label
        todo.extend(n for n, _ in node.next_functions)


def _tensors(obj, depth=0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 3:
        for o in obj:
            yield from _tensors(o, depth + 1)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by (phase, module, function) while active; see the module docstring."""

    def __init__(self):
        super().__init__()
        self.module_stack: list[str] = []
        self.phase = "forward"
        self.counts: collections.Counter = collections.Counter()  # (phase, module, fn, cpu_ref, view) -> n
        self.ops: collections.Counter = collections.Counter()  # aten op name -> n
        self.ops_by_fn: collections.Counter = collections.Counter()  # (phase, fn, aten op) -> n, views left out
        self.syncs = 0
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        phase = self.phase
        if node is not None:
            phase = "backward"
            untagged = ("<AccumulateGrad>", "(.grad hooks)", False) if node.name().endswith("AccumulateGrad") \
                else (f"<untagged {node.name()}>", "", False)
            module, creator, ref = node.metadata.get("count_ops") or untagged
            if hasattr(node, "_forward_cls"):  # a custom autograd.Function: its Python backward
                fn, ref = _caller()
            else:  # a C++ node: the Python stack is only the caller of backward; name the creator
                fn = f"{creator or '?'} [bwd]"
        else:
            module = self.module_stack[-1] if self.module_stack and phase == "forward" else ""
            fn, ref = _caller()
        view = bool(getattr(func, "is_view", False))
        with self._lock:  # autograd may run backward nodes on another thread
            self.counts[(phase, module, fn, ref, view)] += 1
            self.ops[str(func.overloadpacket.__name__)] += 1
            if not view:
                self.ops_by_fn[(phase, fn, str(func.overloadpacket.__name__))] += 1
            if func.overloadpacket is torch.ops.aten._local_scalar_dense:
                self.syncs += 1
        return out

    def hook(self, model_chunks) -> list:
        """Forward pre/post hooks on every submodule: the module stack (generic path + class)."""
        handles = []
        for chunk in model_chunks:
            for path, module in chunk.named_modules():
                label = f"{_generic(path) or '<model>'} [{type(module).__name__}]"

                def pre(_m, _args, label=label):
                    self.module_stack.append(label)

                def post(_m, _args, _out):
                    self.module_stack.pop()

                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post, always_call=True))
        return handles


def summarize(counts: collections.Counter, by: str = "source") -> list[dict]:
    """Rows ``{source, ops, views, cpu_ref, phases}``, most ops first; ``ops`` excludes views."""
    rows: dict[str, dict] = {}
    for (phase, module, fn, ref, view), n in counts.items():
        if by == "module":
            key = module or f"<{phase}>"
        elif by == "fn":
            key = fn or "<other>"
        else:
            key = f"{module or '<' + phase + '>'} | {fn or '<other>'}"
        row = rows.setdefault(key, {"source": key, "ops": 0, "views": 0, "cpu_ref": False,
                                    "phases": collections.Counter()})
        row["views" if view else "ops"] += n
        row["cpu_ref"] |= ref
        if not view:
            row["phases"][phase] += n
    return sorted(rows.values(), key=lambda r: (-r["ops"], r["source"]))


def totals(counter: OpCounter) -> dict:
    out = {"ops": 0, "views": 0, "cpu_ref_ops": 0, "syncs": counter.syncs, "phases": {p: 0 for p in PHASES}}
    for (phase, _module, _fn, ref, view), n in counter.counts.items():
        if view:
            out["views"] += n
            continue
        out["ops"] += n
        out["phases"][phase] = out["phases"].get(phase, 0) + n
        if ref:
            out["cpu_ref_ops"] += n
    out["ops_without_cpu_ref"] = out["ops"] - out["cpu_ref_ops"]
    return out


def format_table(rows: list[dict], total: dict, top: int = 30) -> str:
    lines = [f"{'ops':>6} {'views':>6}  {'phases (non-view ops)':<34}  source"]
    for r in rows[:top]:
        phases = " ".join(f"{p[:3]}={n}" for p, n in sorted(r["phases"].items()))
        mark = "  [CPU ref]" if r["cpu_ref"] else ""
        lines.append(f"{r['ops']:>6} {r['views']:>6}  {phases:<34}  {r['source']}{mark}")
    lines.append(f"total: {total['ops']} ops (+{total['views']} views), of which {total['cpu_ref_ops']} in CPU "
                 f"references of GPU kernels -> {total['ops_without_cpu_ref']} ops outside them; "
                 f"host syncs (_local_scalar_dense): {total['syncs']}")
    lines.append("per phase: " + ", ".join(f"{p} {n}" for p, n in total["phases"].items()))
    return "\n".join(lines)


def count_step(variant: str = "ours_full", warmup: int = 2) -> OpCounter:
    """Build ``variant`` at the smoke sizes on the CPU and count the ops of one training step
    after ``warmup`` steps. Initialises (and tears down) Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    from megatron_ext.training.step import forward_backward
    from tools import bench_common, bench_e2e, bench_training, e2e_rows

    args = bench_e2e.parse_args(["--smoke", "--variants", variant])
    bench_common.init_process_group(cuda=False)
    bench_common.init_expert_parallel(seed=1234)
    try:
        setup = e2e_rows.variant_setup(variant, args, cuda=False)
        build, config, after_step, seq, micro_batch = (setup.build, setup.config, setup.after_step, setup.seq,
                                                       setup.micro_batch)
        chunks, optimizer = bench_training.build_training_state(build, config, fast_step=True)
        batch = [bench_training.synthetic_batch(args.sizes["vocab"], seq, micro_batch, torch.device("cpu"))]
        counter = OpCounter()

        def step():
            counter.phase = "zero_grad"
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            counter.phase = "forward"
            forward_backward(chunks, batch, seq, micro_batch)
            counter.phase = "optimizer"
            optimizer.step()
            counter.phase = "after_step"
            if after_step is not None:
                after_step(chunks)

        for _ in range(warmup):
            step()
        handles = counter.hook(chunks)
        try:
            with _Tagger(counter), counter:
                step()
        finally:
            for h in handles:
                h.remove()
        return counter
    finally:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().clear()
        ps.destroy_model_parallel()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="ours_full", choices=("ours_base", "ours_full"))
    p.add_argument("--by", default="source", choices=("source", "module", "fn"),
                   help="group by module + function (default), module only, or function only")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="also write totals and every row here")
    p.add_argument("--ops-of", default=None, metavar="TEXT",
                   help="also list the aten ops (views left out) of functions whose name contains TEXT")
    args = p.parse_args(argv)
    import torch.distributed as dist

    try:
        counter = count_step(args.variant, args.warmup)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    rows, total = summarize(counter.counts, args.by), totals(counter)
    print(f"# aten ops of one ours training step: {args.variant}, smoke sizes, CPU (by {args.by})")
    print(format_table(rows, total, args.top))
    top_ops = ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(15))
    print(f"most frequent aten ops (views included): {top_ops}")
    if args.ops_of:
        print(f"aten ops of functions matching {args.ops_of!r} (phase, function, op: count):")
        for (phase, fn, op), n in sorted(counter.ops_by_fn.items()):
            if args.ops_of in fn:
                print(f"  {phase:<10} {fn:<70} {op:<24} {n}")
    result = {"variant": args.variant, "by": args.by, "total": total,
              "rows": [{**r, "phases": dict(r["phases"])} for r in rows], "aten": dict(counter.ops)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
