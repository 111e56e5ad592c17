"""Where does forward+backward through autograd lose its time? (GPU only; not part of the gallery.)

On the H100, softmax forward+backward through ``torch.autograd.grad`` ran at a fraction of
what its two kernels reach when launched directly (chapter 02), and so did layer norm's and
dropout's backward. This script times one case several ways, so that the cost can be pinned
on autograd's device thread, on the Python wrapper, or on Triton's launcher:

    PYTHONPATH=tutorials python tools/experiments/autograd_path.py

Each line prints the median time of do_bench (L2 flushed) and the CPU time of one call.
"""

import time

import kit
import torch
import triton

softmax_chapter = kit.load_chapter("02")


def cpu_us(fn, calls=200):
    """CPU time of one call, with the GPU drained before and after the loop."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cpu = time.perf_counter() - start
    torch.cuda.synchronize()
    return cpu / calls * 1e6


def report(name, fn, nbytes):
    ms = triton.testing.do_bench(fn)
    print(f"  {name:<44} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:8.0f} GB/s   CPU {cpu_us(fn):7.1f} us")


def case(dtype, n_cols, n_rows=4096):
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    y = softmax_chapter.softmax_forward(x.detach())
    size = x.numel() * x.element_size()
    print(f"softmax {kit.dtype_name(dtype)} {n_rows} x {n_cols}")
    report("forward kernel", lambda: softmax_chapter.softmax_forward(x.detach()), 2 * size)
    report("backward kernel", lambda: softmax_chapter.softmax_backward(y, dy), 3 * size)
    report("forward through softmax()", lambda: softmax_chapter.softmax(x.detach()), 2 * size)
    for label, fn in (("triton", softmax_chapter.softmax), ("torch", lambda t: torch.softmax(t, -1))):
        report(f"{label}: autograd.grad", lambda fn=fn: torch.autograd.grad(fn(x), x, dy), 5 * size)
        with torch.autograd.set_multithreading_enabled(False):
            report(
                f"{label}: autograd.grad, no device thread",
                lambda fn=fn: torch.autograd.grad(fn(x), x, dy),
                5 * size,
            )


for dtype in (torch.float16, torch.float32):
    for n_cols in (1024, 4096):
        case(dtype, n_cols)

with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
) as prof:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(x)
    for _ in range(20):
        torch.autograd.grad(softmax_chapter.softmax(x), x, dy)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
