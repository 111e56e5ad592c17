"""The layer-norm backward's time, with and without dW and dB, and dW and dB by atomics.

Run from the repository root (``PYTHONPATH=src``)::

    python lab/layer_norm_backward_parts.py   # GPU: time; CPU: check

For M = 4,096 rows of N = 1,024 to 16,384 columns, fp16 and fp32, GB/s of the backward's
compulsory bytes (x and dy read, dx written; the benchmark's count) for:

* ``two-stage``: the package's backward as the layer runs it (a row of partial dW and dB sums a
  program, then ``sum_partials_kernel``);
* ``dx only``: the same launch with dW and dB not wanted (no partials, no second kernel);
* ``atomic``: chapter 03's kernel with its flush replaced: each program adds its dW and dB sums
  into fp32 sums with atomics, and the last program to finish (a counter) casts them into dW
  and dB and zeroes the sums, as chapter 06's backward does for db; at the package's rows a
  program and at half as many (twice the programs).

From N = 16,384 the package splits rows over programs (chapter 13); the atomic variant covers
the one-block kernel only, up to 8,192.

``--kept`` splits what dW and dB cost at N = 4,096 and 8,192, alternating (mean of 3): the
package's first kernel alone (partial rows written, no ``sum_partials_kernel``), and a variant
that accumulates dW and dB but never writes them (a flush behind a test of N < 0, which the
compiler cannot drop), beside ``two-stage`` and ``dx only``.
"""

import itertools
import sys

from layer_norm_backward_launch import alternating, inputs, shares
import sm90
from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import backward_config, layer_norm_backward, layer_norm_backward_kernel
from stepkernels.runtime import core
import torch
import triton

# The package's flush, as chapter 03 writes it (the replacements below need its exact text).
FLUSH = """        buffers, slots = (partial_ptr, lock_ptr), (slot, slot, num_locks)
        flush_partials(buffers, (dw, db), (cols, col_mask), N, slots, REDUCTION)
"""
ATOMIC = """        tl.atomic_add(partial_ptr + cols, dw, mask=col_mask, sem="relaxed")
        tl.atomic_add(partial_ptr + N + cols, db, mask=col_mask, sem="relaxed")
        tl.debug_barrier()  # every thread of this program has added
        arrived = tl.atomic_add(lock_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:  # the last: dW, dB, then sums and counter to 0
            dw = tl.load(partial_ptr + cols, mask=col_mask, cache_modifier=".cg")
            db = tl.load(partial_ptr + N + cols, mask=col_mask, cache_modifier=".cg")
            tl.store(dw_ptr + cols, dw.to(dw_ptr.dtype.element_ty), mask=col_mask)
            tl.store(db_ptr + cols, db.to(db_ptr.dtype.element_ty), mask=col_mask)
            tl.store(partial_ptr + cols, tl.zeros_like(dw), mask=col_mask)
            tl.store(partial_ptr + N + cols, tl.zeros_like(db), mask=col_mask)
            tl.store(lock_ptr, 0)
"""
SIGNATURE = "    partial_ptr,\n    lock_ptr,\n    x_row_stride,\n"  # the kernel's arguments, one a line
WITH_SUMS = "    partial_ptr,\n    lock_ptr,\n    dw_ptr,\n    db_ptr,\n    x_row_stride,\n"
atomic_kernel = sm90.kernel_variant(
    layer_norm_backward_kernel,
    "layer_norm_atomic",
    [(FLUSH, ATOMIC, 1), (SIGNATURE, WITH_SUMS, 1)],
)

kept_kernel = sm90.kernel_variant(
    layer_norm_backward_kernel,
    "layer_norm_kept",
    [(FLUSH, "        if N < 0:\n    " + FLUSH.replace("\n        ", "\n            "), 1)],
)


def first_kernel(kernel, dy, x, weight, mean, rstd):
    """The backward's first kernel alone, at the package's launch, partial rows included."""
    (n_rows, n_cols), config = x.shape, backward_config(x.shape[1], x.shape[0], itemsize=x.element_size())
    n_programs = triton.cdiv(n_rows, config["ROWS_PER_PROGRAM"])
    partials = torch.empty((n_programs, 2, n_cols), device=x.device)
    dx = torch.empty_like(x)
    kernel[(n_programs,)](
        x, dy, dx, weight, mean, rstd, partials, partials, x.stride(0), dy.stride(0), dx.stride(0),
        n_rows, n_cols, 0, HAS_WEIGHT=True, REDUCTION="two-stage", GROUP_SIZE_M=1, **config,
    )  # fmt: skip
    return dx, partials


