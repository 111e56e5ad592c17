"""Chapter 07's persistent descriptor kernel with two programs an SM instead of one.

Our kernel has no warp specialization on Hopper (Triton 3.6 does not apply it there:
``matmul_flatten_compile.log``), so while a program runs a tile's epilogue (bias, activation,
stores) its SM's tensor cores wait. cuBLAS's Hopper kernels overlap the two. Two programs an SM
whose tiles fit the SM's shared memory and registers twice over can do so by occupancy: while
one finishes a tile, the other multiplies. The package launches one program an SM
(``launch_tma``: ``programs = sm_count()``); this script times fixed fp16 configurations with
one and with two programs an SM (``sm_count`` patched), in TFLOP/s of GPU time, against torch
and the autotuned package: the fused linear's forward products (x of 4,096 x K against a
4,096 x K weight, bias, GELU; K = 1,024 to 8,192) and square products (2,048 to 8,192).

    python lab/matmul_two_per_sm.py            # GPU: time; CPU: check
    python lab/matmul_two_per_sm.py --chosen   # the autotuner's choice
    python lab/matmul_two_per_sm.py --tf32     # fp32 inputs as tf32

``--chosen`` prints, for the fused linear's forward products, the config the package's
autotuner picks (with the two-per-SM config among them since) and the package's rate.
``--tf32`` times the fused linear's forward products in fp32 under
``torch.set_float32_matmul_precision("high")`` with tf32 tiles (32-wide K steps of 4-byte
values) that fit an SM twice, where the package has no two-per-SM config yet.
"""

import functools
import itertools
import sys
from unittest import mock

from stepkernels.lessons import bench
from stepkernels.ops import matmul_hopper as hopper
from stepkernels.runtime.core import DEVICE, ON_GPU, sm_count
import torch
import torch.nn.functional as F

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): shared memory for two programs an SM, at most
# 2 x ~113 KB (stages x (BM x BK + BK x BN) x 2 bytes, and half a C tile for the epilogue).
CONFIGS = [(128, 128, 64, 3, 4), (128, 128, 64, 3, 8), (128, 128, 64, 2, 4), (64, 256, 64, 2, 4),
           (128, 256, 64, 3, 8)]  # fmt: skip
# tf32: 98 to 115 KB of shared memory each (Triton 3.9's count compiling for sm_90 here), so two
# fit an SM; the last, the package's first tf32 tile, takes 131 KB: one an SM only.
TF32_CONFIGS = [(128, 128, 32, 2, 8), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (128, 64, 32, 3, 4),
                (128, 128, 32, 3, 8)]  # fmt: skip


def config_kwargs(block_m, block_n, block_k, stages, warps):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_SIZE_M": 8,
            "num_warps": warps, "num_stages": stages}  # fmt: skip


def per_sm(programs: int):
    """Within the block ``launch_tma`` runs ``programs`` programs an SM."""
    return mock.patch.object(hopper, "sm_count", lambda: programs * sm_count())


def line_for(flops, call, torch_call, configs):
    line = f"torch {bench.rate(flops, torch_call, 'TFLOP/s'):4.0f}  package {bench.rate(flops, call, 'TFLOP/s'):4.0f}"
    reference = call().float()
    for config in configs:
        fixed = functools.partial(call, config=config_kwargs(*config))
        line += f" | {config[0]}x{config[1]}x{config[2]}/{config[3]}s/{config[4]}w"
        for programs in (1, 2):
            with per_sm(programs):
                torch.testing.assert_close(fixed().float(), reference, rtol=2e-2, atol=2e-1)
                line += f" {bench.rate(flops, fixed, 'TFLOP/s'):4.0f}"
    return line


def check():
    a, b = torch.randn(96, 64, device=DEVICE), torch.randn(64, 80, device=DEVICE)
    bias = torch.randn(80, device=DEVICE)
    want = hopper.matmul_tma(a, b, "gelu", bias=bias)
    with per_sm(2):
        got = hopper.matmul_tma(a, b, "gelu", bias=bias, config=config_kwargs(16, 16, 16, 2, 4))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    print("two programs an SM give the package's product (bias, GELU)")


def sweep():
    for k_size in (1024, 2048, 4096, 8192):
        x, weight = (torch.randn(4096, k_size, device=DEVICE, dtype=torch.float16) for _ in "xw")
        bias = torch.randn(4096, device=DEVICE, dtype=torch.float16)
        call = functools.partial(hopper.matmul_tma, x, weight.t(), "gelu", bias=bias)
        torch_call = functools.partial(lambda: F.gelu(F.linear(x, weight, bias)))  # noqa: B023
        print(f"linear K={k_size:5}: " + line_for(2 * 4096 * 4096 * k_size, call, torch_call, CONFIGS), flush=True)
    for size, dtype in itertools.product((2048, 3072, 4096, 8192), (torch.float16,)):
        a, b = (torch.randn(size, size, device=DEVICE, dtype=dtype) for _ in "ab")
        call = functools.partial(hopper.matmul_tma, a, b)
        line = line_for(2 * size**3, call, functools.partial(torch.matmul, a, b), CONFIGS)
        print(f"square {size}: {line}", flush=True)


def tf32_sweep():
    torch.set_float32_matmul_precision("high")
    for k_size in (1024, 2048, 4096, 8192):
        x, weight = (torch.randn(4096, k_size, device=DEVICE) for _ in "xw")
        bias = torch.randn(4096, device=DEVICE)
        call = functools.partial(hopper.matmul_tma, x, weight.t(), "gelu", bias=bias)
        torch_call = functools.partial(lambda: F.gelu(F.linear(x, weight, bias)))  # noqa: B023
        print(
            f"linear tf32 K={k_size:5}: " + line_for(2 * 4096 * 4096 * k_size, call, torch_call, TF32_CONFIGS),
            flush=True,
        )


def chosen():
    tuner = hopper.matmul_tma_tuned.kernel
    for k_size in (1024, 2048, 4096, 8192):
        x, weight = (torch.randn(4096, k_size, device=DEVICE, dtype=torch.float16) for _ in "xw")
        bias = torch.randn(4096, device=DEVICE, dtype=torch.float16)
        call = functools.partial(hopper.matmul_tma, x, weight.t(), "gelu", bias=bias)
        call()
        print(k_size, tuner.best_config, f"{bench.rate(2 * 4096 * 4096 * k_size, call, 'TFLOP/s'):.0f}", flush=True)


if __name__ == "__main__":
    check()
    if ON_GPU:
        if "--chosen" in sys.argv:
            chosen()
        else:
            tf32_sweep() if "--tf32" in sys.argv else sweep()
