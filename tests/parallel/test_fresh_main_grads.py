"""use_fresh_main_grads: Megatron DDP with the step's first gradients copied into the buffer (no zero fill)
gives the same main_grad as Megatron's fill-and-add, across micro-batches, a weight used twice in one
forward, and a weight that gets no gradient in a step (it must read zero, not last step's value)."""

import subprocess
import sys

from tests._dist import free_port

SCRIPT = """
import torch, torch.distributed as dist
from megatron_ext import cpu_compat, speed_patches
assert cpu_compat.install()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))
    def forward(self, x, use_c):
        y = self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))  # a twice: two contributions, one backward
        return self.c(y) if use_c else y

def run(fresh):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), Toy())
    if fresh:
        assert speed_patches.use_fresh_main_grads(ddp)
    gen = torch.Generator().manual_seed(1)
    grads = []
    for step, use_c in enumerate((True, False, True)):  # c gets no gradient in the middle step
        ddp.zero_grad_buffer()
        for micro in range(2):
            ddp(torch.randn(4, 8, generator=gen), use_c).square().sum().backward()
        ddp.finish_grad_sync()
        grads.append({{n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}})
    return grads

stock, fresh = run(False), run(True)
for s, f in zip(stock, fresh):
    for name in s:
        assert torch.equal(s[name], f[name]), name
assert all(g.abs().sum() == 0 for n, g in stock[1].items() if n.startswith("c."))  # what the test relies on
assert all(g.abs().sum() > 0 for n, g in stock[0].items())
print("ok")
"""


def test_fresh_main_grads_equal_megatrons_fill_and_add():
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(port=free_port())], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
