"""Chapter 02's split kernels on long rows: hold the chunk through the wait, or read it again.

A split program loads its chunk of a row, publishes its part of the row's statistics and waits
for its siblings. Until this script, both split kernels held their chunk in registers through
the wait (the forward its exponentials, the backward y and dy). Reading it again after the
wait, from L2, was meant to free those registers for other programs' loads
(``softmax_split_ncu.log``: 2 programs an SM, DRAM 42% busy, in the fp16 forward with 4 warps;
``softmax_split_way_out.py`` later found the way out, not the held chunk, setting the
registers). The package's forward then loaded its chunk again (first load ``evict_last``,
second ``evict_first``); its backward held y and dy (read again, fp32 lost 14 to 17% on the
H100: ``softmax_split_reread.log``). Since the way out walks in small blocks, the forward reads
again in 16-bit types only and holds its chunk in fp32 (``softmax_split_hold.log``).
At M = 2^26 / N this times, next to torch and a copy of the same bytes, in GB/s of GPU time
(CUDA-graph replays):

* forward: the package, the held kernel it replaced (below, softmax only, at its launch of
  8,192 values and 8 warps) and the package's kernel over chunks and warps;
* backward: the package against a kernel that reads y and dy again (softmax only:
  ``softmax_split_way_out.backward_kernel``), over chunks and warps.

    python lab/softmax_split_reread.py

Without a GPU it checks both kernels here against torch under the interpreter and stops.
"""

from softmax_split_way_out import backward_kernel, combine_pairs, print_rates, split_call
from stepkernels.lessons import bench
from stepkernels.ops.softmax import Launch, online_max_and_sum, softmax_backward, softmax_forward
from stepkernels.runtime.core import DEVICE, ON_GPU
from stepkernels.runtime.waiting import publish_and_wait
import torch
import triton
import triton.language as tl


@triton.jit
def softmax_split_held_kernel(
    x_ptr, y_ptr, stats_ptr, counter_ptr, n_cols, n_chunks, x_row_stride, y_row_stride,
    BLOCK_N: tl.constexpr, CHUNKS_POW2: tl.constexpr, MAX_POLLS: tl.constexpr,
):  # fmt: skip
    """The split forward as it was (softmax only): exponentials held through the wait."""
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    x_row = x_ptr + row * x_row_stride
    x = tl.load(x_row + cols, mask=in_row, other=-float("inf")).to(tl.float32)
    chunk_max = tl.max(x, axis=0)
    chunk_shift = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
    numerator = tl.exp(x - chunk_shift)  # held: y needs only a factor per chunk
    chunk_sum = tl.sum(numerator, axis=0)
    row_stats = stats_ptr + row * 2 * CHUNKS_POW2
    tl.store(row_stats + chunk, chunk_max)
    tl.store(row_stats + CHUNKS_POW2 + chunk, chunk_sum)
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):
        row_max, row_shift, row_sum = combine_pairs(row_stats, n_chunks, CHUNKS_POW2)
    else:
        row_max, row_sum = online_max_and_sum(x_row, n_cols, BLOCK_N, 1)
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    y = numerator * (tl.exp(chunk_shift - row_shift) / row_sum)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


def held_forward(x, block_n=8192, num_warps=8):
    y = torch.empty_like(x)
    split_call(softmax_split_held_kernel, (x, y), block_n, num_warps, 2)
    return y


def reread_backward(y, dy, block_n=8192, num_warps=4):
    """The backward reading y and dy again, its way out walking in blocks of its chunk."""
    dx = torch.empty_like(y)
    constants = {"WAY_OUT_BLOCK": block_n, "REREAD": True}
    split_call(backward_kernel, (y, dy, dx), block_n, num_warps, 1, **constants)
    return dx


def check(n_rows=3, n_cols=40_000, block_n=8192):
    """Both kernels here against torch (fp32; under the interpreter only a row's last chunk
    finds its siblings' statistics, the others take the way out)."""
    x = torch.randn(n_rows, n_cols, device=DEVICE) * 4
    y = torch.softmax(x, dim=-1)
    dy = torch.randn_like(x)
    torch.testing.assert_close(held_forward(x, block_n), y)
    expected = y * (dy - (dy * y).sum(-1, keepdim=True))
    torch.testing.assert_close(reread_backward(y, dy, block_n), expected)
    print("held forward and reread backward match torch")


FORWARD_LAUNCHES = [(2048, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 16)]
BACKWARD_LAUNCHES = [(4096, 4), (8192, 4), (8192, 8), (16384, 8)]


def sweep(dtype, n_cols):
    x = torch.randn(2**26 // n_cols, n_cols, device=DEVICE, dtype=dtype)
    y, dy = torch.softmax(x, dim=-1), torch.randn_like(x)
    size = x.numel() * x.element_size()
    forward = {
        "copy": bench.copy_of(2 * size),
        "torch": lambda: torch.softmax(x, -1),
        "package": lambda: softmax_forward(x),
        "held 8192/8w": lambda: held_forward(x),
    }
    for block_n, warps in FORWARD_LAUNCHES:
        launch = Launch("split", block_n, num_warps=warps)
        forward[f"reread {block_n}/{warps}w"] = lambda launch=launch: softmax_forward(x, launch=launch)
    backward = {"copy": bench.copy_of(3 * size), "package": lambda: softmax_backward(y, dy)}
    for block_n, warps in BACKWARD_LAUNCHES:
        backward[f"reread {block_n}/{warps}w"] = lambda b=block_n, w=warps: reread_backward(y, dy, b, w)
    torch.testing.assert_close(softmax_forward(x), y)
    torch.testing.assert_close(held_forward(x), y)
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype != torch.float32 else {}
    torch.testing.assert_close(reread_backward(y, dy), softmax_backward(y, dy), **tolerance)
    print_rates(x, forward, backward)


if __name__ == "__main__":
    check()
    if ON_GPU:
        for dtype in (torch.float16, torch.float32):
            for n_cols in (65_536, 131_072, 262_144):
                sweep(dtype, n_cols)
