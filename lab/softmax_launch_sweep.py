"""The launch sweep behind chapter 02's ``default_launch`` (GPU only; not part of the gallery).

For each row length N (M = 4,096 rows), dtype and direction, it times every tile of 2K to 32K
values (up to 64 rows) with 2 to 32 warps through the package's fused kernels, and for the
forward also on a persistent grid of 4 programs per SM with a two-stage pipeline (the kernel of
softmax_steps.py), and prints the four fastest next to torch and the package's default. Then
the split backward for long rows (chunk, warps; until 2026-11-25 the package's backward for
long rows was a looped kernel, swept here over stages and programs per SM as well). The split
forward's sweep is softmax_split_rows.py. About four minutes on an H100:

    python lab/softmax_launch_sweep.py [seconds]
"""

import itertools
import sys
import time

from softmax_steps import softmax_persistent
from stepkernels.lessons import bench
from stepkernels.ops.softmax import Launch, default_launch, softmax_backward, softmax_forward
from stepkernels.runtime.core import dtype_name
import torch
import triton


def gb_per_s(fn, nbytes):
    try:
        return bench.rate(nbytes, fn)
    except triton.runtime.errors.OutOfResources:
        return 0.0  # the tile does not fit (shared memory of the pipeline)


def call(launch, x, y, dy, backward, persistent=False):
    if backward:
        return lambda: softmax_backward(y, dy, launch=launch)
    if persistent:
        return lambda: softmax_persistent(x, launch)
    return lambda: softmax_forward(x, launch=launch)


def sweep_short_rows(deadline):
    for backward, dtype, n in itertools.product(
        (False, True), (torch.float32, torch.float16), [2**i for i in range(8, 16)]
    ):
        if time.time() > deadline or (backward and n > 16384):
            continue
        x = torch.randn(4096, n, device="cuda", dtype=dtype)
        y = softmax_forward(x)
        dy = torch.randn_like(y)
        nbytes = (3 if backward else 2) * x.numel() * x.element_size()
        block = max(16, triton.next_power_of_2(n))
        results = []
        for tile, warps, persistent in itertools.product(
            (2048, 4096, 8192, 16384, 32768), (2, 4, 8, 16, 32), (False, True)
        ):
            rows = tile // block
            if not 1 <= rows <= 64 or not 4 <= tile // (32 * warps) <= 64 or (persistent and backward):
                continue
            launch = Launch("fused", block, rows, warps)
            rate = gb_per_s(call(launch, x, y, dy, backward, persistent), nbytes)
            results.append((rate, rows, warps, persistent))
        results.sort(key=lambda result: result[0], reverse=True)
        if backward:
            torch_rate = gb_per_s(lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, dtype), nbytes)  # noqa: B023
        else:
            torch_rate = gb_per_s(lambda: torch.softmax(x, -1), nbytes)  # noqa: B023
        default_rate = gb_per_s(call(default_launch(n, backward), x, y, dy, backward), nbytes)
        best = "  ".join(f"{g:5.0f} rows={r} warps={w} persistent={p}" for g, r, w, p in results[:4])
        print(
            f"{'bwd' if backward else 'fwd'} {dtype_name(dtype):8} N={n:6} "
            f"torch {torch_rate:5.0f} default {default_rate:5.0f} | {best}",
            flush=True,
        )


def sweep_long_rows(deadline):
    for dtype, n in itertools.product((torch.float32, torch.float16), (32768, 65536, 262144)):
        if time.time() > deadline:
            continue
        x = torch.randn(2**26 // n, n, device="cuda", dtype=dtype)
        y = softmax_forward(x)
        dy = torch.randn_like(y)
        nbytes = 3 * x.numel() * x.element_size()
        results = []
        for chunk, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16)):
            if not 4 <= chunk // (32 * warps) <= 64:
                continue
            launch = Launch("split", chunk, num_warps=warps)
            results.append((gb_per_s(call(launch, x, y, dy, True), nbytes), chunk, warps))
        results.sort(key=lambda result: result[0], reverse=True)
        best = "  ".join(f"{g:5.0f} chunk={c} warps={w}" for g, c, w in results[:4])
        print(f"long bwd {dtype_name(dtype):8} N={n:6} | {best}", flush=True)


def main():
    deadline = time.time() + (float(sys.argv[1]) if len(sys.argv) > 1 else 600)
    sweep_short_rows(deadline)
    sweep_long_rows(deadline)


if __name__ == "__main__":
    main()
