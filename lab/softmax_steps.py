"""Where chapter 02's forward speed comes from, step by step (benchmark softmax-steps).

The package's fused kernel launched four ways, fp32, M = 4,096 rows:

* ``triton (one row per program)``: one row per program, 4 warps, a grid of M programs;
* ``triton (+ rows per program)``: tiles of about 4,096 values, so short rows share a program;
* ``triton``: ``num_warps`` grows with the tile, the package's launch;
* ``triton (persistent, 2 stages)``: the same tiles on a persistent grid of 4 programs per SM
  with a two-stage pipeline. The package's kernel has no loop over tiles, so this variant (the
  chapter's kernel before the persistent grid was dropped, same arithmetic) is kept here.

On the H100 the warps counted most, rows per program a little, and the persistent grid was
slower from N = 1,024 up: the hardware starts a new program the moment one exits.

    python lab/softmax_steps.py          # STEPKERNELS_RECORD=1 to record
"""

from stepkernels.lessons import bench, tutorial
from stepkernels.ops.softmax import Launch, default_launch, softmax_forward
from stepkernels.runtime.core import DEVICE, sm_count
import torch
import triton
import triton.language as tl


@triton.jit
def softmax_persistent_kernel(
    x_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_N)[None, :]
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        in_bounds = (rows < n_rows)[:, None] & (cols < n_cols)
        rows = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows * x_row_stride + cols, mask=in_bounds, other=-float("inf")).to(tl.float32)
        numerator = tl.exp(x - tl.max(x, axis=1)[:, None])
        y = numerator * (1.0 / tl.sum(numerator, axis=1))[:, None]
        tl.store(y_ptr + rows * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=in_bounds)


def softmax_persistent(x, launch: Launch, programs_per_sm=4, num_stages=2):
    y = torch.empty_like(x)
    n_tiles = triton.cdiv(x.shape[0], launch.rows)
    grid = (min(n_tiles, programs_per_sm * sm_count()),)
    softmax_persistent_kernel[grid](
        x, y, *x.shape, x.stride(0), y.stride(0),
        ROWS=launch.rows, BLOCK_N=launch.block_n, NUM_STAGES=num_stages, num_warps=launch.num_warps,
    )  # fmt: skip
    return y


def make_steps(provider, n_cols, dtype):
    x = torch.randn(tutorial.choose(gpu=4096, cpu=3), n_cols, device=DEVICE, dtype=dtype)
    final = default_launch(n_cols)
    if provider == "triton (persistent, 2 stages)":
        return lambda: softmax_persistent(x, final)
    launch = {
        "triton (one row per program)": Launch("fused", final.block_n, 1, num_warps=4),
        "triton (+ rows per program)": Launch("fused", final.block_n, final.rows, num_warps=4),
    }.get(provider, final)
    return lambda: softmax_forward(x, launch=launch)


if __name__ == "__main__":
    x = torch.randn(37, 100, device=DEVICE)
    torch.testing.assert_close(softmax_persistent(x, default_launch(100)), torch.softmax(x, dim=-1))
    steps = bench.run(
        bench.Benchmark(
            name="softmax-steps",
            x_name="N (columns), M = 4096 rows, fp32",
            x_values=[2**i for i in range(8, 16)],
            providers=[
                "triton (one row per program)",
                "triton (+ rows per program)",
                "triton",
                "triton (persistent, 2 stages)",
            ],
            make=make_steps,
            work=lambda n_cols, dtype: 2 * tutorial.choose(gpu=4096, cpu=3) * n_cols * dtype.itemsize,
            smoke_x=100,
            headline_x=512,
        )
    )
    if steps:
        for n_cols in (1024, 32768):
            ratios = ", ".join(f"{steps.ratio('triton', p, n_cols):.2f}x {p}" for p in steps.bench.providers)
            print(f"N = {n_cols:,}: the package's launch at {ratios} ({steps.how})")
