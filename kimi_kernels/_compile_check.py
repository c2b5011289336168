"""Compile a Triton kernel for a GPU target on a machine without a GPU, and read its resource usage.

triton.compile runs the whole pipeline (frontend to cubin with triton's bundled ptxas) from a signature;
ptxas -v on the same PTX reports registers and spill bytes, which a GPU-less test can then bound.
"""

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass
class Resources:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared: int  # bytes of shared memory Triton asked for


def compile_for(kernel, signature: dict, constexprs: dict, num_warps=4, num_stages=3, capability=90, aligned=(),
                maxnreg=None):
    """triton.compile for CUDA `capability` (default sm_90). signature: arg name -> type (e.g. "*bf16", "i32");
    constexpr args go in `constexprs` and need not be in `signature`. `aligned`: argument names to specialize
    as the launcher does for a pointer aligned to 16 bytes or an integer that is a multiple of 16
    (tt.divisibility 16), so that loads vectorize as they will at such shapes. `maxnreg`: a register cap, as the
    launch option of that name."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    sig = {name: sig[name] for name in kernel.arg_names}  # kernel's argument order
    attrs = {}
    for name in aligned:  # a tuple of pointers: each of its members
        index = kernel.arg_names.index(name)
        members = [(index, j) for j in range(len(sig[name]))] if isinstance(sig[name], tuple) else [(index,)]
        attrs.update({key: [["tt.divisibility", 16]] for key in members})
    source = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", capability, 32)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=target, options=options)


def _ptxas():
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def resources(compiled, capability=90) -> Resources:
    """Registers and spill bytes of a compiled kernel (ptxas -v on its PTX)."""
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as fh:
            fh.write(compiled.asm["ptx"])
        out = subprocess.run([_ptxas(), "-v", f"-arch={arch}", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    num = lambda pattern: int(re.search(pattern, out).group(1)) if re.search(pattern, out) else 0  # noqa: E731
    return Resources(registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                     spill_loads=num(r"(\d+) bytes spill loads"), shared=compiled.metadata.shared)


def triton_release() -> tuple[int, int]:
    """(major, minor) of the Triton doing the compiling. Register use and spills differ between releases: the
    compile tests also run against the GPU machine's release (tests/kernels/test_device_triton.py), and a bound
    that differs names the release it holds for."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)
