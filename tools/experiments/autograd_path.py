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


def launch_paths():
    """CPU time of one call of each chapter's entry points, at sizes where the GPU work is small."""
    matmul_chapter = kit.load_chapter("04")
    layer_norm_chapter = kit.load_chapter("03")
    a, b = (torch.randn(1024, 1024, device="cuda", dtype=torch.float16) for _ in range(2))
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.float16)
    w, bias = torch.ones(1024, device="cuda", dtype=x.dtype), torch.zeros(1024, device="cuda", dtype=x.dtype)
    print("launch paths (1,024^3 fp16 matmul; 4,096 x 1,024 fp16 rows):")
    calls = {
        "matmul (TMA kernel, autotuned)": lambda: matmul_chapter.matmul(a, b),
        "matmul_portable (autotuned)": lambda: matmul_chapter.matmul_portable(a, b),
        "torch.matmul": lambda: a @ b,
        "layer_norm_forward (kernel wrapper)": lambda: layer_norm_chapter.layer_norm_forward(x, w, bias, 1e-5),
        "layer_norm (autograd.Function)": lambda: layer_norm_chapter.layer_norm(x, 1024, w, bias),
        "torch layer_norm": lambda: torch.nn.functional.layer_norm(x, (1024,), w, bias),
        "softmax_forward (kernel wrapper)": lambda: softmax_chapter.softmax_forward(x),
        "torch.softmax": lambda: torch.softmax(x, -1),
    }
    for name, fn in calls.items():
        fn()
        print(f"  {name:<44} CPU {cpu_us(fn):7.1f} us per call")


for dtype in (torch.float16, torch.float32):
    for n_cols in (1024, 4096):
        case(dtype, n_cols)
launch_paths()

with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
) as prof:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(x)
    for _ in range(20):
        torch.autograd.grad(softmax_chapter.softmax(x), x, dy)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
