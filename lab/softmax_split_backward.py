"""Chapter 02's long-row backward: the package's split kernel against a looped one, timed.

The package splits rows past 16,384 columns over programs (one chunk each, y and dy read
once; each program publishes its part of the row's sum and waits for the total). The kernel
below is the looped backward it replaced (commit 3eb52a3 and before): one program walks a row
twice, the sum and then dx, so y and dy are read twice (5 M N bytes moved for 3 M N counted),
the second walk backwards to catch what is still in L2 (chapter 02's exercise 3).

    python lab/softmax_split_backward.py

Under the interpreter it checks both against torch (tests/test_softmax.py runs it); on a GPU
it also times them at the chapter's long-row sizes, the split one over chunks and warps.
"""

from stepkernels.lessons import bench
from stepkernels.ops.softmax import Launch, softmax_backward, softmax_forward
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name, sm_count
import torch
import triton
import triton.language as tl


@triton.jit
def softmax_backward_looped_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, y_row_stride, dy_row_stride, dx_row_stride,
    BLOCK_N: tl.constexpr, LOG: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        y_row = y_ptr + tl.cast(row, tl.int64) * y_row_stride
        dy_row = dy_ptr + tl.cast(row, tl.int64) * dy_row_stride
        dx_row = dx_ptr + tl.cast(row, tl.int64) * dx_row_stride
        lane_total = tl.zeros([BLOCK_N], tl.float32)
        for chunk in tl.range(0, n_chunks, num_stages=NUM_STAGES):
            offsets = chunk * BLOCK_N + cols
            in_row = offsets < n_cols
            dy = tl.load(dy_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if LOG:
                lane_total += dy
            else:
                y = tl.load(
                    y_row + offsets,
                    mask=in_row,
                    other=0.0,
                    eviction_policy="evict_last",
                ).to(tl.float32)
                lane_total += dy * y
        total = tl.sum(lane_total, axis=0)
        for chunk in tl.range(0, n_chunks, num_stages=NUM_STAGES):
            offsets = (n_chunks - 1 - chunk) * BLOCK_N + cols  # backwards
            in_row = offsets < n_cols
            y = tl.load(y_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(dy_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if LOG:
                dx = dy - tl.exp(y) * total
            else:
                dx = y * (dy - total)
            tl.store(dx_row + offsets, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


def softmax_backward_looped(y, dy, log=False, block_n=4096, num_warps=8, num_stages=2):
    """dx for 2-D contiguous y and dy by the looped kernel (its last recorded launch)."""
    dx = torch.empty_like(y)
    grid = (min(y.shape[0], sm_count()),)
    softmax_backward_looped_kernel[grid](
        y, dy, dx, *y.shape, y.stride(0), dy.stride(0), dx.stride(0),
        BLOCK_N=block_n, LOG=log, NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return dx


def check():
    generator = torch.Generator().manual_seed(0)
    for n_rows, n_cols, chunk in [(3, 100, 16), (2, 1000, 128), (1, 1, 16), (4, 33, 64)]:
        for dtype, rtol in ((torch.float32, 1e-5), (torch.float16, 2**-10)):
            x = (torch.randn(n_rows, n_cols, generator=generator) * 4).to(DEVICE, dtype)
            dy = torch.randn(n_rows, n_cols, generator=generator).to(DEVICE, dtype)
            for log in (False, True):
                y = softmax_forward(x, log)
                x64 = x.double().requires_grad_()
                fn = torch.log_softmax if log else torch.softmax
                (expected,) = torch.autograd.grad(fn(x64, dim=-1), x64, dy.double())
                atol = rtol * expected.abs().max().item()  # gradients cancel: their size
                for dx in (softmax_backward(y, dy, log, Launch("split", chunk)),
                           softmax_backward_looped(y, dy, log, block_n=chunk)):  # fmt: skip
                    torch.testing.assert_close(dx, expected.to(dtype), rtol=rtol, atol=atol)
    print("split and looped backward match torch.autograd (fp32, fp16; softmax, log-softmax)")


def sweep(dtype, n_cols):
    x = torch.randn(2**26 // n_cols, n_cols, device="cuda", dtype=dtype)
    y, dy = softmax_forward(x), torch.randn_like(x)
    nbytes = 3 * x.numel() * x.element_size()
    calls = {
        "package": lambda: softmax_backward(y, dy),
        "looped": lambda: softmax_backward_looped(y, dy),
        "torch": lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, dtype),
    }
    for chunk in (4096, 8192, 16384):
        for warps in (4, 8):
            launch = Launch("split", chunk, num_warps=warps)
            calls[f"split {chunk}/{warps}w"] = lambda lc=launch: softmax_backward(y, dy, False, lc)
    line = f"{dtype_name(dtype):8} N={n_cols:7}"
    for name, fn in calls.items():
        line += f"  {name} {bench.rate(nbytes, fn):6.0f}"
    print(line, flush=True)


def main():
    check()
    if ON_GPU:
        for dtype in (torch.float32, torch.float16):
            for n_cols in (32_768, 65_536, 131_072, 262_144):
                sweep(dtype, n_cols)


if __name__ == "__main__":
    main()
