r"""
Fused softmax: one pass over memory, for rows of any length
===========================================================

We write softmax and log-softmax over the last dimension of a tensor, forward and backward,
as Triton kernels that read each input once and write each output once, and make them run at
the memory bandwidth of the GPU, for rows of 256 elements and for rows of 262,144.

What you will learn:

* why softmax in PyTorch operations moves four times the bytes it needs, and how fusion
  brings that down to the minimum;
* row reductions in Triton: ``tl.max`` and ``tl.sum`` over a block, and how a program handles
  several short rows at once;
* what makes a memory-bound kernel fast: enough bytes in flight per program, ``num_warps``
  chosen by the row length, and a persistent, pipelined grid that, measured, did not pay;
* the *online* softmax, which finds the maximum and the sum in one pass, for rows too long for
  one block, and a split-row kernel whose programs wait for one another (release and acquire
  atomics) so that a long row is read only once;
* the backward of softmax and log-softmax, and wrapping kernels in ``torch.autograd.Function``.

Prerequisites: chapter 01 (programs, blocks, masks, the wrapper and the benchmark).
"""

# %%
# Setup
# -----
# As in every chapter, ``kit`` comes before ``triton``: without a GPU it switches Triton to
# its interpreter.

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import kit
import torch
import triton
import triton.language as tl

kit.announce()
DEVICE = kit.DEVICE
if kit.INTERPRET:
    # The interpreter computes with NumPy, which warns where a GPU silently makes NaN (a row
    # of only -inf, below): we test those NaNs on purpose.
    for message in ("invalid value encountered", "divide by zero encountered"):
        warnings.filterwarnings("ignore", message, RuntimeWarning)
# sphinx_gallery_thumbnail_number = 2

# %%
# Softmax in PyTorch operations, and what it costs
# ------------------------------------------------
# For a row x of N numbers, softmax(x)_i = exp(x_i) / sum_j exp(x_j). Written as it reads,
# exp overflows to infinity for x_i above about 88 in fp32, so every implementation first
# subtracts the row's maximum: the result is the same, and the largest exponent is exp(0) = 1.
# In PyTorch operations, for an M x N matrix:


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension in five PyTorch operations (our baseline)."""
    row_max = x.max(dim=-1, keepdim=True).values  # read M*N, write M
    shifted = x - row_max  # read M*N + M, write M*N
    numerator = torch.exp(shifted)  # read M*N, write M*N
    denominator = numerator.sum(dim=-1, keepdim=True)  # read M*N, write M
    return numerator / denominator  # read M*N + M, write M*N


# %%
# Each operation is its own kernel, and each kernel reads its inputs from memory and writes its
# result back. Adding up the comments: 5 M N elements read and 3 M N written (plus a few M,
# negligible), 8 M N in all. The work itself needs only 2 M N: read x once, write y once. The
# four intermediate tensors are the waste, and since softmax does about five arithmetic
# operations per element, against an H100 that does some 60 fp32 TFLOP/s but moves 3 TB/s,
# the time is the bytes. The naive version should run at about 2/8 of the speed of a kernel
# that keeps a row on chip from load to store: a speed-up of up to 4x is on the table.
#
# That kernel is a *fused* softmax: one program loads a row into registers, computes its
# maximum, the exponentials and their sum there, and writes the result. 2 x M x N x (bytes per
# element) is the compulsory traffic, and the figure we divide by the time to report effective
# bandwidth in every benchmark below. ``torch.softmax`` is fused too; the question for it is
# not the bytes but how close to the bandwidth it gets.
#
# The fused kernel
# ----------------
# Each program handles a tile of ``ROWS`` rows by ``BLOCK_N`` columns, ``BLOCK_N`` being the
# row length rounded up to a power of two. Out-of-row lanes load ``-inf``: they cannot win the
# maximum and their exp is 0, so they drop out of the sum without a special case. ``tl.max``
# and ``tl.sum`` with ``axis=1`` reduce each row of the tile to one number.
#
# The kernel computes in fp32 whatever the storage type: fp16 and bf16 values are converted
# right after the load (under the interpreter bf16 values are raw integers until converted),
# and rounded once at the store. With ``LOG`` set, a compile-time switch, the same kernel
# returns log-softmax: log(softmax(x)_i) = (x_i - max) - log(sum), which never takes the log
# of an exponential that underflowed to 0.
#
# The programs walk over the tiles with a stride: program ``p`` handles tiles ``p``,
# ``p + P``, ``p + 2P``... where P is the number of programs launched. Launch one program per
# tile and each runs its loop once: the ordinary grid of chapter 01. Launch fewer and each
# program is *persistent*: it stays on its SM and works through many tiles, which lets Triton
# load the next tile while it computes on this one (``num_stages``, below). One kernel covers
# both launches, so the benchmark can compare them.


@triton.jit
def softmax_kernel(
    x_ptr,
    y_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    y_row_stride,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_in_row = cols < n_cols
    for tile in tl.range(
        tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=NUM_STAGES
    ):
        rows = tile * ROWS + tl.arange(0, ROWS)
        in_bounds = (rows < n_rows)[:, None] & col_in_row[None, :]
        # int64 row offsets: M x N may pass 2**31 elements.
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(
            x_ptr + rows64 * x_row_stride + cols[None, :],
            mask=in_bounds,
            other=-float("inf"),
        ).to(tl.float32)
        row_max = tl.max(x, axis=1)
        shifted = x - row_max[:, None]
        numerator = tl.exp(shifted)
        denominator = tl.sum(numerator, axis=1)
        if LOG:
            y = shifted - tl.log(denominator)[:, None]
        else:
            y = numerator * (1.0 / denominator)[:, None]
        tl.store(
            y_ptr + rows64 * y_row_stride + cols[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=in_bounds,
        )


# %%
# A row of only ``-inf`` has max = -inf, and -inf - (-inf) is NaN: the row comes out as NaN,
# which is what PyTorch returns too (there is no distribution over nothing). A row with some
# ``-inf`` entries, the usual attention mask, is fine: those entries get probability 0.
#
# Rows too long for one block: the online softmax
# -----------------------------------------------
# A program keeps its tile in registers: 64K of them on an H100 SM, 256 KB. A row of 32,768
# fp32 values takes half of that, and one of 262,144 (1 MB) cannot fit at all. For long rows
# the program must stream the row in chunks, and softmax needs two numbers about the whole
# row, its maximum and its sum of exponentials, before it can write any output.
#
# The classic way takes three passes: find the maximum, then the sum, then write. The *online
# softmax* (Milakov and Gimelshein, 2018) gets both in one: keep a running maximum m and a
# running sum s of exp(x - m); when a chunk raises the maximum to m', rescale what we have,
# s' = s exp(m - m') + sum exp(x - m'). The maximum is one number per row, updated with a
# ``tl.max`` over each chunk; the sum is kept per lane of the chunk and reduced once, at the
# end of the row, so each element costs one exponential. A second pass then reads the row
# again and writes exp(x - m) / s.
#
# That second read is traffic the fused kernel does not have: 3 M N instead of 2 M N, which
# would cap us at 2/3 of the bandwidth. Two details claw some of it back. The second pass walks
# the row *backwards*, so that it starts with the chunks read last, which are the likeliest to
# still sit in the 50 MB L2 cache. And the loads carry eviction hints: the first pass asks L2
# to keep its lines (``evict_last``), the second lets them go (``evict_first``).
#
# Until the row shows a finite value, the running maximum is -inf and exp(x - m) would be
# exp(-inf - (-inf)) = NaN; shifting by 0 instead keeps the sum at 0, so that a row that starts
# with masked-out entries is not poisoned by them. (A row of only -inf still ends as NaN, as
# in PyTorch: its sum is 0 and its maximum -inf.)


@triton.jit
def online_max_and_sum(x_row, n_cols, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One pass over the ``n_cols`` values at ``x_row`` in chunks of ``BLOCK_N``: the row's
    maximum and its sum of exp(x - maximum), the online softmax's running pair."""
    cols = tl.arange(0, BLOCK_N)
    running_max = -float("inf")
    lane_sum = tl.zeros([BLOCK_N], tl.float32)  # one running sum per lane
    for chunk in tl.range(0, tl.cdiv(n_cols, BLOCK_N), num_stages=NUM_STAGES):
        offsets = chunk * BLOCK_N + cols
        x = tl.load(
            x_row + offsets,
            mask=offsets < n_cols,
            other=-float("inf"),
            eviction_policy="evict_last",
        ).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # While the row has shown nothing but -inf, shift by 0 instead of by -inf.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        running_max = new_max
    return running_max, tl.sum(lane_sum, axis=0)


