"""Chapter 07's persistent kernel with its last wave split along K, against no split.

The descriptor kernel compiled with ``SPLIT_TAIL`` splits the tiles of its last wave into
shares of their K steps when that wave would leave at least half the SMs idle (``tail_split``;
at most ``MAX_SPLITS`` shares a tile); the autotuner times each tile with and without. This
times, in TFLOP/s of GPU time:

* square fp16 and bf16 products (2,048 to 8,192) for each fp16 tile of ``TMA_CONFIGS``
  without the split and with ``MAX_SPLITS`` of 4, 8 and 16, the autotuned package, and cuBLAS;
* the fused linear's products (M = N = 4,096, GELU, K = 1,024 to 8,192) in fp16 and tf32,
  autotuned with and without the split configs, against torch;

after checking each split result against the unsplit one and that two calls give the same
bits. ``--compile`` compiles the kernel for sm_90 on the CPU machine and prints registers,
spills and shared memory with and without the split code.

    python lab/matmul_tail_split.py          # GPU: time; CPU: check
    python lab/matmul_tail_split.py --size=3072   # those squares only
    TRITON_INTERPRET=0 PYTHONPATH=src python lab/matmul_tail_split.py --compile
"""

import functools
import os
import re
import sys

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
import triton

MAX_SPLITS = (4, 8, 16)


def compile_report():
    for dtype, tile, precision in (("fp16", (128, 256, 64, 3, 8), "ieee"),
                                   ("fp16", (128, 128, 64, 4, 8), "ieee"),
                                   ("fp32", (128, 128, 32, 5, 8), "tf32")):  # fmt: skip
        signature = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
                     "bias_ptr": f"*{dtype}", "pre_ptr": f"*{dtype}", "partial_ptr": "*fp32",
                     "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                     "stride_a": "i32", "stride_b": "i32", "stride_bias": "i32"}  # fmt: skip
        bm, bn, bk, stages, warps = tile
        for activation, split in ((None, False), (None, True), ("gelu", False), ("gelu", True)):
            constants = {"A_COLUMN_MAJOR": False, "B_COLUMN_MAJOR": dtype == "fp32",
                         "ACTIVATION": activation, "HAS_BIAS": activation is not None,
                         "STORE_PREACTIVATION": False, "INPUT_PRECISION": precision,
                         "UPCAST": False, "NUM_SMS": 132, "BLOCK_M": bm, "BLOCK_N": bn,
                         "BLOCK_K": bk, "GROUP_SIZE_M": 8, "ACCUMULATE": False,
                         "SPLIT_TAIL": split, "MAX_SPLITS": 8}  # fmt: skip
            compiled = sm90.compile_sm90(hopper.matmul_tma_kernel, signature, constants,
                                         aligned=signature, num_warps=warps, num_stages=stages)  # fmt: skip
            usage = sm90.nvidia_tool("cuobjdump", "-res-usage", sm90.cubin_file(compiled))
            regs = re.search(r"REG:(\d+)", usage).group(1)
            stack = re.search(r"STACK:(\d+)", usage).group(1)
            print(f"{dtype} {bm} x {bn} x {bk} {stages} stages {warps} warps, {activation}, "
                  f"SPLIT_TAIL {split!s:5}: {regs} registers, {stack} B stack, "
                  f"shared {compiled.metadata.shared:,} B", flush=True)  # fmt: skip


def config_kwargs(config, max_splits):
    """``config`` as ``matmul_tma`` takes it; ``max_splits`` 1: the last wave not split."""
    split = {"SPLIT_TAIL": max_splits > 1, "MAX_SPLITS": max_splits}
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages, **split}


def tiles_and_tail(size_m, size_n, config):
    tiles = triton.cdiv(size_m, config.kwargs["BLOCK_M"]) * triton.cdiv(size_n, config.kwargs["BLOCK_N"])
    return tiles, tiles % hopper.sm_count()


def same_twice(call):
    first = call()
    assert torch.equal(call(), first), "two calls differ"
    return first


