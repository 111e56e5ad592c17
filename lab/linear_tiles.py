"""Tiles for chapter 05's fused linear on the descriptor kernel: does another tile catch cuBLAS?

Run on a GPU from the repository root (``PYTHONPATH=src``)::

    python lab/linear_tiles.py

The recorded fused linear (M = N = 4,096, GELU) trails cuBLAS by 25 to 35% in fp32 (tf32)
and by 2 to 6% in fp16. The descriptor kernel's autotuner chooses among two tf32 tiles and
five fp16 ones (chapter 07's TMA_CONFIGS). This times ``matmul_tma`` with each of a wider set
of tiles, next to the autotuned call and torch (``F.linear`` then ``F.gelu``), at K = 1,024 to
8,192; tiles that do not fit in shared memory are skipped with a note.
"""

import itertools

from stepkernels.lessons import bench
from stepkernels.ops.matmul import ON_HOPPER
from stepkernels.ops.matmul_hopper import matmul_tma
import torch
import torch.nn.functional as F

TILES = {  # itemsize: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
    4: [(128, 128, 32, 3, 8), (128, 64, 32, 4, 4), (128, 128, 32, 4, 8), (128, 128, 32, 5, 8),
        (128, 256, 32, 2, 8), (256, 128, 32, 2, 8), (128, 128, 64, 2, 8), (128, 128, 64, 3, 8),
        (256, 64, 32, 4, 8), (64, 256, 32, 4, 8), (128, 128, 16, 6, 8)],
    2: [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 5, 8),
        (128, 128, 128, 3, 8), (128, 256, 64, 2, 8), (256, 128, 64, 2, 8)],
}  # fmt: skip


def config(tile, group=8):
    block_m, block_n, block_k, stages, warps = tile
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "GROUP_SIZE_M": group, "num_stages": stages, "num_warps": warps}  # fmt: skip


def time_one(dtype, k):
    m = n = 4096
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    calls = {
        "torch": lambda: F.gelu(F.linear(x, w, b)),
        "autotuned": lambda: matmul_tma(x, w.mT, "gelu", bias=b),
    }
    for tile, group in itertools.product(TILES[dtype.itemsize], (8,)):
        chosen = config(tile, group)
        calls[str(tile)] = lambda c=chosen: matmul_tma(x, w.mT, "gelu", bias=b, config=c)
    rates = {}
    for name, fn in calls.items():
        try:
            rates[name] = bench.per_time(2 * m * n * k, bench.measure_ms(fn)[0], "TFLOP/s")
        except Exception as error:  # too much shared memory, say
            print(f"  {name}: {type(error).__name__} {str(error).splitlines()[0][:70]}")
    best = sorted(rates.items(), key=lambda item: -item[1])
    shown = "  ".join(f"{name} {rate:.0f}" for name, rate in best[:6])
    print(
        f"{str(dtype)[6:]} K={k}: torch {rates['torch']:.0f} autotuned {rates['autotuned']:.0f} | {shown}", flush=True
    )


def main() -> None:
    if not ON_HOPPER:
        print("needs a Hopper GPU (the descriptor kernel)")
        return
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # tf32, as the chapter's benchmark
    try:
        for dtype in (torch.float32, torch.float16):
            for k in (1024, 2048, 4096, 8192):
                time_one(dtype, k)
    finally:
        torch.set_float32_matmul_precision(precision)


if __name__ == "__main__":
    main()
