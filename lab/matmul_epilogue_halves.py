"""Chapter 07's descriptor kernel finishing each tile in two halves of its columns, or whole.

With 128 x 256 fp16 tiles and GELU the kernel finishing whole tiles took 255 registers a
thread and spilled (CPU compile, ``--compile``): its epilogue held the fp32 accumulator (128
values a thread), its activation and its fp16 copy at once. The package now splits the
accumulator into two 128 x 128 halves (``reshape``, ``permute``, ``split``) and adds the bias,
applies the activation and stores each half in turn (``finish_columns``), through descriptors
of half-width blocks, as Triton's own persistent matmul does with its ``EPILOGUE_SUBTILE``.
Two variants, each the package's kernel with its epilogue's source replaced, in a module of
its own: ``whole``, the whole-tile epilogue it had before; ``mixed``, whole tiles in the
binaries compiled with ``SPLIT_TAIL`` and halves elsewhere (with halves, the split tail gained
less at 3,072³: ``matmul_tail_split_halves.log``). ``mixed`` has not yet run on a GPU.

    python lab/matmul_epilogue_halves.py             # GPU: time; CPU: check
    TRITON_INTERPRET=0 PYTHONPATH=src python lab/matmul_epilogue_halves.py --compile

On a GPU it times the fused linear's forward product (x of 4,096 x K against a 4,096 x K
weight, bias, GELU; K = 1,024 to 8,192) in fp16 and tf32, and square fp16 and bf16 products
without an activation (3,072 to 8,192), in TFLOP/s of GPU time: torch, the package and the
variants, autotuned over the package's configurations, and in fp16 each at one fixed
128 x 256 x 64 tile. ``--compile`` prints registers and spills of each for that tile, with and
without ``SPLIT_TAIL``.
"""

import functools
import itertools
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
import torch.nn.functional as F

HALVES = """        if finish:  # two halves of the columns in turn: fewer registers live at once
            left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            finish_columns(left, outputs, off_m, off_n, bias, EPILOGUE)
            finish_columns(right, outputs, off_m, off_n + BLOCK_N // 2, bias, EPILOGUE)
"""
WHOLE = """        if finish:
            finish_columns(acc, outputs, off_m, off_n, bias, EPILOGUE)
"""
# Whole tiles where the last wave is split (those binaries only), halves elsewhere.
MIXED = (
    "        if SPLIT_TAIL:  # whole tiles\n"
    + WHOLE.replace("        ", "            ", 1).replace("\n        ", "\n            ")
    + HALVES.replace("        if finish:  #", "        else:  #", 1)
)
HALF_BLOCK = "block_shape=[BLOCK_M, BLOCK_N // 2]"
VARIANTS = {  # name: (epilogue, descriptors' block columns)
    "whole": (WHOLE, "BLOCK_N"),
    "mixed": (MIXED, "BLOCK_N if SPLIT_TAIL else BLOCK_N // 2"),
}


@functools.cache
def variant_kernel(name: str):
    """The package's kernel with the epilogue of ``VARIANTS[name]``: ``whole`` as it was
    before the halves; ``mixed`` whole in the binaries that split the last wave."""
    epilogue, columns = VARIANTS[name]
    make_c = "    c_desc = tl.make_tensor_descriptor("
    return sm90.kernel_variant(
        hopper.matmul_tma_kernel,
        f"matmul_{name}",
        [(HALVES, epilogue, 1), (HALF_BLOCK, "block_shape=[BLOCK_M, C_BLOCK_N]", 2),
         (make_c, f"    C_BLOCK_N: tl.constexpr = {columns}\n{make_c}", 1)],
    )  # fmt: skip


def launches(kernel):
    """Within the block ``matmul_tma`` launches ``kernel`` (autotuned or, with ``config``, as is)."""
    tuned = tma_autotuned(kernel, hopper.TMA_CONFIGS)
    return mock.patch.multiple(hopper, matmul_tma_tuned=tuned, matmul_tma_kernel=kernel)


SPLIT = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_SIZE_M": 8, "SPLIT_TAIL": True}  # for check()
FIXED = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_SIZE_M": 8, "num_warps": 8, "num_stages": 3}