def square(dtype, size):
    a = torch.randn(size, size, device=DEVICE, dtype=dtype)
    b = torch.randn(size, size, device=DEVICE, dtype=dtype)
    flops = 2 * size**3
    line = f"{dtype_name(dtype):9} {size:5}:"
    if ON_GPU:
        line += f" cuBLAS {bench.rate(flops, lambda: a @ b, 'TFLOP/s'):4.0f}"
        line += f"  package {bench.rate(flops, lambda: hopper.matmul_tma(a, b), 'TFLOP/s'):4.0f}"
    print(line, flush=True)
    configs = [c for c in hopper.TMA_CONFIGS if c.itemsize == 2 and not c.kwargs.get("SPLIT_TAIL")]
    for config in configs if ON_GPU else configs[:1]:
        tiles, tail = tiles_and_tail(size, size, config)
        k = config.kwargs
        line = (f"    {k['BLOCK_M']:3} x {k['BLOCK_N']:3} x {k['BLOCK_K']} {config.num_stages}s "
                f"{config.num_warps}w, {tiles} tiles, tail {tail:3}:")  # fmt: skip
        whole = functools.partial(hopper.matmul_tma, a, b, config=config_kwargs(config, 1))
        unsplit = same_twice(whole)
        if ON_GPU:
            line += f"  unsplit: {bench.rate(flops, whole, 'TFLOP/s'):4.0f}"
        for splits in MAX_SPLITS:
            call = functools.partial(hopper.matmul_tma, a, b, config=config_kwargs(config, splits))
            torch.testing.assert_close(same_twice(call).float(), unsplit.float(), rtol=1e-2, atol=1e-1)
            if ON_GPU:
                line += f"  {splits:2}: {bench.rate(flops, call, 'TFLOP/s'):4.0f}"
        print(line, flush=True)


def unsplit_tuned():
    """The package's autotuned kernel without the configs that split the last wave."""
    configs = [c for c in hopper.TMA_CONFIGS if not c.kwargs.get("SPLIT_TAIL")]
    return tma_autotuned(hopper.matmul_tma_kernel, configs)


def linear(dtype, k_size, unsplit):
    """The fused linear's forward product: x (4,096 x K) @ W^T, bias, GELU, as chapter 05."""
    m = n = 4096 if ON_GPU else 64
    x = torch.randn(m, k_size, device=DEVICE, dtype=dtype)
    weight = torch.randn(n, k_size, device=DEVICE, dtype=dtype)
    bias = torch.randn(n, device=DEVICE, dtype=dtype)
    flops = 2 * m * n * k_size
    ours = lambda: hopper.matmul_tma(x, weight.t(), "gelu", bias=bias)  # noqa: E731
    split = same_twice(ours)
    line = f"{dtype_name(dtype):9} K={k_size:5}:"
    if ON_GPU:
        line += f" torch {bench.rate(flops, lambda: F.gelu(F.linear(x, weight, bias)), 'TFLOP/s'):4.0f}"
        line += f"  split {bench.rate(flops, ours, 'TFLOP/s'):4.0f}"
    from unittest import mock

    with mock.patch.object(hopper, "matmul_tma_tuned", unsplit):
        plain = same_twice(ours)
        if ON_GPU:
            line += f"  unsplit {bench.rate(flops, ours, 'TFLOP/s'):4.0f}"
    torch.testing.assert_close(split.float(), plain.float(), rtol=2e-2, atol=2e-1)
    print(line, flush=True)


def main():
    sizes = [int(a.split("=")[1]) for a in sys.argv if a.startswith("--size=")]  # e.g. --size=3072
    for dtype in (torch.float16, torch.bfloat16):
        for size in sizes or ((2048, 3072, 4096, 6144, 8192) if ON_GPU else (96,)):
            square(dtype, size)
    if sizes:  # the squares asked for only
        return
    unsplit = unsplit_tuned()
    torch.set_float32_matmul_precision("high")
    for dtype in (torch.float16, torch.float32):
        for k_size in (1024, 2048, 4096, 8192) if ON_GPU else (64,):
            linear(dtype, k_size, unsplit)


if __name__ == "__main__":
    if "--compile" in sys.argv:
        compile_report()
    else:
        main()
