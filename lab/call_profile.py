"""Where the CPU time of one call goes, for every operation of the package (GPU only).

Each line is the CPU time of one call, issued back to back (``bench.cpu_us``), with each layer
of the call peeled off in turn: the public function, the wrapper without autograd, the bare
``kernel[grid](...)`` launch, and the launch of the already compiled kernel, which skips the
JIT's argument binding. torch's own operation is timed beside it. Then ``cProfile`` names the
Python functions that take the time (autograd's engine runs on the calling thread while
profiling, so the backward is seen too).

    python lab/call_profile.py [--profile]
"""

import cProfile
import pstats
import sys

from stepkernels import dropout, layer_norm, linear, matmul, softmax
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm as layer_norm_module
from stepkernels.ops import matmul as matmul_module
from stepkernels.ops import softmax as softmax_module
import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def line(label, fn):
    print(f"  {label:<58} {bench.cpu_us(fn, calls=500):7.1f} µs", flush=True)


@triton.jit
def empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def empty_kernel_12(a, b, c, d, e, f, n1, n2, n3, n4, n5, n6, X: tl.constexpr, Y: tl.constexpr):
    pass


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def launches():
    x = torch.empty(1024, device="cuda")
    print("launch of an empty kernel")
    line("empty_kernel[(1,)](x, n, BLOCK=1024)", lambda: empty_kernel[(1,)](x, 1024, BLOCK=1024))
    compiled = empty_kernel[(1,)](x, 1024, BLOCK=1024)
    runner = compiled[(1, 1, 1)]
    line("compiled[(1, 1, 1)](x, n, 1024)  (CompiledKernel runner)", lambda: runner(x, 1024, 1024))
    stream = torch.cuda.current_stream().cuda_stream
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    line(
        "compiled.run(...) with a cached stream",
        lambda: run(1, 1, 1, stream, function, packed, None, None, None, x, 1024, 1024),
    )
    twelve = (x, x, x, x, x, x, 1024, 1024, 1024, 1024, 1024, 1024)
    line("empty_kernel_12[(1,)](6 tensors, 6 ints, 2 constexprs)", lambda: empty_kernel_12[(1,)](*twelve, X=1, Y=2))
    compiled12 = empty_kernel_12[(1,)](*twelve, X=1, Y=2)
    runner12 = compiled12[(1, 1, 1)]
    line("  its compiled runner", lambda: runner12(*twelve, 1, 2))
    line("torch.empty_like(x)", lambda: torch.empty_like(x))
    line("x.stride(0), x.shape, x.dtype", lambda: (x.stride(0), x.shape, x.dtype))
    line("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)
    xg = torch.randn(64, device="cuda", requires_grad=True)
    dy = torch.randn(64, device="cuda")
    line("Identity.apply(x) (autograd.Function, Python forward)", lambda: Identity.apply(xg))
    line("autograd.grad(Identity.apply(x), x, dy)", lambda: torch.autograd.grad(Identity.apply(xg), xg, dy))
    line("autograd.grad(x * 2, x, dy)", lambda: torch.autograd.grad(xg * 2, xg, dy))


def lean_path(rows=4096, cols=1024):
    """The pieces of a ``lean`` launch, each timed alone."""
    from triton.runtime.driver import driver

    x = torch.randn(rows, cols, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    kernel = softmax_module.softmax_kernel
    args, meta = (x, y, rows, cols, cols, cols), dict(ROWS=4, BLOCK_N=1024, LOG=False, num_warps=4)
    grid = (rows // 4,)
    print("lean launch of softmax_kernel, piece by piece")
    line("kernel[grid](...) (LeanKernel)", lambda: kernel[grid](*args, **meta))
    line("kernel.kernel[grid](...) (Triton's JITFunction)", lambda: kernel.kernel[grid](*args, **meta))
    print(f"  launch keys cached: {len(kernel.entries)}")
    device = driver.active.get_current_device()
    line("LeanKernel.key(...)", lambda: kernel.key(args, meta, device))
    line("driver.active.get_current_device()", driver.active.get_current_device)
    line("driver.active.get_current_stream(device)", lambda: driver.active.get_current_stream(device))
    line("triton.knobs.runtime.launch_enter_hook", lambda: triton.knobs.runtime.launch_enter_hook)
    line("torch.compiler.is_compiling()", torch.compiler.is_compiling)
    compiled, tail, _ = next(iter(kernel.entries.values()))  # noqa: RUF015
    stream = driver.active.get_current_stream(device)
    run = lambda: compiled.run(
        grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail
    )
    line("compiled.run(...)", run)


def softmax_calls(rows=4096, cols=1024, dtype=torch.float16):
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)
    y = softmax(x)
    print(f"softmax {rows} x {cols} fp16")
    line("torch.softmax(x, -1)", lambda: torch.softmax(x, -1))
    line("softmax(x)", lambda: softmax(x))
    with torch.no_grad():
        line("softmax(x) under no_grad", lambda: softmax(x))
    line("softmax_forward(x) (wrapper, no autograd)", lambda: softmax_module.softmax_forward(x))
    launch = softmax_module.default_launch(cols)
    grid = (triton.cdiv(rows, launch.rows),)
    kernel_args = (x, y, rows, cols, cols, cols)
    meta = dict(ROWS=launch.rows, BLOCK_N=launch.block_n, LOG=False, num_warps=launch.num_warps)
    line("softmax_kernel[grid](...) alone", lambda: softmax_module.softmax_kernel[grid](*kernel_args, **meta))
    compiled = softmax_module.softmax_kernel[grid](*kernel_args, **meta)
    runner = compiled[(grid[0], 1, 1)]
    line("  its compiled runner", lambda: runner(*kernel_args, launch.rows, launch.block_n, False))
    line("torch: autograd.grad(torch.softmax(x), x, dy)", lambda: torch.autograd.grad(torch.softmax(xg, -1), xg, dy))
    line("ours: autograd.grad(softmax(x), x, dy)", lambda: torch.autograd.grad(softmax(xg), xg, dy))
    line("softmax_backward(y, dy) (wrapper)", lambda: softmax_module.softmax_backward(y, dy))
    return lambda: torch.autograd.grad(softmax(xg), xg, dy)


def layer_norm_calls(rows=4096, cols=1024, dtype=torch.float16):
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    w = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)
    print(f"layer_norm {rows} x {cols} fp16, weight and bias")
    line("F.layer_norm", lambda: F.layer_norm(x, (cols,), w, b))
    line("layer_norm", lambda: layer_norm(x, (cols,), w, b))
    wd, bd = w.detach(), b.detach()
    with torch.no_grad():
        line("layer_norm under no_grad", lambda: layer_norm(x, (cols,), wd, bd))
    line("layer_norm_forward (wrapper)", lambda: layer_norm_module.layer_norm_forward(x, wd, bd, 1e-5, None))
    _, mean, rstd = layer_norm_module.layer_norm_forward(x, wd, bd, 1e-5, None)
    line("layer_norm_backward (wrapper)", lambda: layer_norm_module.layer_norm_backward(dy, x, wd, mean, rstd))
    line(
        "torch: autograd.grad(F.layer_norm)",
        lambda: torch.autograd.grad(F.layer_norm(xg, (cols,), w, b), (xg, w, b), dy),
    )
    line("ours: autograd.grad(layer_norm)", lambda: torch.autograd.grad(layer_norm(xg, (cols,), w, b), (xg, w, b), dy))
    return lambda: torch.autograd.grad(layer_norm(xg, (cols,), w, b), (xg, w, b), dy)


def matmul_calls(size=1024, dtype=torch.float16):
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    bm = torch.randn(size, size, device="cuda", dtype=dtype)
    print(f"matmul {size}³ fp16")
    line("torch.mm", lambda: torch.mm(a, bm))
    line("matmul(a, b)", lambda: matmul(a, bm))
    line("launch_portable (autotuned kernel)", lambda: matmul_module.launch_portable(a, bm, None, None, False))
    x = torch.randn(4096, size, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(size, size, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(size, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(4096, size, device="cuda", dtype=dtype)
    print(f"linear 4096 x {size} -> {size} fp16, bias, gelu")
    ref = lambda: F.gelu(F.linear(x, w, bias), approximate="tanh")
    line("torch: gelu(F.linear)", ref)
    line("linear(x, w, b, 'gelu')", lambda: linear(x, w, bias, "gelu"))
    with torch.no_grad():
        line("linear under no_grad", lambda: linear(x, w, bias, "gelu"))
    line("torch: autograd.grad", lambda: torch.autograd.grad(ref(), (x, w, bias), dy))
    line("ours: autograd.grad", lambda: torch.autograd.grad(linear(x, w, bias, "gelu"), (x, w, bias), dy))
    return lambda: torch.autograd.grad(linear(x, w, bias, "gelu"), (x, w, bias), dy)


def dropout_calls(n=2**22, dtype=torch.float16):
    x = torch.randn(n, device="cuda", dtype=dtype)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)
    print("dropout 2^22 fp16, p = 0.1")
    line("F.dropout", lambda: F.dropout(x, 0.1))
    line("dropout(x, 0.1, seed)", lambda: dropout(x, 0.1, 123))
    line("torch: autograd.grad(F.dropout)", lambda: torch.autograd.grad(F.dropout(xg, 0.1), xg, dy))
    line("ours: autograd.grad(dropout)", lambda: torch.autograd.grad(dropout(xg, 0.1, 123), xg, dy))
    return lambda: torch.autograd.grad(dropout(xg, 0.1, 123), xg, dy)


def profile(label, fn, calls=300):
    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {calls} calls: {label} (tottime per call in µs, top 16)")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:16]
    for (file, lineno, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{file.split('site-packages/')[-1].split('stepkernels/')[-1]}:{lineno}({name})"
        print(
            f"  {tottime / calls * 1e6:7.2f} tot {cumtime / calls * 1e6:7.2f} cum  {ncalls / calls:5.1f}x  {where[:90]}"
        )


def alternate(cases, rounds=5):
    """Each case's CPU time with lean launches and with Triton's own, alternating, so that a
    drift of the host's speed hits both alike; medians over the rounds."""
    import statistics

    from stepkernels.runtime.launch import triton_launches

    def triton_path(fn):
        with triton_launches():
            return fn()

    print(f"lean against Triton's launches, medians of {rounds} alternating rounds")
    for label, fn in cases.items():
        lean, plain = [], []
        for _ in range(rounds):
            lean.append(bench.cpu_us(fn))
            plain.append(bench.cpu_us(lambda fn=fn: triton_path(fn)))
        print(f"  {label:<30} lean {statistics.median(lean):7.1f} µs, Triton's {statistics.median(plain):7.1f} µs")


if __name__ == "__main__":
    launches()
    lean_path()
    cases = {
        "softmax forward+backward": softmax_calls(),
        "layer_norm forward+backward": layer_norm_calls(),
        "linear forward+backward": matmul_calls(),
        "dropout forward+backward": dropout_calls(),
    }
    alternate(cases)
    if "--profile" in sys.argv:
        x = torch.randn(4096, 1024, device="cuda", dtype=torch.float16)
        w, b = torch.randn(2, 1024, device="cuda", dtype=torch.float16)
        _, mean, rstd = layer_norm_module.layer_norm_forward(x, w, b, 1e-5, None)
        profile("layer_norm_backward wrapper", lambda: layer_norm_module.layer_norm_backward(x, x, w, mean, rstd))
        for label, fn in cases.items():
            profile(label, fn)
