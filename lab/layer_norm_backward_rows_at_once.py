"""Chapter 03's one-block layer-norm backward taking several rows per step of its row loop.

Run from the repository root (``PYTHONPATH=src``)::

    python lab/layer_norm_backward_rows_at_once.py   # GPU: time; CPU: check
    TRITON_INTERPRET=0 PYTHONPATH=src python lab/layer_norm_backward_rows_at_once.py --registers

The package's backward program walks its rows one at a time: load x and dy (pipelined), two
sums across the row (c1, c2: shuffles, shared memory, a barrier), then dx. At M = N = 4,096 in
fp16 it reaches 83% of a copy with one program of 4 warps an SM, against 94% in fp32 (the same
rows, twice the bytes): per element, not per byte, the row's chain of dependent steps seems to
set the pace. Here a step takes ``ROWS_AT_ONCE`` rows as one [R, BLOCK_N] tile, so that R rows'
sums share one chain; dW and dB stay [R, BLOCK_N] in registers and are summed over R at the end.

The variant replaces the package's kernel in ``stepkernels.ops.layer_norm`` for the duration of a
call (an experiment only), so partials and ``sum_partials_kernel`` are the package's. On a GPU
it times M = 4,096 rows of N = 4,096 and 8,192 in fp16 and fp32, over R (1, 2, 4), warps and
stages, 32 rows a program, alternating with the package, in GB/s of the compulsory bytes (x and
dy read, dx written). ``--registers`` compiles the variant for sm_90 without a GPU; ``--sass``
(likewise) counts the SASS instructions of the package's row loop per element, by opcode.
"""

import contextlib
import itertools
import os
import sys

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and {"--registers", "--sass"} & set(sys.argv):
    os.environ["TRITON_INTERPRET"] = "0"

import re

from layer_norm_backward_launch import alternating, inputs, shares
import sm90
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm as package
from stepkernels.runtime import core
import torch
import triton
import triton.language as tl


@triton.jit
def backward_rows_at_once(x_ptr, dy_ptr, dx_ptr, weight_ptr, mean_ptr, rstd_ptr,
        partial_ptr, lock_ptr, x_row_stride, dy_row_stride, dx_row_stride, M, N, num_locks,
        BLOCK_N: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
        REDUCTION: tl.constexpr, GROUP_SIZE_M: tl.constexpr, NUM_STAGES: tl.constexpr,
        ROWS_AT_ONCE: tl.constexpr):  # fmt: skip
    program_id = tl.program_id(axis=0)
    first_row = program_id * ROWS_PER_PROGRAM
    slot = program_id % GROUP_SIZE_M if REDUCTION == "lock" else program_id
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([ROWS_AT_ONCE, BLOCK_N], tl.float32)
    db = tl.zeros([ROWS_AT_ONCE, BLOCK_N], tl.float32)
    for i in tl.range(0, ROWS_PER_PROGRAM, ROWS_AT_ONCE, num_stages=NUM_STAGES):
        rows = first_row + i + tl.arange(0, ROWS_AT_ONCE)
        mask = cols[None, :] < tl.where(rows < M, N, 0)[:, None]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        safe_rows = tl.minimum(rows, M - 1)
        mean = tl.load(mean_ptr + safe_rows)[:, None]
        rstd = tl.load(rstd_ptr + safe_rows)[:, None]
        x_hat, wdy = (x - mean) * rstd, w * dy if HAS_WEIGHT else dy
        c1 = tl.sum(x_hat * wdy, axis=1)[:, None] / N
        c2 = tl.sum(wdy, axis=1)[:, None] / N
        dx = (wdy - (x_hat * c1 + c2)) * rstd
        dx_ptrs = dx_ptr + rows64 * dx_row_stride + cols[None, :]
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw, db = dw + dy * x_hat, db + dy
    if REDUCTION != "none":
        package.flush_partials(partial_ptr, lock_ptr, tl.sum(dw, axis=0), tl.sum(db, axis=0),
                               cols, col_mask, N, slot, slot, num_locks, REDUCTION)  # fmt: skip


@contextlib.contextmanager
def in_package(kernel):
    """The package's backward launching ``kernel`` instead of its own, for the block."""
    kept = package.layer_norm_backward_kernel
    package.layer_norm_backward_kernel = kernel
    try:
        yield
    finally:
        package.layer_norm_backward_kernel = kept


def variant(args, config):
    with in_package(backward_rows_at_once):
        return package.layer_norm_backward(*args, config=config)


