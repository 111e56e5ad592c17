"""Chapter 07's persistent descriptor matmul with its loop nest flattened.

Chapter 07's kernel walks its tiles in a loop and each tile's K steps in a loop inside it:
the software pipeliner overlaps the K steps' loads with their products, but a tile's epilogue
(bias, activation, the store of C) waits for its last product, and the next tile's first loads
wait for the epilogue. ``tl.range(..., flatten=True)`` asks Triton to make one loop of the nest,
so the next tile's loads can be in flight during an epilogue. The recordings have ours behind
cuBLAS by 2 to 23% on square fp16 and bf16 products from 2,048 (``matmul-square.csv``).

The variant is the package's kernel, its source changed in one place (the tile loop's
``tl.range`` gains ``flatten=True``; ``WARP_SPECIALIZE`` adds ``warp_specialize=True``),
written to a module of its own so Triton can read its source, and autotuned over the package's
configurations. The package's ``matmul_tma`` then launches it (``variant_launches``).

    python lab/matmul_flatten.py             # GPU: time; CPU: check
    TRITON_INTERPRET=0 PYTHONPATH=src python lab/matmul_flatten.py --compile

``--compile`` compiles the package's kernel and the variants for sm_90 on the CPU machine and
prints whether each compiled, its shared memory, its lines of PTX code and whether they are
the package's. On a GPU it times square products (fp16 and bf16, 2,048 to 8,192) in TFLOP/s
of GPU time: cuBLAS (torch.matmul), the package's ``matmul_tma`` and the variants, after
checking the variants against the package.
"""

import os
import re
import sys
from unittest import mock

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--compile" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import sm90
from stepkernels.lessons import bench
from stepkernels.ops import matmul_hopper as hopper
from stepkernels.ops.matmul_tuning import tma_autotuned
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
import torch

TILE_LOOP = "tl.range(tl.program_id(axis=0), work, NUM_PROGRAMS)"
VARIANTS = {
    "flatten": "flatten=True",
    "flatten + warp_specialize": "flatten=True, warp_specialize=True",
    "warp_specialize": "warp_specialize=True",
}


def variant_kernel(name: str):
    """The package's ``matmul_tma_kernel`` with the tile loop's ``tl.range`` given the
    arguments of ``VARIANTS[name]``, as a ``@triton.jit`` kernel of a module of its own."""
    loop = (TILE_LOOP, TILE_LOOP[:-1] + f", {VARIANTS[name]})", 1)
    return sm90.kernel_variant(hopper.matmul_tma_kernel, f"matmul_{name.replace(' + ', '_')}", [loop])


def autotuned(kernel):
    """``kernel`` autotuned as the package's ``matmul_tma_tuned`` is."""
    return tma_autotuned(kernel, hopper.TMA_CONFIGS)


def variant_launches(tuned):
    """Within the block the package's ``matmul_tma`` launches ``tuned``."""
    return mock.patch.object(hopper, "matmul_tma_tuned", tuned)


def compile_report():
    """Compile each kernel for sm_90 (fp16, 128 x 256 x 64 tiles, 3 stages, 8 warps)."""
    signature = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "bias_ptr": "*fp16",
                 "pre_ptr": "*fp16", "partial_ptr": "*fp32", "counter_ptr": "*i32",
                 "M": "i32", "N": "i32", "K": "i32", "stride_a": "i32",
                 "stride_b": "i32", "stride_bias": "i32"}  # fmt: skip
    constants = {"A_COLUMN_MAJOR": False, "B_COLUMN_MAJOR": False, "ACTIVATION": None,
                 "HAS_BIAS": False, "STORE_PREACTIVATION": False, "INPUT_PRECISION": "ieee",
                 "UPCAST": False, "NUM_SMS": 132, "BLOCK_M": 128, "BLOCK_N": 256,
                 "BLOCK_K": 64, "GROUP_SIZE_M": 8, "ACCUMULATE": False,
                 "SPLIT_TAIL": False, "MAX_SPLITS": 8}  # fmt: skip
    kernels = {"package": hopper.matmul_tma_kernel, **{n: variant_kernel(n) for n in VARIANTS}}
    package_code = None
    for name, kernel in kernels.items():
        try:
            compiled = sm90.compile_sm90(kernel, signature, constants, aligned=signature, num_warps=8, num_stages=3)
        except Exception as error:  # noqa: BLE001 - report and go on
            print(f"{name:28} did not compile: {type(error).__name__}: {str(error)[:200]}")
            continue
        code = ptx_code(compiled.asm["ptx"])
        package_code = package_code or code
        same = "the package's" if code == package_code else "not the package's"
        print(f"{name:28} shared memory {compiled.metadata.shared:7,} B, "
              f"{compiled.metadata.num_warps} warps, PTX {len(code):,} lines, {same}")  # fmt: skip


def ptx_code(ptx: str) -> list:
    """The PTX's lines of code: its debug lines (which name the source file) left out."""
    debug = re.compile(r"\s*(\.loc|\.file|//|\$L__|\.section|\.b8|\.b32|\.b64)")
    return [line for line in ptx.splitlines() if line.strip() and not debug.match(line)]


def check(size=64):
    """The variants against the package (under the interpreter, or on a GPU)."""
    a = torch.randn(size, size, device=DEVICE, dtype=torch.float16)
    b = torch.randn(size, size, device=DEVICE, dtype=torch.float16)
    expected = hopper.matmul_tma(a, b)
    for name in VARIANTS:
        with variant_launches(autotuned(variant_kernel(name))):
            torch.testing.assert_close(hopper.matmul_tma(a, b), expected)
    print(f"the variants match the package ({', '.join(VARIANTS)})")


def sweep():
    tuned = {name: autotuned(variant_kernel(name)) for name in VARIANTS}
    for dtype in (torch.float16, torch.bfloat16):
        for size in (2048, 3072, 4096, 6144, 8192):
            a = torch.randn(size, size, device=DEVICE, dtype=dtype)
            b = torch.randn(size, size, device=DEVICE, dtype=dtype)
            print(f"{dtype_name(dtype):9} {size:5}: {rates(a, b, tuned)}", flush=True)


def rates(a, b, tuned) -> str:
    """TFLOP/s of cuBLAS, the package and each variant on a @ b, checked against cuBLAS."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    line = f"cuBLAS {bench.rate(flops, lambda: a @ b, 'TFLOP/s'):4.0f}"
    line += f"  package {bench.rate(flops, lambda: hopper.matmul_tma(a, b), 'TFLOP/s'):4.0f}"
    for name, kernel in tuned.items():
        try:
            with variant_launches(kernel):
                got = hopper.matmul_tma(a, b)  # autotunes, before the timing's graph
                rate = bench.rate(flops, lambda: hopper.matmul_tma(a, b), "TFLOP/s")
        except Exception as error:  # noqa: BLE001 - a variant that does not compile
            line += f"  {name}: {type(error).__name__}"
            continue
        torch.testing.assert_close(got, a @ b, rtol=2e-2, atol=2e-1)
        line += f"  {name} {rate:4.0f}"
    return line


if __name__ == "__main__":
    if "--compile" in sys.argv:
        compile_report()
    else:
        check()
        if ON_GPU:
            sweep()
