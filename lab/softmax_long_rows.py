"""Chapter 02's long rows: the split forward against a looped, online one (benchmark softmax-long-rows).

The chapter's forward splits rows longer than 32,768 columns over several programs that
publish their (max, sum) pairs, so x is read once. The looped kernel here is the textbook
alternative: one persistent program per SM streams a row in chunks, finds its maximum and sum
with the package's online pass, then reads the row again (backwards, so the chunks read last,
likeliest still in L2, come first) to write it: 3 M N bytes instead of 2 M N.

    python lab/softmax_long_rows.py          # STEPKERNELS_RECORD=1 to record

Without a GPU it checks the looped kernel under the interpreter and shows the recording.
"""

from stepkernels import softmax
from stepkernels.lessons import bench, tutorial
from stepkernels.ops.softmax import MAX_FUSED_BLOCK, online_max_and_sum
from stepkernels.runtime.core import DEVICE, sm_count
import torch
import triton
import triton.language as tl


@triton.jit
def softmax_looped_kernel(
    x_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        x_row = x_ptr + tl.cast(row, tl.int64) * x_row_stride
        y_row = y_ptr + tl.cast(row, tl.int64) * y_row_stride
        running_max, row_sum = online_max_and_sum(x_row, n_cols, BLOCK_N, NUM_STAGES)
        for chunk in tl.range(0, n_chunks, num_stages=NUM_STAGES):
            offsets = (n_chunks - 1 - chunk) * BLOCK_N + cols  # backwards
            in_row = offsets < n_cols
            x = tl.load(x_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_first").to(tl.float32)
            y = tl.exp(x - running_max) / row_sum
            tl.store(y_row + offsets, y.to(y_ptr.dtype.element_ty), mask=in_row)


def softmax_looped(x, block_n=4096, num_warps=8, num_stages=2, programs_per_sm=1):
    """Softmax of a contiguous matrix by the looped kernel (the launch the chapter recorded)."""
    y = torch.empty_like(x)
    grid = (min(x.shape[0], programs_per_sm * sm_count()),)
    softmax_looped_kernel[grid](
        x, y, *x.shape, x.stride(0), y.stride(0), BLOCK_N=block_n, NUM_STAGES=num_stages, num_warps=num_warps
    )
    return y


def rows_for(n_cols):
    return tutorial.choose(gpu=2**26 // n_cols, cpu=3)


def make_long(provider, n_cols, dtype):
    x = torch.randn(rows_for(n_cols), n_cols, device=DEVICE, dtype=dtype)
    calls = {
        "triton": softmax,
        "triton (looped)": softmax_looped,
        "torch": lambda t: torch.softmax(t, dim=-1),
        "naive": lambda t: (e := torch.exp(t - t.max(-1, keepdim=True).values)) / e.sum(-1, keepdim=True),
    }
    if provider == "torch.compile":
        fn = bench.compile_static(lambda t: torch.softmax(t, dim=-1))
        fn(x)  # compile now, not while timing
    else:
        fn = calls[provider]
    return lambda: fn(x)


if __name__ == "__main__":
    x = torch.randn(3, 100, device=DEVICE)
    torch.testing.assert_close(softmax_looped(x, block_n=16), torch.softmax(x, dim=-1))
    print("the looped kernel, in chunks of 16, matches torch.softmax")
    long_rows = bench.run(
        bench.Benchmark(
            name="softmax-long-rows",
            x_name="N (columns), M = 2^26 / N rows",
            x_values=[65_536, 98_304, 131_072, 262_144],
            providers=["triton", "triton (looped)", "torch", "torch.compile", "naive"],
            make=make_long,
            work=lambda n_cols, dtype: 2 * rows_for(n_cols) * n_cols * dtype.itemsize,
            dtypes=(torch.float32, torch.float16),
            smoke_x=tutorial.choose(gpu=65_536, cpu=MAX_FUSED_BLOCK + 1),
            headline_x=131_072,
        )
    )
    if long_rows:
        for dtype in ("float32", "float16"):
            ratios = [long_rows.ratio("triton", "triton (looped)", n, dtype) for n in long_rows.bench.x_values]
            print(f"{dtype}: split over looped {min(ratios):.2f}x to {max(ratios):.2f}x ({long_rows.how})")