@triton.jit
def softmax_looped_kernel(
    x_ptr,
    y_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    y_row_stride,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    REVERSE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        x_row = x_ptr + tl.cast(row, tl.int64) * x_row_stride
        y_row = y_ptr + tl.cast(row, tl.int64) * y_row_stride
        # Pass 1: the running maximum (one number) and running sums (one per lane).
        running_max, row_sum = online_max_and_sum(x_row, n_cols, BLOCK_N, NUM_STAGES)
        inverse_sum = 1.0 / row_sum
        log_sum = tl.log(row_sum)
        # Pass 2 reads the row again; backwards, the chunks read last come first.
        for chunk in tl.range(0, n_chunks, num_stages=NUM_STAGES):
            if REVERSE:
                index = n_chunks - 1 - chunk
            else:
                index = chunk
            offsets = index * BLOCK_N + cols
            in_row = offsets < n_cols
            x = tl.load(
                x_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_first"
            ).to(tl.float32)
            if LOG:
                y = (x - running_max) - log_sum
            else:
                y = tl.exp(x - running_max) * inverse_sum
            tl.store(y_row + offsets, y.to(y_ptr.dtype.element_ty), mask=in_row)


# %%
# Reading a long row once: split it across programs
# -------------------------------------------------
# The looped kernel reads x twice, so its traffic is 3 M N, not 2 M N, and one program per
# row has only one chunk in flight at a time. For the forward there is a way to read x once:
# give each row to several programs, one chunk each, held in registers from load to store.
# Each program reduces its chunk to a pair (chunk maximum m_c, sum s_c of exp(x - m_c)) and
# publishes it; once all the pairs of its row are there, every program combines them into the
# row's maximum m = max m_c and sum S = sum s_c exp(m_c - m), and writes its chunk.
#
# "Once all are there" is the new part: programs of one launch waiting for one another.
# Publishing takes three steps: store the pair, ``tl.debug_barrier()`` so that every thread
# of the program has stored before any announces it, then ``tl.atomic_add`` on the row's
# counter with ``sem="release"``, which orders the stores before the increment for any
# program that reads the counter with ``sem="acquire"``. Waiting means polling the counter
# until it equals the number of chunks; the pairs are then read with ``volatile=True`` so
# that no stale cache line answers. ``publish_and_wait`` below does the announcing and the
# waiting, so that other split kernels (exercise 3) can share it.
#
# Nothing in CUDA promises that the programs of a row run at the same time: a program could
# wait for a sibling that cannot start until the waiter finishes. In practice a GPU starts
# programs in order of their id, so a row's chunks (adjacent ids) start together and only the
# last row in flight waits for a moment, but "in practice" is not a guarantee. So polling is
# bounded: after ``MAX_POLLS`` tries a program gives up waiting and computes the row's
# maximum and sum itself, reading the row (an online pass, as in the looped kernel). The
# result is the same either way; only the time differs. Under the interpreter, which runs
# programs one after another, the first chunks of a row always take that path and the last
# one the published one, so both are tested.


@triton.jit
def publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS: tl.constexpr):
    """Announce this program's stores to the other programs of its row, then wait (at most
    MAX_POLLS tries) until all ``n_chunks`` have announced theirs. True if they all did."""
    tl.debug_barrier()  # every thread of this program has stored
    tl.atomic_add(counter_ptr + row, 1, sem="release")
    published = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
    polls = 0
    while (published < n_chunks) & (polls < MAX_POLLS):
        published = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
        polls += 1
    return published >= n_chunks


