"""Where the fused linear's fp32 (tf32) forward + backward loses to torch: its parts, timed apart.

Chapter 05's fp32 forward + backward runs 19 to 25% behind torch and torch.compile, its
forward 2 to 12%. The step has three products: the forward Z = X W^T (+ bias, GELU), the
input's gradient dX = dZ W and the weight's dW = dZ^T X. Hopper's tf32 instructions read both
operands K-major from shared memory, so ``tma_operands`` copies what is not: W^T for dX, and dZ
and X for dW (the reduction runs over the 4,096 tokens, along their columns). This script times,
at M = N = 4,096 and each K, in GPU time:

* each product as the package runs it (``matmul``: the copies, then the autotuned kernel), the
  copies alone, the kernel alone on operands already K-major, and torch's product (cuBLAS) on
  the same layouts;
* the kernel alone at fixed tf32 tiles, among them 256 x 128 x 32, which the package does not
  list, and 128 x 128 x 32 / 2 stages / 8 warps at two programs an SM;
* first, ``row_major`` (the copy, a transpose in memory) at several tiles against torch's
  ``contiguous()`` and a plain copy of the same bytes.

Run 1 (the first log) timed the package before ``row_major`` and the 128 x 256 x 32 tile.

    python lab/linear_tf32_parts.py     # GPU: time; CPU: check the products
"""

import functools

from stepkernels.lessons import bench
from stepkernels.ops.matmul import matmul
from stepkernels.ops.matmul_hopper import launch_tma, row_major, tma_operands
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

M = N = bench.choose(gpu=4096, cpu=64)
K_VALUES = bench.choose(gpu=[1024, 2048, 4096, 8192], cpu=[32])
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, programs an SM)
TILES = [(128, 128, 32, 5, 8, 1), (64, 256, 32, 4, 8, 1), (128, 256, 32, 3, 8, 1),
         (256, 128, 32, 3, 8, 1), (128, 128, 32, 2, 8, 2), (128, 64, 32, 4, 4, 2)]  # fmt: skip
# (BLOCK_R, BLOCK_C, warps) of ``row_major``, the package's first
TRANSPOSE_TILES = [(64, 64, 4), (32, 32, 4), (64, 64, 8), (128, 64, 8), (64, 128, 8), (128, 128, 8),
                   (32, 128, 4), (128, 32, 4)]  # fmt: skip


def tile_config(block_m, block_n, block_k, stages, warps, per_sm):
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_SIZE_M": 8,
              "num_warps": warps, "num_stages": stages}  # fmt: skip
    return config | ({"PROGRAMS_PER_SM": per_sm} if per_sm > 1 else {})


def products(k_size):
    """name -> (a, b, activation, bias) of the step's three products at this K."""
    x, weight = (torch.randn(M, k_size, device=DEVICE) for _ in "xw")
    grad_z, bias = torch.randn(M, N, device=DEVICE), torch.randn(N, device=DEVICE)
    return {
        "forward Z = X W^T": (x, weight.mT, "gelu", bias),
        "dX = dZ W": (grad_z, weight, None, None),
        "dW = dZ^T X": (grad_z.mT, x, None, None),
    }


def line(name, k_size, a, b, activation, bias):
    flops = 2 * a.shape[0] * b.shape[1] * a.shape[1]
    rate = lambda call: bench.rate(flops, call, "TFLOP/s")  # noqa: E731
    a_k, b_k = tma_operands(a, b)
    package = functools.partial(matmul, a, b, activation, bias=bias)
    kernel = functools.partial(launch_tma, a_k, b_k, activation, bias, False)
    if activation is None:
        torch_call = functools.partial(torch.matmul, a, b)
    else:
        torch_call = lambda: torch.nn.functional.gelu(torch.addmm(bias, a, b))  # noqa: E731
    copied = sum(t.data_ptr() != k.data_ptr() for t, k in ((a, a_k), (b, b_k)))
    copy_us = bench.measure_ms(lambda: tma_operands(a, b))[0] * 1e3 if copied else 0.0
    text = (f"K={k_size:5} {name:18}: torch {rate(torch_call):4.0f}  package {rate(package):4.0f}"
            f"  kernel alone {rate(kernel):4.0f}  copies {copy_us:5.1f} us ({copied}) |")  # fmt: skip
    for tile in TILES:
        try:
            fixed = functools.partial(launch_tma, a_k, b_k, activation, bias, False, tile_config(*tile))
            text += f" {tile[0]}x{tile[1]}x{tile[2]}/{tile[3]}s/{tile[4]}w/{tile[5]} {rate(fixed):4.0f}"
        except Exception as error:  # noqa: BLE001  (a tile that does not fit: say so, go on)
            text += f" {tile[0]}x{tile[1]}x{tile[2]}/{tile[3]}s/{tile[4]}w/{tile[5]} {type(error).__name__}"
    return text


def transposes():
    """GB/s (read + write) of a column-major fp32 matrix made row-major: torch's
    ``contiguous()``, ``row_major`` at several tiles, and a plain copy of the same bytes."""
    for rows, cols in ((4096, 1024), (4096, 4096), (4096, 8192)):
        t = torch.randn(cols, rows, device=DEVICE).mT  # rows x cols, column-major
        nbytes = 2 * t.numel() * t.element_size()
        text = (f"transpose {rows} x {cols} fp32, GB/s: copy {bench.rate(nbytes, bench.copy_of(nbytes)):5.0f}"
                f"  torch contiguous() {bench.rate(nbytes, t.contiguous):5.0f} |")  # fmt: skip
        for block_r, block_c, warps in TRANSPOSE_TILES:
            call = functools.partial(row_major, t, block_r, block_c, warps)
            text += f" {block_r}x{block_c}/{warps}w {bench.rate(nbytes, call):5.0f}"
        print(text, flush=True)


def check():
    for a, b, activation, bias in products(K_VALUES[0]).values():
        want = a @ b if bias is None else torch.addmm(bias, a, b)
        want = torch.nn.functional.gelu(want) if activation else want
        a_k, b_k = tma_operands(a, b)
        for tile in TILES[:1] + TILES[-1:]:
            got = launch_tma(a_k, b_k, activation, bias, False, tile_config(*tile))
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-1)
    print("the three products match torch at a one- and a two-an-SM tile (tf32 tolerances)")


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    check()
    if ON_GPU:
        transposes()
        for k_size in K_VALUES:
            for name, args in products(k_size).items():
                print(line(name, k_size, *args), flush=True)
