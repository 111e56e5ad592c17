"""How fast is chapter 04's matmul for each operand order, fp32 (tf32) and fp16?

Chapter 05's backward reads transposed operands through strides: dX = dZ W with W row-major,
dW = dZ^T X with dZ^T column-major. On the H100 its fp32 forward+backward ran at 66
TFLOP/s where torch ran at 280. This script times one 4,096³ product for each of the four
orders of A (row- or column-major) and B, through the descriptor kernel alone (operands as
given), through ``matmul`` (which copies fp32 operands that are not K-major), through the
portable kernel, and through torch, all as the chapters time them (GPU time of CUDA-graph
replays). Under the interpreter it checks that every order gives the same product.

    PYTHONPATH=tutorials python tools/experiments/matmul_operand_order.py
"""

import kit
import torch

chapter = kit.load_chapter("04")
SIZE = kit.choose(gpu=4096, cpu=48)


def orders(dtype):
    """(name, a, b) for A and B each row- or column-major, same values."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=generator).to(kit.DEVICE, dtype)
    b = torch.randn(SIZE, SIZE, generator=generator).to(kit.DEVICE, dtype)
    for a_name, a_view in (("A row", a), ("A col", a.mT.contiguous().mT)):
        for b_name, b_view in (("B row", b), ("B col", b.mT.contiguous().mT)):
            yield f"{a_name}, {b_name}", a_view, b_view


def check():
    for dtype in (torch.float32, torch.float16):
        results = [chapter.matmul(a, b) for _, a, b in orders(dtype)]
        for result in results[1:]:  # exact under the interpreter; tf32/fp16 rounding on a GPU
            tolerance = kit.choose(gpu=dict(rtol=1e-2, atol=0.1), cpu=dict(rtol=0, atol=0))
            torch.testing.assert_close(result, results[0], **tolerance)
    print("every operand order gives the same product (fp32, fp16)")


def rates(a, b):
    """TFLOP/s of a @ b: descriptor kernel as given (if it applies), matmul, portable, torch."""
    calls = [lambda: chapter.matmul(a, b), lambda: chapter.matmul_portable(a, b), lambda: a @ b]
    if chapter.tma_applies(a, b):
        calls.insert(0, lambda: chapter.matmul_tma(a, b))
    return " | ".join(f"{kit.rate(2 * SIZE**3, call, 'TFLOP/s'):6.1f}" for call in calls)


def sweep(dtype):
    print(f"{kit.dtype_name(dtype)} {SIZE}³, TFLOP/s: descriptor kernel as given | matmul | "
          "portable | torch")  # fmt: skip
    for name, a, b in orders(dtype):
        print(f"  {name}: {rates(a, b)}", flush=True)


check()
if kit.ON_GPU:
    torch.set_float32_matmul_precision("high")  # tf32 for torch too
    with kit.side_stream():  # as kit.measure does
        for dtype in (torch.float32, torch.float16):
            sweep(dtype)
