"""A launch sweep for chapter 03's layer norm kernels (GPU only; not part of the gallery).

At M = 4,096 rows, fp16 first then fp32, N = 1,024, 4,096 and 16,384 (then 2,048 and 8,192),
it times (GPU time of CUDA-graph replays, L2 flushed, as the chapters measure):

* the ceiling at this size: a plain Triton copy of the same bytes (``bench.copy_of``), best of
  a few blocks and warps;
* the forward over rows per program, warps, and a capped grid (``programs`` per SM) whose
  programs loop over blocks of rows with ``NUM_STAGES`` loads in flight;
* the backward, each reduction, over programs per SM (which sets rows per program), warps
  and ``NUM_STAGES``; and the dx kernel alone (no dW, dB), to see what the reduction costs;
* torch and, when installed, Liger-Kernel.

It prints the four fastest launches next to the chapter's default:

    python lab/layer_norm_launch_sweep.py [seconds] [--long]

``--long`` instead tries holding rows of 16,384 whole in the backward.

It ran against the package as of commit de7a9f1, whose layer norm walked long rows (a
``SINGLE_BLOCK`` switch in its configs); chapter 13 replaced those kernels, so to rerun it,
check that commit out.
"""

import itertools
import sys
import time

from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import backward_config, layer_norm_backward, layer_norm_forward
from stepkernels.runtime.core import ON_GPU, dtype_name, sm_count
import torch
import triton

ROWS = 4096
SMS = sm_count()
failures = set()


def gb_per_s(fn, nbytes):
    """GPU time of fn's CUDA graph, shorter runs than bench.measure_ms (a sweep times hundreds)."""
    try:
        ms = triton.testing.do_bench(bench.capture(fn).replay, warmup=10, rep=40)
    except Exception as error:  # a launch that does not compile or fit: note it once
        message = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        if message not in failures:
            failures.add(message)
            print("  failed:", message)
        return 0.0
    return nbytes / ms / 1e6


def best(rated, count=4):
    return "  ".join(f"{rate:5.0f} {name}" for rate, name in sorted(rated)[::-1][:count])


def copy_ceiling(nbytes):
    rated = [
        (gb_per_s(bench.copy_of(nbytes, block, warps), nbytes), f"copy {block}/{warps}w")
        for block, warps in itertools.product((1024, 2048, 4096, 8192, 16384), (4, 8, 16))
    ]
    default = gb_per_s(bench.copy_of(nbytes), nbytes)
    return f"copy: default {default:5.0f} | {best(rated, 3)}"


def grid_choices():
    yield None, 1  # one block of rows per program (the launch before the capped grid)
    for per_sm, stages in itertools.product((1, 2, 4, 8), (1, 2, 3)):
        yield per_sm * SMS, stages


def sweep_forward(x, weight, bias):
    n_cols, nbytes = x.shape[1], 2 * x.numel() * x.element_size()
    block = triton.next_power_of_2(n_cols)
    rated = []
    for rows, warps in itertools.product((1, 2, 4, 8), (4, 8, 16)):
        per_thread = rows * block // (32 * warps)
        if not (8 <= per_thread <= 64 and rows * block <= 16384):
            continue
        for programs, stages in grid_choices():
            config = dict(
                BLOCK_N=block, ROWS_PER_PROGRAM=rows, SINGLE_BLOCK=True,
                NUM_STAGES=stages, num_warps=warps, programs=programs,
            )  # fmt: skip
            run = lambda c=config: layer_norm_forward(x, weight, bias, 1e-5, config=c)  # noqa: E731
            per_sm = "all" if programs is None else f"{programs // SMS}/SM"
            rated.append((gb_per_s(run, nbytes), f"rows={rows} w={warps} grid={per_sm} st={stages}"))
    default = gb_per_s(lambda: layer_norm_forward(x, weight, bias, 1e-5), nbytes)
    torch_rate = gb_per_s(lambda: torch.nn.functional.layer_norm(x, (n_cols,), weight, bias), nbytes)
    line = f"fwd {dtype_name(x.dtype):8} N={n_cols:6} torch {torch_rate:5.0f}"
    if liger is not None:
        liger_rate = gb_per_s(lambda: liger.apply(x, weight, bias, 1e-5), nbytes)
        line += f" liger {liger_rate:5.0f}"
    print(f"{line} default {default:5.0f} | {best(rated)}", flush=True)


