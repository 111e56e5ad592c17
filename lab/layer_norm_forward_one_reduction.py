"""Chapter 03's one-block forward with one cross-warp reduction a row instead of two.

The package's forward sums x, then the squares of x - mean: two reductions one after the
other, each a round trip through shared memory and a barrier, with the row's loads done and
nothing else to hide them behind. The variant here makes one reduction of the pair (sum,
sum of squares) of x shifted by the row's first value, a ``tl.reduce`` of two tensors at once:

    var = mean((x - x0)^2) - mean(x - x0)^2

Shifting by a value of the row keeps the cancellation small whenever x0 is within a few
standard deviations of the mean (the relative error of var grows with (x0 - mean)^2 / var).
A second variant merges (count, mean, M2) of groups of 16 bytes' worth of values with Chan's
pairwise formula, robust to any shift (``CHAN``). Both are timed against the package at its
own launches, fp16 and fp32, M = 4,096 rows (chapter 03's benchmark) of N = 4,096 to 32,768
(where torch.compile led by 1 to 4%), with torch.compile and a copy of the same bytes, calls
alternated (mean of 3); the check first prints each one's error on rows led by an outlier::

    python lab/layer_norm_forward_one_reduction.py   # GPU: time; CPU: check
"""

from layer_norm_backward_launch import alternating, shares
import sm90
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm
from stepkernels.runtime import core
import torch
import torch.nn.functional as F
import triton.language as tl

STATISTICS = """        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        centered = tl.where(mask, x - mean[:, None], 0.0)  # 0 on masked-off lanes
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
        y = centered * rstd[:, None]
"""
ONE_REDUCTION = """        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + rows64 * x_row_stride, mask=row_mask, other=0.0).to(tl.float32)
        shifted = tl.where(mask, x - x0[:, None], 0.0)
        s1, s2 = tl.reduce((shifted, shifted * shifted), 1, add_pairs)
        shift_mean = s1 / N
        mean = x0 + shift_mean
        rstd = 1.0 / tl.sqrt(tl.maximum(s2 / N - shift_mean * shift_mean, 0.0) + eps)
        y = (shifted - shift_mean[:, None]) * rstd[:, None]
"""


# Chan's way: each group of 16 bytes' worth of neighbouring values (one vector load, so one
# thread's) gets its exact mean and sum of squared deviations from registers; one reduction
# then merges the groups' (count, mean, M2) with Chan et al.'s pairwise formula, as
# torch.compile's Welford reduction merges its lanes'.
CHAN = """        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        GROUP: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
        N_GROUPS: tl.constexpr = BLOCK_N // GROUP
        starts = tl.arange(0, N_GROUPS) * GROUP
        in_group = (starts[:, None] + tl.arange(0, GROUP)[None, :]) < N
        count = tl.minimum(tl.maximum(N - starts, 0), GROUP).to(tl.float32)
        count = tl.broadcast_to(count[None, :], [ROWS_PER_PROGRAM, N_GROUPS])
        grouped = tl.reshape(x, [ROWS_PER_PROGRAM, N_GROUPS, GROUP])
        group_mean = tl.sum(grouped, axis=2) / tl.maximum(count, 1.0)
        deviation = tl.where(in_group[None, :, :], grouped - group_mean[:, :, None], 0.0)
        group_m2 = tl.sum(deviation * deviation, axis=2)
        _, mean, m2 = tl.reduce((count, group_mean, group_m2), 1, chan_merge)
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        y = (x - mean[:, None]) * rstd[:, None]
"""


@__import__("triton").jit
def add_pairs(a1, a2, b1, b2):
    return a1 + b1, a2 + b2


@__import__("triton").jit
def chan_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n = n_a + n_b
    share = n_b / tl.maximum(n, 1.0)
    delta = mean_b - mean_a
    return n, mean_a + delta * share, m2_a + m2_b + delta * delta * n_a * share


one_reduction_kernel = sm90.kernel_variant(
    layer_norm.layer_norm_forward_kernel,
    "layer_norm_one_reduction",
    [(STATISTICS, ONE_REDUCTION, 1)],
    {"add_pairs": add_pairs},
)
chan_kernel = sm90.kernel_variant(
    layer_norm.layer_norm_forward_kernel,
    "layer_norm_chan",
    [(STATISTICS, CHAN, 1)],
    {"chan_merge": chan_merge},
)


