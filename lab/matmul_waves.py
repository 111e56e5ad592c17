"""Each of chapter 07's fp16 tiles at the square sizes where ours trails cuBLAS most.

The persistent descriptor kernel runs ``min(SMs, tiles)`` programs, each taking every SM-th
output tile. At 3,072³ with 128 x 256 tiles there are 288 tiles for 132 SMs: two full waves
and a third with 24 tiles, so most SMs idle for a third of the time. This script times every
fp16 configuration of ``TMA_CONFIGS`` alone (no autotuning) at 2,048³, 3,072³ and 4,096³,
with its tile count and the share of the last wave that has work, next to cuBLAS.

    python lab/matmul_waves.py     # GPU: time; CPU: check one config
"""

import functools

from stepkernels.lessons import bench
from stepkernels.ops import matmul_hopper as hopper
from stepkernels.runtime.core import DEVICE, ON_GPU, sm_count
import torch
import triton

FP16_CONFIGS = [c for c in hopper.TMA_CONFIGS if c.itemsize == 2]


def config_kwargs(config):
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def waves(size, config):
    tiles = triton.cdiv(size, config.kwargs["BLOCK_M"]) * triton.cdiv(size, config.kwargs["BLOCK_N"])
    full, last = divmod(tiles, sm_count())
    return tiles, full + (last > 0), (last or sm_count()) / sm_count()


def main():
    sizes = (2048, 3072, 4096) if ON_GPU else (64,)
    for size in sizes:
        a = torch.randn(size, size, device=DEVICE, dtype=torch.float16)
        b = torch.randn(size, size, device=DEVICE, dtype=torch.float16)
        flops = 2 * size**3
        expected = a.float() @ b.float()
        cublas = functools.partial(torch.matmul, a, b)
        print(f"{size}: cuBLAS {bench.rate(flops, cublas, 'TFLOP/s'):.0f}" if ON_GPU else f"{size}:")
        for config in FP16_CONFIGS if ON_GPU else FP16_CONFIGS[:1]:
            kwargs = config_kwargs(config)
            out = hopper.matmul_tma(a, b, config=kwargs)
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-1)
            tiles, wave_count, last_share = waves(size, config)
            k = config.kwargs
            line = (f"  {k['BLOCK_M']:3} x {k['BLOCK_N']:3} x {k['BLOCK_K']:2}, {config.num_stages} stages, "
                    f"{config.num_warps} warps: {tiles:4} tiles, {wave_count} waves, "
                    f"last {last_share:4.0%} full")  # fmt: skip
            if ON_GPU:
                call = functools.partial(hopper.matmul_tma, a, b, config=kwargs)
                line += f": {bench.rate(flops, call, 'TFLOP/s'):.0f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