@triton.jit
def softmax_split_kernel(
    x_ptr,
    y_ptr,
    stats_ptr,
    counter_ptr,
    n_cols,
    n_chunks,
    x_row_stride,
    y_row_stride,
    CHUNK: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    LOG: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = cols < n_cols
    x_row = x_ptr + row * x_row_stride
    x = tl.load(x_row + cols, mask=in_row, other=-float("inf")).to(tl.float32)
    chunk_max = tl.max(x, axis=0)
    chunk_shift = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
    chunk_sum = tl.sum(tl.exp(x - chunk_shift), axis=0)
    # stats holds, per row, CHUNKS_POW2 maxima and then CHUNKS_POW2 sums.
    row_stats = stats_ptr + row * 2 * CHUNKS_POW2
    tl.store(row_stats + chunk, chunk_max)
    tl.store(row_stats + CHUNKS_POW2 + chunk, chunk_sum)
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):  # combine the pairs
        chunks = tl.arange(0, CHUNKS_POW2)
        present = chunks < n_chunks
        maxima = tl.load(
            row_stats + chunks, mask=present, other=-float("inf"), volatile=True
        )
        sums = tl.load(row_stats + CHUNKS_POW2 + chunks, mask=present, volatile=True)
        row_max = tl.max(maxima, axis=0)
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
        # A chunk of only -inf has sum 0 and weight exp(-inf) = 0: never 0 * overflow.
        weights = tl.exp(maxima - row_shift)
        row_sum = tl.sum(tl.where(present, sums * weights, 0.0))
    else:  # the siblings are not running: read the row ourselves, online
        row_max, row_sum = online_max_and_sum(x_row, n_cols, CHUNK, 1)
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    if LOG:
        y = (x - row_max) - tl.log(row_sum)
    else:
        y = tl.exp(x - row_shift) / row_sum
    y_row = y_ptr + row * y_row_stride
    tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


# %%
# The backward
# ------------
# With y = softmax(x) and dy the gradient arriving from above, the chain rule through the
# Jacobian dy_i/dx_j = y_i (delta_ij - y_j) collapses to one dot product per row:
#
#     dx = y * (dy - sum(dy * y))
#
# For log-softmax, y = x - log(sum exp x), and dy_i/dx_j = delta_ij - softmax(x)_j gives
#
#     dx = dy - exp(y) * sum(dy)
#
# Both are a row reduction followed by an elementwise step: the same shape as the forward, with
# two inputs (y and dy) and one output (dx). The compulsory traffic is 3 M N elements, and both
# backwards need only the forward's *output*, so the forward saves y, not x. The kernels mirror
# the forward ones: a fused kernel for rows that fit in one block, and a looped one, here two
# passes (the sum, then dx) with the second walking backwards, for rows that do not.


