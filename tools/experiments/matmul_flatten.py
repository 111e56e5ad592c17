"""Does flattening the persistent kernel's two loops hide its epilogue?

``tl.range(..., flatten=True)`` asks Triton's pipeliner to treat the loop over tiles and the
loop over K as one, so that the loads of a program's next tile can be in flight while it
runs the epilogue (bias, activation, stores) of this one. This script times chapter 04's
descriptor kernel with one fixed config, flattened and not, with and without GELU.

    PYTHONPATH=tutorials python tools/experiments/matmul_flatten.py
"""

import kit
import torch

chapter = kit.load_chapter("04")
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_SIZE_M": 8}
CONFIG |= {"num_warps": 8, "num_stages": 3}


def product(size, dtype, activation, flatten):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(kit.DEVICE, dtype)
    b = torch.randn(size, size, generator=generator).to(kit.DEVICE, dtype)
    bias = torch.randn(size, generator=generator).to(kit.DEVICE, dtype)
    config = CONFIG | {"FLATTEN": flatten}
    return lambda: chapter.matmul_tma(a, b, activation, bias=bias, config=config)


def check():
    for activation in (None, "gelu"):
        plain = product(64, torch.float16, activation, False)()
        flat = product(64, torch.float16, activation, True)()
        torch.testing.assert_close(flat, plain, rtol=1e-2, atol=1e-2)
    print("flattened and plain loops give the same product")


check()
if kit.ON_GPU:
    with kit.side_stream():  # as kit.measure does
        for size in (4096, 8192):
            for dtype in (torch.float16, torch.bfloat16):
                for activation in (None, "gelu"):
                    line = f"{kit.dtype_name(dtype)} {size}³ {activation!s:5}:"
                    for flatten in (False, True):
                        call = product(size, dtype, activation, flatten)
                        tflops = kit.rate(2 * size**3, call, "TFLOP/s")
                        line += f"  flatten={flatten!s:5} {tflops:6.1f}"
                    print(line + " TFLOP/s", flush=True)