def check():
    for dtype, rows_at_once in itertools.product((torch.float32, torch.float16), (1, 2, 4)):
        args = inputs(37, 300, dtype)  # 37 rows: the last program's last step is partly past M
        config = dict(BLOCK_N=512, ROWS_PER_PROGRAM=8, NUM_STAGES=2, num_warps=4)
        want = package.layer_norm_backward(*args, config=config)
        got = variant(args, {**config, "ROWS_AT_ONCE": rows_at_once})
        for ours, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
    print("R rows at once give the package's dx, dW and dB (R = 1, 2, 4)")


def label(config):
    return f"R{config['ROWS_AT_ONCE']} w{config['num_warps']} st{config['NUM_STAGES']}"


def sweep():
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (4096, 8192)):
        args = inputs(4096, n_cols, dtype)
        size = args[1].element_size()
        nbytes = 3 * args[1].numel() * size
        copy = bench.rate(nbytes, bench.copy_of(nbytes))
        base = package.backward_config(n_cols, 4096, itemsize=size)
        rated = []
        for rows_at_once, warps, stages in itertools.product((1, 2, 4), (4, 8, 16), (2, 3, 4)):
            per_thread = rows_at_once * n_cols // (32 * warps)
            smem = stages * 2 * rows_at_once * n_cols * size
            if not 8 <= per_thread <= 64 or smem > 192 * 1024:
                continue
            config = {**base, "ROWS_AT_ONCE": rows_at_once, "num_warps": warps,
                      "NUM_STAGES": stages}  # fmt: skip
            rated.append((bench.rate(nbytes, lambda c=config, a=args: variant(a, c)), config))
        rated.sort(key=lambda r: -r[0])
        name = f"{core.dtype_name(dtype)}, N = {n_cols:,}"
        print(f"{name}: copy {copy:,.0f}; best five:",
              "; ".join(f"{label(c)} {v:,.0f}" for v, c in rated[:5]), flush=True)  # fmt: skip
        calls = {"package": lambda a=args: package.layer_norm_backward(*a)}
        for _, config in rated[:2]:
            calls[label(config)] = lambda c=config, a=args: variant(a, c)
        print("  again, mean of 3 alternating:", shares(alternating(calls, nbytes), copy), flush=True)


def compiled_sm90(kernel, dtype, warps, stages=3, **constants):
    """``kernel`` (the package's or the variant) compiled for sm_90 at N = 4,096."""
    signature = {"x_ptr": f"*{dtype}", "dy_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}",
                     "weight_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                     "partial_ptr": "*fp32", "lock_ptr": "*fp32", "x_row_stride": "i32",
                     "dy_row_stride": "i32", "dx_row_stride": "i32", "M": "i32", "N": "i32",
                     "num_locks": "i32"}  # fmt: skip
    constants = dict(BLOCK_N=4096, ROWS_PER_PROGRAM=32, HAS_WEIGHT=True, REDUCTION="two-stage",
                     GROUP_SIZE_M=64, NUM_STAGES=stages, **constants)  # fmt: skip
    aligned = [name for name in signature if name.endswith(("_ptr", "_stride")) or name == "N"]
    return sm90.compile_sm90(kernel, signature, constants, aligned, num_warps=warps)


def registers():
    for dtype, rows_at_once, warps in itertools.product(("fp16", "fp32"), (1, 2, 4), (4, 8, 16)):
        per_thread = rows_at_once * 4096 // (32 * warps)
        if not 8 <= per_thread <= 64:
            continue
        compiled = compiled_sm90(backward_rows_at_once, dtype, warps, ROWS_AT_ONCE=rows_at_once)
        usage = sm90.nvidia_tool("cuobjdump", "-res-usage", sm90.cubin_file(compiled))
        regs, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
        print(f"{dtype}, N = 4,096, R = {rows_at_once}, {warps} warps: {regs} registers, "
              f"{stack} B of stack")  # fmt: skip


def sass():
    """SASS instructions of the package's row loop per element a thread holds, by opcode."""
    for dtype, stages in (("fp16", 4), ("fp32", 3)):
        compiled = compiled_sm90(package.layer_norm_backward_kernel, dtype, 4, stages)
        counts = sm90.loop_instructions(compiled)
        per_element = 4096 // (4 * 32)
        top = ", ".join(f"{k} {v / per_element:.2f}" for k, v in counts.most_common(12))
        print(f"{dtype}, N = 4,096, 4 warps, {stages} stages: "
              f"{sum(counts.values()) / per_element:.1f} instructions an element ({top})")  # fmt: skip


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass()
    elif "--registers" in sys.argv:
        registers()
    else:
        check()
        if core.ON_GPU:
            with bench.side_stream():
                sweep()