@triton.jit
def softmax_backward_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    n_rows,
    n_cols,
    y_row_stride,
    dy_row_stride,
    dx_row_stride,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_in_row = cols < n_cols
    for tile in tl.range(
        tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=NUM_STAGES
    ):
        rows = tile * ROWS + tl.arange(0, ROWS)
        in_bounds = (rows < n_rows)[:, None] & col_in_row[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        y = tl.load(
            y_ptr + rows64 * y_row_stride + cols[None, :], mask=in_bounds, other=0.0
        ).to(tl.float32)
        dy = tl.load(
            dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=in_bounds, other=0.0
        ).to(tl.float32)
        if LOG:
            dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
        else:
            dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
        tl.store(
            dx_ptr + rows64 * dx_row_stride + cols[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=in_bounds,
        )


@triton.jit
def softmax_backward_looped_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    n_rows,
    n_cols,
    y_row_stride,
    dy_row_stride,
    dx_row_stride,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    REVERSE: tl.constexpr,
):
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
            dy = tl.load(
                dy_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_last"
            ).to(tl.float32)
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
            if REVERSE:
                index = n_chunks - 1 - chunk
            else:
                index = chunk
            offsets = index * BLOCK_N + cols
            in_row = offsets < n_cols
            y = tl.load(
                y_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_first"
            ).to(tl.float32)
            dy = tl.load(
                dy_row + offsets, mask=in_row, other=0.0, eviction_policy="evict_first"
            ).to(tl.float32)
            if LOG:
                dx = dy - tl.exp(y) * total
            else:
                dx = y * (dy - total)
            tl.store(dx_row + offsets, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


# %%
# Launch parameters
# -----------------
# The kernels are fixed; what remains is how to launch them, and that is where the speed is.
# A ``Launch`` names the choices: the tile (``rows`` x ``block_n``), ``num_warps`` (how many
# warps of 32 threads share a program), ``num_stages`` (how many tiles of the persistent loop
# are loaded ahead), and ``programs_per_sm`` (``None``: one program per tile; a number: a
# persistent grid of that many programs for each SM of the GPU).
#
# What to choose, and why, comes from a sweep on an H100 (M = 4,096 rows; every tile shape of
# 2K to 32K values, 2 to 32 warps, with and without a persistent grid; the script is
# ``tools/experiments/softmax_launch_sweep.py``), whose winners the benchmarks at the end of
# the chapter measure again:
#
# * **Rows per program for short rows.** A row of 256 fp32 values is 1 KB. A program of 4 warps
#   holding one such row gives each of its 128 threads two values: one load in flight per
#   thread, too little to cover the microsecond that a load from DRAM takes. We give each tile
#   about 4,096 values (16 rows of 256) so that each thread issues several wide loads at once.
# * **num_warps by N.** Once a row alone fills a tile, the tile grows with N, and we grow
#   ``num_warps`` with it, one warp per 1,024 values (32 per thread): enough loads in flight,
#   few enough registers not to spill. For rows of 8K to 32K values this is worth 5 to 10%
#   over a fixed 4 warps.
# * **Persistent programs did not pay.** A persistent grid (a few programs per SM, each
#   looping over tiles with ``num_stages = 2`` so that the next tile loads while this one is
#   reduced) was never faster than one program per tile in the sweep, and at short rows it
#   was up to 3x slower: the hardware already starts a new program the moment one exits, and
#   the pipeline routes every load through shared memory. The kernel keeps the loop, so the
#   steps benchmark below can show both; ``softmax`` launches one program per tile.
# * **Rows longer than** ``MAX_FUSED_BLOCK`` take the split kernel (forward: one program per
#   chunk of ``SPLIT_CHUNK`` values, 8 warps) or the looped kernel (backward: one row per
#   iteration of a persistent loop, in chunks of ``LOOPED_BLOCK``), where a persistent grid
#   is the natural launch: a row is one long stream of loads.

INTERPRETER_PROGRAMS = 4  # the interpreter has no SMs to count
MAX_FUSED_BLOCK = 32768  # longest row kept whole in registers (forward)
MAX_FUSED_BLOCK_BACKWARD = 16384  # the backward holds two tensors, y and dy
LOOPED_BLOCK = 4096  # chunk length of the looped kernels
TILE_ELEMENTS = 4096  # values per tile for short rows
ELEMENTS_PER_WARP = 1024
# Long rows, forward: values per program of the split kernel, by element size (bytes), the
# fastest of 4,096 to 16,384 with 8 or 16 warps on the H100 (tools/experiments).
SPLIT_CHUNK = {4: 8192, 2: 4096}
MAX_POLLS = kit.choose(gpu=100_000, cpu=2)  # split kernel: tries before reading the row


@dataclass(frozen=True)
class Launch:
    block_n: int  # columns of a tile: the whole row (fused) or one chunk (looped)
    rows: int = 1  # rows of a tile (fused kernels only)
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: float | None = None  # None: one program per tile
    looped: bool = False
    split: bool = False  # long rows, forward: one program per chunk, x read once
    reverse: bool = True  # looped kernels: walk the second pass backwards


# Rows longer than the fused kernels take: a persistent grid, one program per SM.
LOOPED_LAUNCH = Launch(
    LOOPED_BLOCK, num_warps=8, num_stages=2, programs_per_sm=1, looped=True
)


@functools.cache  # called on every softmax: keep it off the launch's critical path
def default_launch(n_cols: int, element_size: int, backward: bool = False) -> Launch:
    """The launch this chapter uses for rows of ``n_cols`` elements of ``element_size`` bytes."""
    block_n = max(16, triton.next_power_of_2(n_cols))
    if block_n > MAX_FUSED_BLOCK and not backward:
        return Launch(SPLIT_CHUNK[element_size], num_warps=8, split=True)
    if block_n > (MAX_FUSED_BLOCK_BACKWARD if backward else MAX_FUSED_BLOCK):
        return LOOPED_LAUNCH
    rows = max(1, TILE_ELEMENTS // block_n)
    num_warps = min(32, max(4, rows * block_n // ELEMENTS_PER_WARP))
    return Launch(block_n, rows, num_warps=num_warps)


def n_programs(launch: Launch, n_tiles: int) -> int:
    if launch.programs_per_sm is None:
        return n_tiles
    if not kit.ON_GPU:
        return min(n_tiles, INTERPRETER_PROGRAMS)
    return min(n_tiles, max(1, round(launch.programs_per_sm * kit.SM_COUNT)))


# %%
# The wrappers
# ------------
# The kernels see a matrix of rows: a row start pointer for each row and unit stride along it.
# ``x.reshape(-1, N)`` turns any leading dimensions into rows, without a copy whenever they can
# be merged, and the kernels take the row stride as an argument, so that a slice like
# ``x[:, :N]`` or one head of an attention tensor is read in place. A last dimension whose
# elements are not adjacent (a transposed matrix, an expanded gradient) is copied with
# ``.contiguous()`` first: reading it in place would turn each 16-byte load into scattered
# 4-byte ones, and the copy costs less than that. The output is always a new contiguous tensor.

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def softmax_forward(
    x: torch.Tensor, log: bool = False, launch: Launch | None = None
) -> torch.Tensor:
    """Softmax (or log-softmax) over the last dimension, without autograd."""
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x.numel() == 0:
        return y
    x_rows, y_rows = as_rows(x), y.view(-1, x.shape[-1])
    n_rows, n_cols = x_rows.shape
    launch = launch or default_launch(n_cols, x.element_size())
    if launch.split:
        n_chunks = triton.cdiv(n_cols, launch.block_n)
        chunks_pow2 = triton.next_power_of_2(n_chunks)
        stats = torch.empty(
            n_rows, 2, chunks_pow2, device=x.device, dtype=torch.float32
        )
        counters = torch.zeros(n_rows, device=x.device, dtype=torch.int32)
        softmax_split_kernel[(n_rows * n_chunks,)](
            x_rows, y_rows, stats, counters, n_cols, n_chunks,
            x_rows.stride(0), y_rows.stride(0),
            CHUNK=launch.block_n, CHUNKS_POW2=chunks_pow2, LOG=log,
            MAX_POLLS=MAX_POLLS, num_warps=launch.num_warps,
        )  # fmt: skip
    elif launch.looped:
        softmax_looped_kernel[(n_programs(launch, n_rows),)](
            x_rows, y_rows, n_rows, n_cols, x_rows.stride(0), y_rows.stride(0),
            BLOCK_N=launch.block_n, LOG=log, NUM_STAGES=launch.num_stages,
            REVERSE=launch.reverse, num_warps=launch.num_warps,
        )  # fmt: skip
    else:
        if launch.block_n < n_cols:
            raise ValueError(
                f"block_n={launch.block_n} is shorter than rows of {n_cols}"
            )
        grid = (n_programs(launch, triton.cdiv(n_rows, launch.rows)),)
        softmax_kernel[grid](
            x_rows, y_rows, n_rows, n_cols, x_rows.stride(0), y_rows.stride(0),
            ROWS=launch.rows, BLOCK_N=launch.block_n, LOG=log,
            NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
        )  # fmt: skip
    return y


def softmax_backward(
    y: torch.Tensor, dy: torch.Tensor, log: bool = False, launch: Launch | None = None
) -> torch.Tensor:
    """The gradient with respect to x, given the forward's output y and dy."""
    dx = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    if y.numel() == 0:
        return dx
    y_rows, dy_rows = as_rows(y), as_rows(dy.to(y.dtype))
    dx_rows = dx.view(-1, y.shape[-1])
    n_rows, n_cols = y_rows.shape
    launch = launch or default_launch(n_cols, y.element_size(), backward=True)
    strides = (y_rows.stride(0), dy_rows.stride(0), dx_rows.stride(0))
    if launch.looped:
        softmax_backward_looped_kernel[(n_programs(launch, n_rows),)](
            y_rows, dy_rows, dx_rows, n_rows, n_cols, *strides,
            BLOCK_N=launch.block_n, LOG=log, NUM_STAGES=launch.num_stages,
            REVERSE=launch.reverse, num_warps=launch.num_warps,
        )  # fmt: skip
    else:
        if launch.block_n < n_cols:
            raise ValueError(
                f"block_n={launch.block_n} is shorter than rows of {n_cols}"
            )
        grid = (n_programs(launch, triton.cdiv(n_rows, launch.rows)),)
        softmax_backward_kernel[grid](
            y_rows, dy_rows, dx_rows, n_rows, n_cols, *strides,
            ROWS=launch.rows, BLOCK_N=launch.block_n, LOG=log,
            NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
        )  # fmt: skip
    return dx


# %%
# ``torch.autograd.Function`` joins the two: ``forward`` runs our forward kernel and saves its
# output, ``backward`` receives dy and returns dx (and ``None`` for the ``log`` flag, which has
# no gradient). The public functions check their input first, with messages that say what to
# do, and then go through ``apply``, so that autograd records the operation whenever x requires
# a gradient.


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log):
        y = softmax_forward(x, log)
        ctx.save_for_backward(y)
        ctx.log = log
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, dy, ctx.log), None


def check_input(x: torch.Tensor) -> None:
    kit.check_tensor(x, "x", SUPPORTED_DTYPES, contiguous=False)
    if x.dim() == 0:
        raise ValueError(
            "x is a 0-dim tensor, but softmax runs over the last dimension: "
            "pass x.reshape(1) (whose softmax is [1.0])"
        )


def softmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(x, dim=-1)`` for fp32, fp16 and bf16, with autograd.

    For another dimension, move it last: ``softmax(x.transpose(dim, -1)).transpose(dim, -1)``.
    """
    check_input(x)
    return SoftmaxFunction.apply(x, False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.log_softmax(x, dim=-1)`` for fp32, fp16 and bf16, with autograd."""
    check_input(x)
    return SoftmaxFunction.apply(x, True)


# %%
# Correctness
# -----------
# We compare against ``torch.softmax`` and ``torch.log_softmax``, computed in fp64 and rounded
# to the input's dtype, so that the reference itself carries no fp32 rounding. Our kernels
# round once, at the store, so the tolerances are about one unit in the last place of the
# storage type: 2^-10 (fp16) and 2^-7 (bf16), relative; a bit more in bf16 under the
# interpreter, which truncates rather than rounds, and 1e-5 relative in fp32, where the sum
# over a long row adds up its own rounding errors. Log-softmax values near 0 are differences
# of nearly equal numbers, so we allow an absolute error of the same size as well.
# Gradients are a difference too, dy minus a row sum, computed from the rounded y: we scale
# their absolute tolerance to the largest gradient, which is what PyTorch's own fp16 and bf16
# backwards need against fp64.
#
# The shapes are those that break naive kernels: one element, one row, rows that are not a
# power of two, rows longer than one fused block (which take the looped kernel), leading
# dimensions, a strided slice and a transposed matrix.

TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 2**-12},
    torch.bfloat16: {"rtol": 2**-6 if kit.INTERPRET else 2**-7, "atol": 2**-9},
}


def gradient_tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    """Gradients cancel (dy minus a row sum) after y was rounded: scale atol to their size."""
    rtol = TOLERANCES[dtype]["rtol"]
    return {"rtol": rtol, "atol": rtol * expected.abs().max().item()}


def reference(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    fn = torch.log_softmax if log else torch.softmax
    return fn(x.double(), dim=-1).to(x.dtype)


long_row = kit.choose(gpu=262_144, cpu=MAX_FUSED_BLOCK + 3)
torch.manual_seed(0)
cases = {
    "1x1": torch.randn(1, 1),
    "one row": torch.randn(1, 781),
    "not a power of two": torch.randn(kit.choose(gpu=1823, cpu=37), 781),
    "one short row per tile": torch.randn(5, 3),
    "leading dims": torch.randn(2, 3, 5, 100),
    "strided slice": torch.randn(9, 300)[:, 17:217],
    "transposed": torch.randn(64, 12).t(),
    "long rows (looped kernel)": torch.randn(2, long_row),
}
for dtype in SUPPORTED_DTYPES:
    for name, x in cases.items():
        x = (x * 4).to(DEVICE, dtype)
        for log, fn in ((False, softmax), (True, log_softmax)):
            torch.testing.assert_close(
                fn(x), reference(x, log), **TOLERANCES[dtype], msg=name
            )
print(f"softmax and log_softmax match torch: {len(cases)} shapes x 3 dtypes")

# %%
# Rows with ``-inf`` in them, the masked scores of attention, must give probability 0 there,
# and a row of nothing but ``-inf`` gives NaN, as in PyTorch. We also check the backward of
# both functions with ``torch.autograd`` against PyTorch's, and the looped kernels at a small
# size by passing a ``Launch`` with a 16-column chunk, the split kernel likewise.

x = torch.randn(4, 50, device=DEVICE)
x[0, ::3] = -float("inf")
x[1] = -float("inf")
for log, fn in ((False, softmax), (True, log_softmax)):
    torch.testing.assert_close(fn(x), reference(x, log), equal_nan=True)
    for small_chunks in (
        Launch(16, looped=True, programs_per_sm=2),
        Launch(16, split=True),
    ):
        torch.testing.assert_close(
            softmax_forward(x, log, small_chunks), reference(x, log), equal_nan=True
        )

for dtype in SUPPORTED_DTYPES:
    for log, fn in ((False, softmax), (True, log_softmax)):
        x = torch.randn(3, 7, 300, device=DEVICE, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        (ours,) = torch.autograd.grad(fn(x), x, dy)
        x64 = x.detach().double().requires_grad_()
        torch_fn = torch.log_softmax if log else torch.softmax
        (theirs,) = torch.autograd.grad(torch_fn(x64, dim=-1), x64, dy.double())
        tolerance = gradient_tolerance(dtype, theirs)
        torch.testing.assert_close(ours, theirs.to(dtype), **tolerance)
        y = softmax_forward(x.detach(), log)
        dx = softmax_backward(y, dy, log, Launch(64, looped=True, programs_per_sm=2))
        torch.testing.assert_close(dx, theirs.to(dtype), **tolerance)
print("gradients of softmax and log_softmax match torch.autograd, fused and looped")

# %%
# Inputs the kernels cannot take are refused with a message that says what to do:

x = torch.randn(8, 10, device=DEVICE)
bad_calls = {
    "integer dtype": lambda: softmax(x.int()),
    "float64": lambda: softmax(x.double()),
    "0-dim tensor": lambda: softmax(x[0, 0]),
    "wrong device": lambda: softmax(x.to("meta")),
    "not a tensor": lambda: softmax([1.0, 2.0]),
}
kit.show_refusals("softmax()", bad_calls)

# %%
# Benchmarks
# ----------
# We time the GPU work of each call: ``kit`` records the call once as a CUDA graph and
# ``triton.testing.do_bench`` times replays of it, emptying L2 before each (How we measure
# says why the CPU is left out; the last benchmark measures it). We report effective
# bandwidth: compulsory bytes over the median time. The forward counts 2 M N x
# (bytes per element): x read once, y written once. Forward plus backward counts 5 M N: the
# forward's two, and the backward's read of y and dy and write of dx. The dashed line is the
# device-to-device copy bandwidth of the same GPU. The rows M are 4,096 for N up to 32,768; for
# longer rows we keep the tensor at 2^26 elements (M = 2^26 / N: 1,024 rows of 65,536 down to
# 256 rows of 262,144), 256 MB in fp32.
#
# The providers are ``triton`` (this chapter's ``softmax``), ``torch`` (``torch.softmax``),
# ``torch.compile`` (Inductor's generated Triton kernel for ``torch.softmax``, compiled once
# for each shape, outside the timing) and ``naive`` (the five operations above).


def rows_for(n_cols: int) -> int:
    return kit.choose(gpu=4096 if n_cols <= 32768 else 2**26 // n_cols, cpu=3)


def torch_softmax(x):
    return torch.softmax(x, dim=-1)


def forward_call(provider: str, x: torch.Tensor):
    if provider == "torch.compile":
        fn = kit.compile_static(torch_softmax)
        fn(x)  # compile now, not while timing
        return lambda: fn(x)
    fn = {"triton": softmax, "torch": torch_softmax, "naive": naive_softmax}[provider]
    return lambda: fn(x)


def make_forward(provider: str, n_cols: int, dtype: torch.dtype):
    x = torch.randn(rows_for(n_cols), n_cols, device=DEVICE, dtype=dtype)
    return forward_call(provider, x)


def forward_bytes(n_cols: int, dtype: torch.dtype) -> int:
    return 2 * rows_for(n_cols) * n_cols * dtype.itemsize


PROVIDERS = ["triton", "torch", "torch.compile", "naive"]

softmax_bench = kit.Benchmark(
    name="softmax-forward",
    x_name="N (columns), M = 4096 rows",
    x_values=[2**i for i in range(8, 16)] + [768, 3000, 12_000],
    providers=PROVIDERS,
    make=make_forward,
    work=forward_bytes,
    dtypes=(torch.float32, torch.float16),
    smoke_x=100,
    headline_x=4096,
)
kit.run(softmax_bench)

# %%
# The naive version sits near a quarter of the others, as the byte count predicted: its eight
# passes over memory against two. ``torch.softmax`` is fused, so its gap to our kernel is not
# bytes but how well the bytes are kept moving.
#
# What the H100 recording shows. From N = 2,048 to 32,768 ours runs at 2.46 to 2.94 TB/s in
# fp32 (82 to 98% of the copy line; 2,684 GB/s at N = 4,096) and 1.76 to 2.82 TB/s in fp16,
# and it is faster than ``torch.softmax`` at every benchmarked N, in both dtypes: by 1.3x (fp32)
# and 2.1x (fp16) at N = 4,096, 1.8x and 1.3x at N = 32,768. ``torch.compile`` generates a
# kernel much like ours: in fp32 within 2% of it at N = 4,096, 8,192 and 16,384, 7% and 11%
# behind at 12,000 and 32,768, and 3% ahead at N = 256 and 512; well behind in fp16 (1,499
# against 2,348 GB/s at N = 4,096).
#
# Against our floors: 2.7 TB/s is met in fp32 from N = 8,192 and in fp16 only at N = 16,384
# (2,819; 2,645 at 8,192 and 2,691 at 32,768). It is missed by a hair at N = 4,096 in fp32
# (2,684), by 13% in fp16 (2,348), and most at N = 3,000 in fp16 (1,762), a row padded from
# 3,000 to 4,096 lanes. Below N = 2,048 the floor of 2.0 TB/s is
# met only at N = 1,024 in fp32 (2,110). There the whole problem is 4 to 16 MB, moved in 3 to
# 8 µs: a kernel that short spends a good part of its time starting and draining, for every
# provider. Chapter 01's vector addition, the simplest kernel there is, shows the ceiling at
# these sizes: 1,298 GB/s for its 12.6 MB at 2^20 elements and 1,783 for 25 MB at 2^21, where
# our softmax moves 16 MB at N = 512 in fp32 at 1,444. Ours stays ahead of
# ``torch.softmax`` there too, 967 against 946 GB/s at N = 256 in fp32.
#
# Where the speed comes from, step by step
# ----------------------------------------
# The same kernel, launched four ways, for fp32 at M = 4,096:
#
# * ``triton (one row per program)``: the first kernel anyone writes, one row per program
#   with 4 warps, a grid of M programs;
# * ``triton (+ rows per program)``: tiles of about 4,096 values, so short rows share a
#   program;
# * ``triton``: ``num_warps`` grows with the tile; this is the launch ``softmax`` uses;
# * ``triton (persistent, 2 stages)``: the same tiles on a persistent grid of 4 programs per
#   SM with a two-stage pipeline, the step that did not pay.


def make_steps(provider: str, n_cols: int, dtype: torch.dtype):
    x = torch.randn(rows_for(n_cols), n_cols, device=DEVICE, dtype=dtype)
    final = default_launch(n_cols, dtype.itemsize)
    if final.looped:
        launch = final
    elif provider == "triton (one row per program)":
        launch = Launch(final.block_n, 1, num_warps=4)
    elif provider == "triton (+ rows per program)":
        launch = Launch(final.block_n, final.rows, num_warps=4)
    elif provider == "triton (persistent, 2 stages)":
        launch = dataclasses.replace(final, num_stages=2, programs_per_sm=4)
    else:
        launch = final
    return lambda: softmax_forward(x, launch=launch)


steps_bench = kit.Benchmark(
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
    work=forward_bytes,
    smoke_x=100,
    headline_x=512,
)
kit.run(steps_bench)

# %%
# One row per program with 4 warps is fine for mid-length rows and loses at both ends. Short
# rows leave each thread with one or two values to load, too few bytes in flight; long rows
# give 128 threads hundreds of values each, more than their registers hold comfortably. Tiles
# of several rows address the first, more warps the second. The persistent, pipelined grid
# is the control: it moves the same tiles through shared memory and gains nothing here.
#
# On the H100 the warps are what count: at N = 32,768 four warps reach 2,120 GB/s and the
# 32 warps of the final launch 2,939 (+39%). Rows per program change little at M = 4,096
# (2,127 against 1,978 GB/s at N = 1,024, within a few percent elsewhere), and the persistent
# grid is 3 to 11% slower from N = 1,024 up.
#
# Below about N = 1,024 every provider falls short of the copy line, ours included, and not
# for want of bandwidth: 4,096 x 256 fp32 values are 4 MB, moved in under 3 µs at full speed,
# about the time it takes the GPU to launch a kernel and ramp up.
#
# Long rows
# ---------
# From N = 65,536 the forward takes the split kernel, which reads x once; ``triton (looped)``
# is the looped, online kernel on the same rows, which reads it twice.


def make_long(provider: str, n_cols: int, dtype: torch.dtype):
    x = torch.randn(rows_for(n_cols), n_cols, device=DEVICE, dtype=dtype)
    if provider == "triton (looped)":
        return lambda: softmax_forward(x, launch=LOOPED_LAUNCH)
    return forward_call(provider, x)


long_bench = kit.Benchmark(
    name="softmax-long-rows",
    x_name="N (columns), M = 2^26 / N rows",
    x_values=[65_536, 98_304, 131_072, 262_144],
    providers=["triton", "triton (looped)", *PROVIDERS[1:]],
    make=make_long,
    work=forward_bytes,
    dtypes=(torch.float32, torch.float16),
    smoke_x=kit.choose(gpu=65_536, cpu=MAX_FUSED_BLOCK + 1),
    headline_x=131_072,
)
kit.run(long_bench)

# %%
# Splitting the row pays: in fp32 the split kernel runs at 2.25 to 2.39 TB/s from N = 65,536
# to 262,144, 1.55 to 1.65x the looped kernel (1.37 to 1.51) and ``torch.softmax`` (1.43 to
# 1.46), and ahead of ``torch.compile`` (1.33 to 1.97). In fp16 it reaches 1.45 to 1.70 TB/s:
# ahead of ``torch.softmax`` (1.32 to 1.50) and of the looped kernel (0.96 to 1.14), level with
# ``torch.compile`` (0.95 to 1.76, ahead of ours by 3 to 4% at 65,536 and 131,072). The
# 2.2 TB/s floor is met in fp32 and missed in fp16. The sweep behind the chunk sizes
# (``tools/experiments/softmax_split_rows.py``) points at where the fp16 time goes: with the
# same bytes per program fp16 runs slower than fp32, and larger chunks do not help, so the
# cost is per value held, not bytes in flight; we have not yet measured which part (the
# conversion, the exponentials, the wait) it is.
#
# Forward and backward
# --------------------
# Training runs both. Each provider computes y from x and then dx from dy through
# ``torch.autograd.grad``; for ours that is our forward kernel, then our backward kernel.


def make_forward_backward(provider: str, n_cols: int, dtype: torch.dtype):
    x = torch.randn(rows_for(n_cols), n_cols, device=DEVICE, dtype=dtype)
    x.requires_grad_(True)
    dy = torch.randn_like(x)
    if provider == "torch.compile":
        fn = kit.compile_static(torch_softmax)
        torch.autograd.grad(fn(x), x, dy)  # compile forward and backward now
    else:
        fn = {"triton": softmax, "torch": torch_softmax, "naive": naive_softmax}[
            provider
        ]
    return lambda: torch.autograd.grad(fn(x), x, dy)


def forward_backward_bytes(n_cols: int, dtype: torch.dtype) -> int:
    return 5 * rows_for(n_cols) * n_cols * dtype.itemsize


forward_backward_bench = kit.Benchmark(
    name="softmax-forward-backward",
    x_name="N (columns); M = 4096, or 2^26 / N from N = 65,536",
    x_values=[2**i for i in range(8, 19)],
    providers=PROVIDERS,
    make=make_forward_backward,
    work=forward_backward_bytes,
    dtypes=(torch.float32, torch.float16),
    smoke_x=100,
    headline_x=4096,
)
kit.run(forward_backward_bench)

# %%
# Ours is ahead of ``torch`` at every N in both dtypes (2.80 against 1.67 TB/s in fp32 and 2.61
# against 1.31 in fp16 at N = 4,096) and level with ``torch.compile`` in fp32 (2.82), ahead in
# fp16 (2.18). The 2.4 TB/s floor holds from N = 2,048 to 16,384 in both dtypes (2.61 to 2.96)
# and is missed at N = 32,768 (2.30 in fp32, 2.13 in fp16): the backward holds two tensors
# of the row, so from N = 32,768 it takes its looped kernel, which reads y and dy twice.
# Longer rows fall to 1.9 to 2.0 (fp32) and 1.4 to 1.6 (fp16) TB/s for the same reason. At
# N = 32,768 ``torch.compile`` is ahead of us (2.81 against 2.30 TB/s in fp32, 2.51 against
# 2.13 in fp16), and in fp16 up to N = 131,072 (1.73 against 1.50); we have not looked at
# its generated code. A split-row backward, like the forward's, is the fix (exercise 3).

# %%
# What a call costs the CPU
# -------------------------
# The GPU times above leave out the CPU, which issues each call: the Python wrapper, Triton's
# launcher, and for the backward, autograd's engine calling our Python ``backward`` from its
# own thread. Here is that CPU time, per forward+backward call, measured by issuing 200 calls
# back to back and dividing (the GPU is drained before and after, so it never waits on the
# GPU).

cpu_bench = kit.Benchmark(
    name="softmax-cpu-per-call",
    x_name="N (columns), M = 4096 rows, forward + backward",
    x_values=[1024, 4096, 16384],
    providers=PROVIDERS[:3],
    make=make_forward_backward,
    work=forward_backward_bytes,
    unit=kit.CPU_UNIT,
    dtypes=(torch.float16,),
    smoke_x=100,
    headline_x=4096,
)
kit.run(cpu_bench)

# %%
# About 360 µs of CPU for our forward+backward against 119 µs for ``torch.softmax``, and
# ``torch.compile`` at 460: both Python-driven paths pay for a Python ``backward`` called from
# autograd's engine. At N = 4,096 in fp16 the GPU work of our two kernels takes 60 µs, so a
# program that calls this layer alone from Python, one call at a time, waits on the CPU while
# the GPU sits idle. On the H100 this timed at 257 µs per call when timed as Python calls,
# against 60 µs of GPU work: 650 GB/s instead of 2.8 TB/s (the log is in
# ``results/nvidia-h100-80gb-hbm3/experiments/``). The ways out are the ones PyTorch users
# already know: give the GPU more work per call (larger batches, more fusion), or take Python
# out of the loop by capturing the step in a CUDA graph, as
# ``torch.compile(mode="reduce-overhead")`` does.
#
# What we learned
# ---------------
# * Fusion turns softmax's eight passes over memory into two; after that, the work is keeping
#   enough bytes in flight, which is a matter of launch parameters, not of the kernel's math.
# * Short rows want several rows per program; long rows want more warps. A persistent,
#   pipelined grid, a textbook step, measured no faster: measure before you keep a trick.
# * The online softmax finds the maximum and the sum in one pass, so rows of any length work
#   with one extra read; splitting a row over programs that publish (max, sum) pairs and wait
#   for one another removes that read, 1.6x faster in fp32. Programs that wait for others need
#   a release/acquire pair and a way out when the others never come.
# * A fast kernel can still be a slow layer: called from Python through autograd, our
#   forward+backward costs the CPU six times its GPU time at N = 4,096. Measure the layer,
#   not just the kernel.
# * Both backwards are a row reduction and an elementwise step, and need only the forward's
#   output.
#
# Exercises
# ---------
# 1. Add a ``scale`` argument and an additive ``mask`` tensor, fused into the load:
#    softmax(scale * x + mask), the core of attention. How many bytes does the mask add?
# 2. Fuse the cross-entropy loss: for logits x and a target index per row, compute
#    log_softmax(x)[target] without writing the log-softmax out. What is the traffic now?
# 3. Write the backward for long rows the way the split forward works: each program holds a
#    chunk of y and dy, publishes its part of sum(y * dy), and waits for the row's total.
#    How many bytes does it save over the looped backward at N = 131,072?
