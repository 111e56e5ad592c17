"""Chapter 02's split forward with several rows a program, the next row's chunk loaded early.

The package's split forward gives a program one chunk of one row: it loads the chunk, reduces it,
publishes its (max, sum) pair, waits for the row's other chunks, and writes y. While it waits,
nothing of its own is in flight from memory, and about two programs fit an SM: in fp16 the
forward reaches 70 to 75% of a copy (``softmax-long-rows.csv``, 2026-11-26). Chapter 13's
layer-norm backward met the same wait and loads its next batch of rows before waiting. Here
program (g, c) owns chunk c of the ``ROWS`` rows of group g: after publishing row r's pair it
issues the load of row r + 1's chunk, then waits for row r's pairs and writes row r's y. Rows
of a group run one after the other, so each wait has a load in flight behind it.

``HOLD`` keeps row r's chunk in registers through the wait (the package does so in fp32);
without it, the chunk is read again from L2 after the wait (the package in 16-bit types).

    python lab/softmax_split_prefetch.py              # GPU: time; CPU: check
    TRITON_INTERPRET=0 PYTHONPATH=src python lab/softmax_split_prefetch.py --registers

Under the interpreter (programs run one by one) every chunk but a row's last takes the way out;
the check covers both paths against torch. On a GPU it times, at M = 2^26 / N rows, the
package's forward, a copy of the same bytes and this kernel over rows a program, chunk, warps
and HOLD, in GB/s of GPU time. ``--registers`` compiles it for sm_90 without a GPU
(``softmax_split_way_out.registers``) and prints registers a thread and programs an SM.
"""

import itertools
import os
import sys

import numpy as np

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--registers" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

from softmax_split_way_out import (
    FORWARD_ARGUMENTS,
    combine_pairs,
    print_rates,
    programs_per_sm,
    registers,
)
from stepkernels.lessons import bench
from stepkernels.ops.softmax import WAY_OUT_BLOCK, load_f32, online_max_and_sum, softmax_forward
from stepkernels.runtime.core import DEVICE, ON_GPU
from stepkernels.runtime.waiting import MAX_POLLS, publish, wait_for
import torch
import triton
import triton.language as tl


@triton.jit
def prefetch_forward_kernel(
    x_ptr, y_ptr, stats_ptr, counter_ptr, n_cols, n_chunks, x_row_stride, y_row_stride,
    n_rows, BLOCK_N: tl.constexpr, CHUNKS_POW2: tl.constexpr, MAX_POLLS: tl.constexpr,
    ROWS: tl.constexpr, HOLD: tl.constexpr,
):  # fmt: skip
    """Softmax of chunk c of rows g * ROWS ... (g + 1) * ROWS - 1, for program g * n_chunks + c."""
    group = tl.program_id(0) // n_chunks
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    first = group * ROWS
    last = tl.minimum(first + ROWS, n_rows)
    x_next = tl.load(
        x_ptr + first.to(tl.int64) * x_row_stride + cols, mask=in_row, other=-float("inf"),
        eviction_policy="evict_last",
    )  # fmt: skip
    for row in range(first, last):
        x = x_next.to(tl.float32)
        row64 = first.to(tl.int64) + (row - first)  # (the interpreter's row is an int)
        x_row = x_ptr + row64 * x_row_stride
        chunk_max = tl.max(x, axis=0)
        chunk_shift = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
        row_stats = stats_ptr + row64 * 2 * CHUNKS_POW2
        tl.store(row_stats + chunk, chunk_max)
        tl.store(row_stats + CHUNKS_POW2 + chunk, tl.sum(tl.exp(x - chunk_shift), axis=0))
        publish(counter_ptr, row)
        # the next row's chunk, in flight while we wait for this row's pairs
        next_ok = tl.where(last > row + 1, in_row, False)  # (not &: the interpreter)
        x_next = tl.load(
            x_row + x_row_stride + cols, mask=next_ok, other=-float("inf"),
            eviction_policy="evict_last",
        )  # fmt: skip
        if wait_for(counter_ptr, row, n_chunks, MAX_POLLS):
            row_max, row_shift, row_sum = combine_pairs(row_stats, n_chunks, CHUNKS_POW2)
        else:
            row_max, row_sum = online_max_and_sum(x_row, n_cols, WAY_OUT_BLOCK, 1)
            row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
        if not HOLD:
            x = load_f32(x_row + cols, in_row, -float("inf"), "evict_first")
        y = tl.exp(x - row_shift) * (1.0 / row_sum)
        y_row = y_ptr + row64 * y_row_stride
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