def compile_report():
    signature = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "bias_ptr": "*fp16",
                 "pre_ptr": "*fp16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32",
                 "N": "i32", "K": "i32", "stride_a": "i32", "stride_b": "i32", "stride_bias": "i32"}  # fmt: skip
    kernels = {"package": hopper.matmul_tma_kernel, **{name: variant_kernel(name) for name in VARIANTS}}
    for (name, kernel), split in itertools.product(kernels.items(), (False, True)):
        for activation in (None, "gelu"):
            constants = {"A_COLUMN_MAJOR": False, "B_COLUMN_MAJOR": True, "ACTIVATION": activation,
                         "HAS_BIAS": True, "STORE_PREACTIVATION": False, "INPUT_PRECISION": "ieee",
                         "UPCAST": False, "NUM_SMS": 132, "BLOCK_M": 128, "BLOCK_N": 256,
                         "BLOCK_K": 64, "GROUP_SIZE_M": 8, "ACCUMULATE": False, "SPLIT_TAIL": split,
                         "MAX_SPLITS": 8}  # fmt: skip
            compiled = sm90.compile_sm90(kernel, signature, constants, aligned=signature, num_warps=8, num_stages=3)
            usage = sm90.nvidia_tool("cuobjdump", "-res-usage", sm90.cubin_file(compiled))
            regs, stack = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "STACK"))
            print(f"{name:8} SPLIT_TAIL {split!s:5} {activation!s:5}: {regs} registers, {stack} B stack, "
                  f"shared {compiled.metadata.shared:,} B")  # fmt: skip


def check():
    """The variant against the package, with a bias, GELU, the pre-activation and accumulate."""
    x = torch.randn(96, 256, device=DEVICE)  # K = 256: the split check below splits (16 K steps)
    weight = torch.randn(80, 256, device=DEVICE)
    bias = torch.randn(80, device=DEVICE)
    torch.set_float32_matmul_precision("highest")
    expected = hopper.matmul_tma(x, weight.t(), "gelu", bias=bias, return_preactivation=True)
    start = torch.randn(96, 80, device=DEVICE)
    summed = start.clone()
    hopper.launch_tma(x, weight.t(), None, bias, False, accumulate=summed)
    for name in VARIANTS:
        with launches(variant_kernel(name)):
            got = hopper.matmul_tma(x, weight.t(), "gelu", bias=bias, return_preactivation=True)
            other = start.clone()
            hopper.launch_tma(x, weight.t(), None, bias, False, accumulate=other)
            split = hopper.matmul_tma(x, weight.t(), "gelu", bias=bias, config=SPLIT)
        for ours, theirs in zip((*expected, summed), (*got, other), strict=True):
            torch.testing.assert_close(theirs, ours)
        torch.testing.assert_close(split, expected[0], rtol=1e-4, atol=1e-4)
    print(f"the variants match the package ({', '.join(VARIANTS)}; bias, GELU, pre-activation, accumulate, split tail)")


def rates(flops, call, torch_call, fixed_too=True) -> str:
    line = f"torch {bench.rate(flops, torch_call, 'TFLOP/s'):4.0f}"
    for label, fixed in (("", None), (" 128x256x64", FIXED))[: 2 if fixed_too else 1]:
        ours = functools.partial(call, config=fixed)
        line += f"  package{label} {bench.rate(flops, ours, 'TFLOP/s'):4.0f}"
        reference = ours()
        for name in VARIANTS:
            with launches(variant_kernel(name)):
                torch.testing.assert_close(ours().float(), reference.float())
                line += f"  {name}{label} {bench.rate(flops, ours, 'TFLOP/s'):4.0f}"
    return line


def sweep():
    torch.set_float32_matmul_precision("high")
    for dtype in (torch.float16, torch.float32):
        for k_size in (1024, 2048, 4096, 8192):
            x = torch.randn(4096, k_size, device=DEVICE, dtype=dtype)
            weight = torch.randn(4096, k_size, device=DEVICE, dtype=dtype)
            bias = torch.randn(4096, device=DEVICE, dtype=dtype)
            call = functools.partial(hopper.matmul_tma, x, weight.t(), "gelu", bias=bias)
            torch_call = functools.partial(lambda: F.gelu(F.linear(x, weight, bias)))  # noqa: B023
            line = rates(2 * 4096 * 4096 * k_size, call, torch_call, fixed_too=dtype.itemsize == 2)
            print(f"linear {dtype_name(dtype):8} K={k_size:5}: {line}", flush=True)
    for dtype, size in itertools.product((torch.float16, torch.bfloat16), (3072, 4096, 8192)):
        a, b = (torch.randn(size, size, device=DEVICE, dtype=dtype) for _ in "ab")
        line = rates(2 * size**3, functools.partial(hopper.matmul_tma, a, b), functools.partial(torch.matmul, a, b))
        print(f"square {dtype_name(dtype):8} {size}: {line}", flush=True)


if __name__ == "__main__":
    if "--compile" in sys.argv:
        compile_report()
    else:
        check()
        if ON_GPU:
            sweep()
