"""How fast is the package's matmul for each operand order, fp32 (as tf32) and fp16?

Chapter 05's backward reads transposed operands through strides: dX = dZ W with W row-major,
dW = dZ^T X with dZ^T column-major. On Hopper, tf32 wants both operands K-major (A row-major,
B column-major). This script times one 4,096³ product for each of the four orders of A and B:
through the descriptor kernel with the operands as given (``matmul_tma`` would copy them, so
this launches ``launch_tma`` directly), through ``matmul`` (which copies fp32 operands that
are not K-major), through the portable kernel, and through torch, all as the chapters time
them (GPU time of CUDA-graph replays, L2 flushed), with torch's fp32 matmul precision at
"high" (tf32) for every provider. Under the interpreter it checks that every order gives the
same product.

    python lab/matmul_operand_order.py
"""

from stepkernels.lessons import bench
from stepkernels.ops.matmul import matmul, matmul_portable, matmul_portable_tuned
from stepkernels.ops.matmul_hopper import launch_tma, matmul_tma_tuned, tma_applies
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
import torch

SIZE = bench.choose(gpu=4096, cpu=48)


def orders(dtype):
    """(name, a, b) for A and B each row- or column-major, same values."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=generator).to(DEVICE, dtype)
    b = torch.randn(SIZE, SIZE, generator=generator).to(DEVICE, dtype)
    for a_name, a_view in (("A row", a), ("A col", a.mT.contiguous().mT)):
        for b_name, b_view in (("B row", b), ("B col", b.mT.contiguous().mT)):
            yield f"{a_name}, {b_name}", a_view, b_view


def check():
    for dtype in (torch.float32, torch.float16):
        results = [matmul(a, b) for _, a, b in orders(dtype)]
        for result in results[1:]:  # exact under the interpreter; tf32/fp16 rounding on a GPU
            tolerance = bench.choose(gpu=dict(rtol=1e-2, atol=0.1), cpu=dict(rtol=0, atol=0))
            torch.testing.assert_close(result, results[0], **tolerance)
    print("every operand order gives the same product (fp32, fp16)")


def forget_tuning():
    """The autotuners key on shape and precision, not on the order of A and B, and the lean
    launcher (chapter 08) keeps what they chose: forget both, so that each call is tuned for
    the operands it gets."""
    for tuner in (matmul_tma_tuned, matmul_portable_tuned):
        tuner.forget()


def rates(a, b):
    """TFLOP/s of a @ b: descriptor kernel as given (if it applies), matmul, portable, torch,
    each tuned for itself."""
    calls = [lambda: matmul(a, b), lambda: matmul_portable(a, b), lambda: a @ b]
    if tma_applies(a, b):
        calls.insert(0, lambda: launch_tma(a, b, None, None, False))
    timed = []
    for call in calls:
        forget_tuning()
        timed.append(f"{bench.rate(2 * SIZE**3, call, 'TFLOP/s'):6.1f}")
    return " | ".join(timed)


def sweep(dtype):
    print(f"{dtype_name(dtype)} {SIZE}³, TFLOP/s: descriptor kernel as given | matmul | portable | torch")
    for name, a, b in orders(dtype):
        print(f"  {name}: {rates(a, b)}", flush=True)


def main():
    check()
    if ON_GPU:
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")  # tf32 for matmul and torch alike
        try:
            with bench.side_stream():  # as bench.measure does
                for dtype in (torch.float32, torch.float16):
                    sweep(dtype)
        finally:
            torch.set_float32_matmul_precision(precision)


if __name__ == "__main__":
    main()