def prefetch_forward(x, block_n, num_warps, rows, hold):
    """Softmax over the rows of a contiguous 2-D ``x`` with ``prefetch_forward_kernel``."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    n_chunks = triton.cdiv(n_cols, block_n)
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    stats = torch.empty((n_rows, 2, chunks_pow2), device=x.device)
    counters = torch.zeros(n_rows, device=x.device, dtype=torch.int32)
    grid = (triton.cdiv(n_rows, rows) * n_chunks,)
    prefetch_forward_kernel[grid](
        x, y, stats, counters, n_cols, n_chunks, x.stride(0), y.stride(0), n_rows,
        BLOCK_N=block_n, CHUNKS_POW2=chunks_pow2, MAX_POLLS=MAX_POLLS, ROWS=rows, HOLD=hold,
        num_warps=num_warps,
    )  # fmt: skip
    return y


LAUNCHES = [(8192, 4), (8192, 8), (4096, 4)]
ROWS = [1, 2, 4, 8]


def check():
    x = torch.randn(7, 20_000, device=DEVICE) * 4
    x[2, ::3], x[5] = -float("inf"), -float("inf")  # masked values; a row of only -inf: NaN
    expected = torch.softmax(x, dim=-1)
    for rows, hold in itertools.product((1, 3, 8), (False, True)):
        with np.errstate(invalid="ignore"):  # the row of -inf, NaN as on a GPU
            y = prefetch_forward(x, 4096, 4, rows, hold)
        torch.testing.assert_close(y, expected, equal_nan=True)
    print("the prefetching forward matches torch (rows a program 1, 3, 8; held and read again)")


def count_registers():
    print(f"registers a thread (r) and programs an SM (p), sm_90, triton {triton.__version__}")
    arguments = [*FORWARD_ARGUMENTS, ("n_rows", "i32")]
    for dtype, hold in (("fp16", False), ("fp16", True), ("fp32", True)):
        line = f"{dtype} {'held' if hold else 'read again':10s}"
        for (block_n, warps), rows in itertools.product(LAUNCHES, (1, 4)):
            constants = {"BLOCK_N": block_n, "CHUNKS_POW2": 8, "MAX_POLLS": 100_000,
                         "ROWS": rows, "HOLD": hold}  # fmt: skip
            regs, stack = registers(prefetch_forward_kernel, arguments, dtype, constants, warps)
            spill = f" +{stack} B stack" if stack else ""
            line += f"  {block_n}/{warps}w/{rows}r {regs:3d} r {programs_per_sm(regs, warps)} p{spill}"
        print(line, flush=True)


def sweep(dtype, n_cols):
    x = torch.randn(2**26 // n_cols, n_cols, device=DEVICE, dtype=dtype)
    size = x.numel() * x.element_size()
    forward = {"copy": bench.copy_of(2 * size), "package": lambda: softmax_forward(x)}
    holds = (True,) if dtype == torch.float32 else (False, True)
    for (block_n, warps), rows, hold in itertools.product(LAUNCHES, ROWS, holds):
        name = f"{block_n}/{warps}w/{rows}r{' held' if hold else ''}"
        forward[name] = lambda b=block_n, w=warps, r=rows, h=hold: prefetch_forward(x, b, w, r, h)
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype != torch.float32 else {}
    torch.testing.assert_close(prefetch_forward(x, 8192, 8, 4, False), softmax_forward(x), **tolerance)
    print_rates(x, forward, {})


if __name__ == "__main__":
    if "--registers" in sys.argv:
        count_registers()
    else:
        check()
        for dtype, n_cols in itertools.product((torch.float16, torch.float32), (65_536, 262_144)):
            if ON_GPU:
                sweep(dtype, n_cols)