class AtomicBackward:
    """dx, dW, dB by the atomic variant, with ``rows`` a program (default: the package's)."""

    def __init__(self, dy, x, weight, mean, rstd, rows=None):
        self.args = (dy, x, weight, mean, rstd)
        self.config = dict(backward_config(x.shape[1], x.shape[0], itemsize=x.element_size()))
        self.config["ROWS_PER_PROGRAM"] = rows or self.config["ROWS_PER_PROGRAM"]
        self.sums = torch.zeros(2, x.shape[1], device=x.device)
        self.counter = torch.zeros(1, device=x.device, dtype=torch.int32)

    def __call__(self):
        dy, x, weight, mean, rstd = self.args
        dx = torch.empty_like(x)
        dw, db = torch.empty_like(weight), torch.empty_like(weight)
        grid = (triton.cdiv(x.shape[0], self.config["ROWS_PER_PROGRAM"]),)
        atomic_kernel[grid](
            x, dy, dx, weight, mean, rstd, self.sums, self.counter, dw, db,
            x.stride(0), dy.stride(0), dx.stride(0), *x.shape, 0,
            HAS_WEIGHT=True, REDUCTION="atomic", GROUP_SIZE_M=1, **self.config,
        )  # fmt: skip
        return dx, dw, db


def check():
    for dtype, (n_rows, n_cols) in itertools.product((torch.float32, torch.float16), ((37, 100), (300, 64))):
        args = inputs(n_rows, n_cols, dtype)
        want = layer_norm_backward(*args)
        for rows in (None, 1):
            backward = AtomicBackward(*args, rows)
            for _ in range(2):
                got = backward()
                torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
                for ours, theirs in zip(got[1:], want[1:], strict=True):
                    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
            assert not backward.sums.any() and not backward.counter.any()
    print("the atomic variant gives the package's dx, dW and dB, twice (sums and counter back at 0)")


def sweep():
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (1024, 2048, 4096, 8192, 16384)):
        args = inputs(4096, n_cols, dtype)
        nbytes = 3 * args[1].numel() * args[1].element_size()
        copy = bench.rate(nbytes, bench.copy_of(nbytes))
        calls = {
            "two-stage": lambda a=args: layer_norm_backward(*a),
            "dx only": lambda a=args: layer_norm_backward(*a, False, False),
        }
        if n_cols <= 8192:
            rows = backward_config(n_cols, 4096, itemsize=args[1].element_size())["ROWS_PER_PROGRAM"]
            calls[f"atomic {rows} rows"] = AtomicBackward(*args)
            calls[f"atomic {rows // 2} rows"] = AtomicBackward(*args, rows // 2)
        line = f"{core.dtype_name(dtype)}, N = {n_cols:,}: copy {copy:,.0f}"
        for label, call in calls.items():
            gbs = bench.rate(nbytes, call)
            line += f"  {label} {gbs:,.0f} ({gbs / copy:.0%})"
        print(line, flush=True)


def kept():
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (4096, 8192)):
        args = inputs(4096, n_cols, dtype)
        nbytes = 3 * args[1].numel() * args[1].element_size()
        copy = bench.rate(nbytes, bench.copy_of(nbytes))
        calls = {
            "two-stage": lambda a=args: layer_norm_backward(*a),
            "first kernel alone": lambda a=args: first_kernel(layer_norm_backward_kernel, *a),
            "accumulated, not written": lambda a=args: first_kernel(kept_kernel, *a),
            "dx only": lambda a=args: layer_norm_backward(*a, False, False),
        }
        print(
            f"{core.dtype_name(dtype)}, N = {n_cols:,}: copy {copy:,.0f};",
            shares(alternating(calls, nbytes), copy),
            flush=True,
        )


if __name__ == "__main__":
    if "--kept" in sys.argv:
        args = inputs(37, 300, torch.float16)
        torch.testing.assert_close(first_kernel(kept_kernel, *args)[0], layer_norm_backward(*args)[0], rtol=0, atol=0)
        print("the kept variant gives the package's dx")
        if core.ON_GPU:
            with bench.side_stream():
                kept()
    else:
        check()
        if core.ON_GPU:
            with bench.side_stream():
                sweep()
