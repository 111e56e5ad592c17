"""Where do small problems and forward+backward through autograd lose their time? (GPU only.)

On the H100, chapter 02's softmax (now ``stepkernels.softmax``) ran at a fraction of its kernels'
speed in two places: short rows (N = 512: 174 GB/s through ``softmax``) and forward+backward
through ``torch.autograd.grad``
(fp16, N = 4,096: 272 GB/s), and so did dropout's forward+backward at 2^20 elements. This
script times one case several ways, so that the cost can be pinned on the CPU path (Python
wrapper, Triton's launcher), on autograd's device thread, or on the GPU:

    python lab/autograd_path.py

Each line prints do_bench's median (L2 flushed before each call, as the chapters time), the
same function replayed from a CUDA graph (GPU time alone, no CPU in the loop) and the CPU time
of one call with nothing waiting on the GPU.
"""

import sys
import threading

from stepkernels import softmax
from stepkernels.lessons import bench
from stepkernels.ops.softmax import default_launch, softmax_backward, softmax_forward, softmax_kernel
from stepkernels.runtime.core import dtype_name
import torch
import triton


def graph_us(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn) * 1e3
    except Exception as error:  # noqa: BLE001  (report, do not stop)
        print(f"    (no CUDA graph: {type(error).__name__}: {str(error)[:80]})")
        return float("nan")


def report(name, fn, nbytes):
    fn()
    ms = triton.testing.do_bench(fn)
    graph = graph_us(fn)
    print(
        f"  {name:<46} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:6.0f} GB/s | graph "
        f"{graph:7.1f} us {nbytes / graph / 1e3:6.0f} GB/s | CPU {bench.cpu_us(fn):7.1f} us",
        flush=True,
    )


def short_rows(dtype, n_cols, n_rows=4096):
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    size = x.numel() * x.element_size()
    launch = default_launch(n_cols)
    grid = (triton.cdiv(n_rows, launch.rows),)

    def bare():
        softmax_kernel[grid](
            x, y, n_rows, n_cols, x.stride(0), y.stride(0),
            ROWS=launch.rows, BLOCK_N=launch.block_n, LOG=False, num_warps=launch.num_warps,
        )  # fmt: skip

    print(f"softmax forward {dtype_name(dtype)} {n_rows} x {n_cols}: {launch}")
    report("softmax() (checks + autograd.Function)", lambda: softmax(x), 2 * size)
    report("softmax_forward() (wrapper)", lambda: softmax_forward(x), 2 * size)
    report("softmax_kernel[grid](...) alone", bare, 2 * size)
    report("torch.softmax", lambda: torch.softmax(x, -1), 2 * size)
    report("torch.empty_like alone", lambda: torch.empty_like(x), 2 * size)


def forward_backward(dtype, n_cols, n_rows=4096):
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    y = softmax_forward(x.detach())
    size = x.numel() * x.element_size()
    print(f"softmax forward+backward {dtype_name(dtype)} {n_rows} x {n_cols}")
    report("forward kernel (wrapper)", lambda: softmax_forward(x.detach()), 2 * size)
    report("backward kernel (wrapper)", lambda: softmax_backward(y, dy), 3 * size)
    report("both wrappers, no autograd", lambda: softmax_backward(
        softmax_forward(x.detach()), dy), 5 * size)  # fmt: skip
    for label, fn in (("triton", softmax), ("torch", lambda t: torch.softmax(t, -1))):
        report(f"{label}: autograd.grad", lambda fn=fn: torch.autograd.grad(fn(x), x, dy), 5 * size)
        report(f"{label}: backward()", lambda fn=fn: fn(x).backward(dy), 5 * size)
        with torch.autograd.set_multithreading_enabled(False):
            report(
                f"{label}: autograd.grad, no device thread",
                lambda fn=fn: torch.autograd.grad(fn(x), x, dy),
                5 * size,
            )
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        report(f"{label}: autograd.grad, GIL switch 1 us", lambda fn=fn: torch.autograd.grad(fn(x), x, dy), 5 * size)
        sys.setswitchinterval(old)


def launch_paths():
    """CPU time of one call of the package's public functions, at sizes where the GPU work is small."""
    from stepkernels import dropout, layer_norm, matmul

    a, b = (torch.randn(1024, 1024, device="cuda", dtype=torch.float16) for _ in range(2))
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.float16)
    w, bias = torch.ones(1024, device="cuda", dtype=x.dtype), torch.zeros(1024, device="cuda", dtype=x.dtype)
    print("launch paths (1,024^3 fp16 matmul; 4,096 x 1,024 fp16 rows):")
    calls = {
        "matmul (autotuned)": lambda: matmul(a, b),
        "torch.matmul": lambda: a @ b,
        "layer_norm (autograd.Function)": lambda: layer_norm(x, 1024, w, bias),
        "torch layer_norm": lambda: torch.nn.functional.layer_norm(x, (1024,), w, bias),
        "softmax_forward (kernel wrapper)": lambda: softmax_forward(x),
        "softmax (autograd.Function)": lambda: softmax(x),
        "torch.softmax": lambda: torch.softmax(x, -1),
        "dropout (seeded)": lambda: dropout(x, 0.5, 1234),
        "torch dropout": lambda: torch.nn.functional.dropout(x, 0.5),
    }
    for name, fn in calls.items():
        try:
            fn()
            print(f"  {name:<44} CPU {bench.cpu_us(fn):7.1f} us per call", flush=True)
        except Exception as error:  # noqa: BLE001
            print(f"  {name:<44} failed: {type(error).__name__}: {str(error)[:100]}")


def main():
    print(f"python {sys.version.split()[0]}, switch interval {sys.getswitchinterval()} s")
    print("threads:", [t.name for t in threading.enumerate()])
    short_rows(torch.float32, 512)
    short_rows(torch.float16, 4096)
    for dtype in (torch.float16, torch.float32):
        forward_backward(dtype, 4096)
    launch_paths()
    print("threads now:", [t.name for t in threading.enumerate()])

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, requires_grad=True)
        dy = torch.randn_like(x)
        for _ in range(20):
            torch.autograd.grad(softmax(x), x, dy)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
