"""A launch sweep for chapter 03's layer norm kernels (GPU only; not part of the gallery).

Times the forward and the backward kernels launched directly (no autograd) at M = 4,096 rows
for N = 1,024 to 65,536 in fp16 and fp32, over rows per program, warps and, for the lock-based
backward, GROUP_SIZE_M; prints the four fastest next to ``torch`` and the chapter's default:

    PYTHONPATH=tutorials python tools/experiments/layer_norm_launch_sweep.py [seconds]
"""

import itertools
import sys
import time

import kit
import torch
import triton

chapter = kit.load_chapter("03")
deadline = time.time() + (float(sys.argv[1]) if len(sys.argv) > 1 else 600)
ROWS = 4096


def gb_per_s(fn, nbytes):
    try:
        return nbytes / kit.measure_ms(fn)[0] / 1e6  # GPU time, as the chapters measure
    except triton.runtime.errors.OutOfResources:
        return 0.0


def configs(n_cols, backward):
    block = triton.next_power_of_2(n_cols)
    largest = chapter.BACKWARD_MAX_BLOCK if backward else chapter.FORWARD_MAX_BLOCK
    if block <= largest:
        row_choices = (1, 2, 4, 8, 16, 32, 64) if backward else (1, 2, 4, 8, 16)
        for rows, warps in itertools.product(row_choices, (1, 2, 4, 8, 16, 32)):
            per_thread = (block if backward else rows * block) // (32 * warps)
            if 4 <= per_thread <= 64 and (backward or rows * block <= 16384):
                yield dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, SINGLE_BLOCK=True, num_warps=warps)
    for walk, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
        if walk < n_cols and 4 <= walk // (32 * warps) <= 64:
            for rows in (1, 8, 32) if backward else (1,):
                yield dict(BLOCK_N=walk, ROWS_PER_PROGRAM=rows, SINGLE_BLOCK=False, num_warps=warps)


def describe(config):
    return f"block={config['BLOCK_N']} rows={config['ROWS_PER_PROGRAM']} warps={config['num_warps']}"


def sweep_forward(x, weight, bias):
    n_cols, size = x.shape[1], x.numel() * x.element_size()
    rates = sorted(
        (gb_per_s(lambda c=c: chapter.layer_norm_forward(x, weight, bias, 1e-5, config=c), 2 * size), describe(c))
        for c in configs(n_cols, backward=False)
    )[::-1]
    default = gb_per_s(lambda: chapter.layer_norm_forward(x, weight, bias, 1e-5), 2 * size)
    torch_rate = gb_per_s(lambda: torch.nn.functional.layer_norm(x, (n_cols,), weight, bias), 2 * size)
    best = "  ".join(f"{g:5.0f} {d}" for g, d in rates[:4])
    print(f"fwd {kit.dtype_name(x.dtype):8} N={n_cols:6} torch {torch_rate:5.0f} default {default:5.0f} | {best}")


def sweep_backward(x, dy, weight, mean, rstd, reduction, group):
    n_cols, size = x.shape[1], x.numel() * x.element_size()

    def call(config=None):
        return lambda: chapter.layer_norm_backward(
            dy, x, weight, mean, rstd, reduction=reduction, group_size_m=group, config=config
        )

    rates = sorted((gb_per_s(call(c), 3 * size), describe(c)) for c in configs(n_cols, backward=True))[::-1]
    default = gb_per_s(call(), 3 * size)
    best = "  ".join(f"{g:5.0f} {d}" for g, d in rates[:4])
    print(f"bwd {reduction:9} G={group} {kit.dtype_name(x.dtype):8} N={n_cols:6} default {default:5.0f} | {best}")


# The chapter's headline sizes first, then the rest, as long as time allows.
for dtype, n_cols in itertools.product((torch.float16, torch.float32), [1024, 4096, 16384, 2048, 8192, 32768, 65536]):
    if time.time() > deadline:
        print("time up")
        break
    x = torch.randn(ROWS, n_cols, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    weight = torch.rand(n_cols, device="cuda", dtype=dtype)
    bias = torch.rand(n_cols, device="cuda", dtype=dtype)
    _, mean, rstd = chapter.layer_norm_forward(x, weight, bias, 1e-5)
    sweep_forward(x, weight, bias)
    for reduction, group in (("two-stage", None), ("lock", 32), ("lock", 128)):
        sweep_backward(x, dy, weight, mean, rstd, reduction, group)
    print(flush=True)
