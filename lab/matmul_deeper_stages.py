"""Chapter 07's fp16 and bf16 tiles with a deeper pipeline, and another tile order, on squares.

The package's large fp16 tile, 128 x 256 x 64, runs 3 stages: 3 x 48 KB of operands in shared
memory, plus the epilogue's half tile. A fourth stage (192 KB of operands) may still fit the
H100's 227 KB and hide more of each load's latency; ``GROUP_SIZE_M`` sets how many row blocks
of C share the B tiles in L2. This times, on square products 2,048 to 8,192 (TFLOP/s of GPU
time), cuBLAS, the autotuned package, and ``launch_tma`` at fixed configs; a config that does
not fit says so.

    python lab/matmul_deeper_stages.py           # GPU: time; CPU: check one config
    python lab/matmul_deeper_stages.py --chosen  # what the autotuner picks, twice

``--chosen`` tunes each square product three times from scratch (the autotuner's choice and
the lean launcher's kernels forgotten between) and prints each choice with its rate: the
first run found the fixed 128 x 256 x 64 / 3-stage launch up to 5% ahead of the autotuned
package at 4,096³ to 8,192³.
"""

import functools
import sys

from stepkernels.lessons import bench
from stepkernels.ops.matmul_hopper import launch_tma, matmul_tma, matmul_tma_tuned
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_SIZE_M)
CONFIGS = [(128, 256, 64, 3, 8, 8), (128, 256, 64, 4, 8, 8), (256, 128, 64, 4, 8, 8),
           (128, 256, 64, 3, 8, 16), (128, 256, 64, 3, 8, 4), (128, 128, 64, 6, 8, 8)]  # fmt: skip
SIZES = bench.choose(gpu=[2048, 3072, 4096, 6144, 8192], cpu=[96])


def config_kwargs(block_m, block_n, block_k, stages, warps, group):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_SIZE_M": group,
            "num_warps": warps, "num_stages": stages}  # fmt: skip


def main():
    for dtype in (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16,):
        for size in SIZES:
            a, b = (torch.randn(size, size, device=DEVICE, dtype=dtype) for _ in "ab")
            flops = 2 * size**3
            want = matmul_tma(a, b)
            line = f"{str(dtype)[6:]:8} {size}: cuBLAS "
            if ON_GPU:
                line += f"{bench.rate(flops, functools.partial(torch.matmul, a, b), 'TFLOP/s'):4.0f}"
                line += f"  package {bench.rate(flops, functools.partial(matmul_tma, a, b), 'TFLOP/s'):4.0f} |"
            for config in CONFIGS if ON_GPU else CONFIGS[:1]:
                name = "{}x{}x{}/{}s/{}w/g{}".format(*config)
                call = functools.partial(launch_tma, a, b, None, None, False, config_kwargs(*config))
                try:
                    torch.testing.assert_close(call().float(), want.float(), rtol=2e-2, atol=5e-1)
                    line += f" {name} {bench.rate(flops, call, 'TFLOP/s'):4.0f}" if ON_GPU else f" {name} ok"
                except Exception as error:  # noqa: BLE001  (does not fit: say so, go on)
                    line += f" {name} {type(error).__name__}"
            print(line, flush=True)


def chosen():
    for dtype in (torch.float16, torch.bfloat16):
        for size in SIZES:
            a, b = (torch.randn(size, size, device=DEVICE, dtype=dtype) for _ in "ab")
            line = f"{str(dtype)[6:]:8} {size}:"
            for _ in range(3):
                matmul_tma_tuned.forget()
                rate = bench.rate(2 * size**3, functools.partial(matmul_tma, a, b), "TFLOP/s")
                kwargs = matmul_tma_tuned.kernel.best_config.all_kwargs()
                shown = "x".join(str(kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
                shown += f"/{kwargs['num_stages']}s/{kwargs['num_warps']}w"
                shown += "".join(
                    f" {k}" for k in ("SPLIT_TAIL", "PROGRAMS_PER_SM") if kwargs.get(k, 1) not in (1, False)
                )
                line += f"  {shown} {rate:4.0f} |"
            print(line, flush=True)


if __name__ == "__main__":
    chosen() if "--chosen" in sys.argv and ON_GPU else main()
