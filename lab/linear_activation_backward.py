"""Chapter 05's activation backward (dZ = dY * act'(Z) and db's block sums) over launches.

    python lab/linear_activation_backward.py    # GPU: time; CPU: check

In the fused linear's backward this kernel is the one pass over memory among three matrix
products: at M = N = 4,096 fp16 it reads dY and Z and writes dZ, 96 MB. This script times
``activation_backward`` (the kernel, then torch's sum of the block sums) with GELU and db at
M = N = 4,096 in fp16 and fp32 over block shapes and warps, the package's launch first, in
GB/s of those compulsory bytes, against a copy of as many bytes.
"""

from unittest import mock

from stepkernels.lessons import bench
from stepkernels.ops import linear  # the module, not the function
from stepkernels.runtime import core
import torch

LAUNCHES = [(64, 64, 4), (32, 128, 4), (16, 256, 4), (8, 512, 4), (32, 256, 8), (64, 128, 8), (16, 512, 8)]


def launch(block_m, block_n, warps):
    block = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps}
    return mock.patch.dict(linear.ACTIVATION_BACKWARD_BLOCK, block)


def check():
    grad_y, z = (torch.randn(70, 300, device=core.DEVICE) for _ in "yz")
    want = linear.activation_backward(grad_y, z, "gelu", True)
    for block_m, block_n, warps in LAUNCHES[1:3]:
        with launch(block_m, block_n, warps):
            got = linear.activation_backward(grad_y, z, "gelu", True)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    print("other launches give the package's dZ and db")


if __name__ == "__main__":
    check()
    if core.ON_GPU:
        with bench.side_stream():
            for dtype in (torch.float16, torch.float32):
                grad_y, z = (torch.randn(4096, 4096, device="cuda", dtype=dtype) for _ in "yz")
                nbytes = 3 * z.numel() * z.element_size()
                line = f"{core.dtype_name(dtype)}: copy {bench.rate(nbytes, bench.copy_of(nbytes)):,.0f}"
                for block_m, block_n, warps in LAUNCHES:
                    with launch(block_m, block_n, warps):
                        call = lambda: linear.activation_backward(grad_y, z, "gelu", True)  # noqa: B023, E731
                        line += f"  {block_m}x{block_n}/{warps}w {bench.rate(nbytes, call):,.0f}"
                print(line, flush=True)