def one_reduction_forward(x, weight, bias, eps=1e-5, kernel=one_reduction_kernel):
    """y, mean, rstd by a variant at the package's launch."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    mean, rstd = (torch.empty(n_rows, device=x.device) for _ in "mr")
    config = dict(layer_norm.forward_config(n_cols, n_rows, None, x.element_size()))
    grid = -(-n_rows // config["ROWS_PER_PROGRAM"])
    grid = min(grid, config.pop("programs", None) or grid)
    kernel[(grid,)](x, y, weight, bias, mean, rstd, x.stride(0), y.stride(0),
                                  n_rows, n_cols, eps, HAS_WEIGHT=True, HAS_BIAS=True,
                                  **config)  # fmt: skip
    return y, mean, rstd


def inputs(n_rows, n_cols, dtype, offset=0.0):
    g = torch.Generator(device=core.DEVICE).manual_seed(0)
    make = lambda *s: torch.randn(*s, device=core.DEVICE, generator=g)  # noqa: E731
    x = (make(n_rows, n_cols) + offset).to(dtype)
    return x, make(n_cols).to(dtype), make(n_cols).to(dtype)


def check():
    for n_cols, dtype, offset in [(96, torch.float32, 0.0), (300, torch.float16, 50.0),
                                  (4096, torch.float32, 1000.0), (5000, torch.float32, 0.0)]:  # fmt: skip
        x, w, b = inputs(5, n_cols, dtype, offset)
        want = layer_norm.layer_norm_forward(x, w, b, 1e-5)
        for kernel in (one_reduction_kernel, chan_kernel):
            got = one_reduction_forward(x, w, b, kernel=kernel)
            for g, e in zip(got, want, strict=True):
                torch.testing.assert_close(g, e, rtol=2e-3, atol=2e-3)
    # A row whose first value is far out: the shifted sums lose the variance, Chan's do not.
    x = torch.randn(2, 4096, device=core.DEVICE)
    x[:, 0] = 1e4
    w, b = torch.ones(4096, device=x.device), torch.zeros(4096, device=x.device)
    want = torch.nn.functional.layer_norm(x.double(), (4096,)).float()
    for name, kernel in (("package", None), ("shifted", one_reduction_kernel), ("Chan", chan_kernel)):
        if kernel is None:
            y = layer_norm.layer_norm_forward(x, w, b, 1e-5)[0]
        else:
            y = one_reduction_forward(x, w, b, kernel=kernel)[0]
        print(f"{name}: largest error on rows led by 1e4, others N(0, 1): {(y - want).abs().max():.2e}")
    print("both variants give the package's y, mean and rstd (rows offset up to 1,000)")


def time_point(dtype, n_cols, n_rows=4096):
    """One line: each variant's GB/s and share of a copy at (n_rows, n_cols)."""
    x, w, b = inputs(n_rows, n_cols, dtype)
    nbytes = 2 * x.numel() * x.element_size()
    compiled = bench.compile_static(lambda x, w, b: F.layer_norm(x, (n_cols,), w, b))
    calls = {
        "package": lambda: layer_norm.layer_norm_forward(x, w, b, 1e-5),
        "one reduction": lambda: one_reduction_forward(x, w, b),
        "Chan": lambda: one_reduction_forward(x, w, b, kernel=chan_kernel),
        "torch.compile": lambda: compiled(x, w, b),
    }
    totals = alternating(calls, nbytes)
    copy = bench.rate(nbytes, bench.copy_of(nbytes))
    config = layer_norm.forward_config(n_cols, n_rows, None, x.element_size())
    name = str(dtype)[6:]
    print(f"{name} N = {n_cols:,} ({config}): {shares(totals, copy)}; copy {copy:,.0f}", flush=True)


def main():
    check()
    if not core.ON_GPU:
        return
    print("GB/s of GPU time (x read, y written), calls alternated, mean of 3")
    for dtype in (torch.float16, torch.float32):
        for n_cols in (4096, 8192, 16384, 32768):
            time_point(dtype, n_cols)


if __name__ == "__main__":
    main()