def sweep_backward(x, dy, weight, mean, rstd):
    n_cols, nbytes = x.shape[1], 3 * x.numel() * x.element_size()
    default_config = backward_config(n_cols, ROWS)
    for reduction in ("two-stage", "lock", "dx only"):

        def call(config=None, reduction=reduction):
            wanted = reduction != "dx only"
            return lambda: layer_norm_backward(
                dy, x, weight, mean, rstd, want_dw=wanted, want_db=wanted,
                reduction="two-stage" if reduction == "dx only" else reduction, config=config,
            )  # fmt: skip

        rated = []
        for per_sm, warps, stages in itertools.product((1, 2, 4, 8), (4, 8, 16), (1, 2, 3)):
            rows = min(64, triton.next_power_of_2(triton.cdiv(ROWS, per_sm * SMS)))
            block = default_config["BLOCK_N"]
            if not 4 <= block // (32 * warps) <= 64:
                continue
            if not default_config["SINGLE_BLOCK"] and stages > 1:
                continue  # stages only apply to the single-block row loop
            config = {**default_config, "ROWS_PER_PROGRAM": rows, "num_warps": warps, "NUM_STAGES": stages}
            rated.append((gb_per_s(call(config), nbytes), f"{per_sm}/SM rows={rows} w={warps} st={stages}"))
        default = gb_per_s(call(), nbytes)
        print(
            f"bwd {reduction:9} {dtype_name(x.dtype):8} N={n_cols:6} default {default:5.0f} | {best(rated)}",
            flush=True,
        )
    xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = torch.nn.functional.layer_norm(xg, (n_cols,), wg, None)
    torch_rate = gb_per_s(lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True), nbytes)
    line = f"bwd torch    {dtype_name(x.dtype):8} N={n_cols:6} {torch_rate:5.0f}"
    if liger is not None:
        xl, wl, bl = (t.detach().requires_grad_() for t in (x, weight, torch.zeros_like(weight)))
        yl = liger.apply(xl, wl, bl, 1e-5)
        liger_rate = gb_per_s(lambda: torch.autograd.grad(yl, (xl, wl, bl), dy, retain_graph=True), nbytes)
        line += f"  liger {liger_rate:5.0f}"
    print(line, flush=True)


try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction as liger
except ImportError:
    liger = None


def single_block_backward(dtype, n_cols=16384):
    """Rows of 16,384 held whole in the backward (the chapter walks them): does it fit?"""
    x = torch.randn(ROWS, n_cols, device="cuda", dtype=dtype)
    dy, weight = torch.randn_like(x), torch.rand(n_cols, device="cuda", dtype=dtype) + 0.5
    _, mean, rstd = layer_norm_forward(x, weight, None, 1e-5)
    nbytes = 3 * x.numel() * x.element_size()

    def call(reduction, config=None):
        return lambda: layer_norm_backward(dy, x, weight, mean, rstd, reduction=reduction, config=config)

    rated = []
    for reduction, per_sm, warps, stages in itertools.product(("two-stage", "lock"), (1, 2), (16, 32), (1, 2)):
        rows = triton.next_power_of_2(triton.cdiv(ROWS, per_sm * SMS))
        config = dict(BLOCK_N=n_cols, ROWS_PER_PROGRAM=rows, SINGLE_BLOCK=True, NUM_STAGES=stages, num_warps=warps)
        rated.append((gb_per_s(call(reduction, config), nbytes), f"{reduction} {per_sm}/SM w={warps} st={stages}"))
    default = gb_per_s(call("two-stage"), nbytes)
    print(f"bwd one block {dtype_name(dtype):8} N={n_cols}: default (walks) {default:5.0f} | {best(rated, 6)}")


def main():
    if not ON_GPU:
        sys.exit("GPU only: this script times launches")
    seconds = [float(arg) for arg in sys.argv[1:] if not arg.startswith("--")]
    deadline = time.time() + (seconds[0] if seconds else 600)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    with bench.side_stream():
        if "--long" in sys.argv:
            for dtype in (torch.float16, torch.float32):
                single_block_backward(dtype)
            return
        for dtype, n_cols in itertools.product((torch.float16, torch.float32), (1024, 4096, 16384, 2048, 8192)):
            if time.time() > deadline:
                print("time up")
                break
            x = torch.randn(ROWS, n_cols, device="cuda", dtype=dtype)
            dy = torch.randn_like(x)
            weight = torch.rand(n_cols, device="cuda", dtype=dtype) + 0.5
            bias = torch.randn(n_cols, device="cuda", dtype=dtype)
            print(f"-- {dtype_name(dtype)} N={n_cols}: fwd {copy_ceiling(2 * x.numel() * x.element_size())}")
            print(f"   bwd {copy_ceiling(3 * x.numel() * x.element_size())}", flush=True)
            sweep_forward(x, weight, bias)
            _, mean, rstd = layer_norm_forward(x, weight, bias, 1e-5)
            sweep_backward(x, dy, weight, mean, rstd)


if __name__ == "__main__":
    main()
