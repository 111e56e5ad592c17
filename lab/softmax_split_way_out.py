"""Chapter 02's split kernels: does the way out set their registers?

A split program that finds its siblings not running takes a way out: it walks the whole row
itself (the forward with ``online_max_and_sum``, the backward with a loop of sums), until
chapter 02 took this script's finding, in blocks of its own chunk, ``BLOCK_N`` values.
That path almost never runs, but registers are given out once for the whole kernel: compiled
for sm_90 by the Triton of the CPU machine (3.9), the package's forward at its launch then
(4,096 values, 4 warps) took 168 registers a thread, 94 with the walk in blocks of 1,024
values: 5 programs an SM instead of 3
(``softmax_split_way_out_registers.log``). This script compiles and times kernels whose way
out walks in blocks of ``WAY_OUT_BLOCK`` values:

    TRITON_INTERPRET=0 PYTHONPATH=src python lab/softmax_split_way_out.py --registers
    python lab/softmax_split_way_out.py          # GPU: time them

``--registers`` needs no GPU (Triton's wheel carries ``ptxas`` and ``cuobjdump``): registers a
thread (with the stack bytes of spilled ones) and programs an SM (65,536 registers, at most 64
warps) for the package's split kernels and the variants below, at the launches timed. The
GPU machine's Triton (3.6) may allocate otherwise: the counts are a lead. Without
``--registers`` and without a GPU the script checks the variants against torch under the
interpreter; with a GPU it times, at M = 2^26 / N, the package's forward and backward against
the variants (softmax only; ``REREAD`` loads y and dy again after the wait), next to a copy of
the same bytes, in GB/s of GPU time (``softmax_split_way_out.log``: the walk in blocks of
1,024 won, and chapter 02 took it). ``--hold`` then times the package over launches, its
forward against one that keeps its chunk as loaded through the wait instead of reading it again:

    python lab/softmax_split_way_out.py --hold
"""

import os
import re
import subprocess
import sys

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--registers" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import sm90
from stepkernels.lessons import bench
from stepkernels.ops.softmax import (
    Launch,
    load_f32,
    online_max_and_sum,
    softmax_backward,
    softmax_backward_split_kernel,
    softmax_forward,
    softmax_split_kernel,
)
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
from stepkernels.runtime.waiting import MAX_POLLS, publish_and_wait
import torch
import triton
import triton.language as tl


@triton.jit
def combine_pairs(row_stats, n_chunks, CHUNKS_POW2: tl.constexpr):
    """The row's maximum, the shift exp takes (0 for a row of -inf) and its sum of
    exp(x - maximum), from the (max, sum) pairs its chunks published, as the package's kernel."""
    chunks = tl.arange(0, CHUNKS_POW2)
    present = chunks < n_chunks
    maxima = tl.load(row_stats + chunks, mask=present, other=-float("inf"), volatile=True)
    sums = tl.load(row_stats + CHUNKS_POW2 + chunks, mask=present, volatile=True)
    row_max = tl.max(maxima, axis=0)
    row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    return row_max, row_shift, tl.sum(tl.where(present, sums * tl.exp(maxima - row_shift), 0.0))


@triton.jit
def forward_kernel(
    x_ptr, y_ptr, stats_ptr, counter_ptr, n_cols, n_chunks, x_row_stride, y_row_stride,
    BLOCK_N: tl.constexpr, CHUNKS_POW2: tl.constexpr, MAX_POLLS: tl.constexpr,
    WAY_OUT_BLOCK: tl.constexpr, HOLD: tl.constexpr = False,
):  # fmt: skip
    """The package's split forward (softmax only) with the way out in WAY_OUT_BLOCK values;
    HOLD keeps the chunk as loaded (16-bit values take half the registers of fp32) through the
    wait instead of reading it again."""
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    x_row = x_ptr + row * x_row_stride
    x_loaded = tl.load(x_row + cols, mask=in_row, other=-float("inf"), eviction_policy="evict_last")
    x = x_loaded.to(tl.float32)
    chunk_max = tl.max(x, axis=0)
    chunk_shift = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
    row_stats = stats_ptr + row * 2 * CHUNKS_POW2
    tl.store(row_stats + chunk, chunk_max)
    tl.store(row_stats + CHUNKS_POW2 + chunk, tl.sum(tl.exp(x - chunk_shift), axis=0))
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):
        row_max, row_shift, row_sum = combine_pairs(row_stats, n_chunks, CHUNKS_POW2)
    else:
        row_max, row_sum = online_max_and_sum(x_row, n_cols, WAY_OUT_BLOCK, 1)
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    if HOLD:
        x = x_loaded.to(tl.float32)
    else:
        x = load_f32(x_row + cols, in_row, -float("inf"), "evict_first")
    y = tl.exp(x - row_shift) * (1.0 / row_sum)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def backward_kernel(
    y_ptr, dy_ptr, dx_ptr, partial_ptr, counter_ptr, n_cols, n_chunks,
    y_row_stride, dy_row_stride, dx_row_stride,
    BLOCK_N: tl.constexpr, CHUNKS_POW2: tl.constexpr, MAX_POLLS: tl.constexpr,
    WAY_OUT_BLOCK: tl.constexpr, REREAD: tl.constexpr,
):  # fmt: skip
    """The package's split backward (softmax only) with the way out in WAY_OUT_BLOCK values;
    REREAD loads y and dy again after the wait instead of holding them."""
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    y_row, dy_row = y_ptr + row * y_row_stride, dy_ptr + row * dy_row_stride
    y = load_f32(y_row + cols, in_row, 0.0, "evict_last")
    dy = load_f32(dy_row + cols, in_row, 0.0, "evict_last")
    parts = partial_ptr + row * CHUNKS_POW2
    tl.store(parts + chunk, tl.sum(dy * y, axis=0))
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):
        chunks = tl.arange(0, CHUNKS_POW2)
        partials = tl.load(parts + chunks, mask=chunks < n_chunks, other=0.0, volatile=True)
        total = tl.sum(partials, axis=0)
    else:
        lanes = tl.zeros([WAY_OUT_BLOCK], tl.float32)
        for start in range(0, n_cols, WAY_OUT_BLOCK):
            offsets = start + tl.arange(0, WAY_OUT_BLOCK)
            y_part = load_f32(y_row + offsets, offsets < n_cols, 0.0, "")
            lanes += y_part * load_f32(dy_row + offsets, offsets < n_cols, 0.0, "")
        total = tl.sum(lanes, axis=0)
    if REREAD:
        y = load_f32(y_row + cols, in_row, 0.0, "evict_first")
        dy = load_f32(dy_row + cols, in_row, 0.0, "evict_first")
    dx = y * (dy - total)
    tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


def split_call(kernel, tensors, block_n, num_warps, statistics, **constants):
    """Launch a split kernel over contiguous rows, as the package's ``launch_rows`` does."""
    n_rows, n_cols = tensors[0].shape
    n_chunks = triton.cdiv(n_cols, block_n)
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    partials = torch.empty((n_rows, statistics, chunks_pow2), device=tensors[0].device)
    counters = torch.zeros(n_rows, device=partials.device, dtype=torch.int32)
    strides = [t.stride(0) for t in tensors]
    kernel[(n_rows * n_chunks,)](
        *tensors, partials, counters, n_cols, n_chunks, *strides,
        BLOCK_N=block_n, CHUNKS_POW2=chunks_pow2, MAX_POLLS=MAX_POLLS, num_warps=num_warps,
        **constants,
    )  # fmt: skip


def variant_forward(x, block_n, num_warps, way_out, hold=False):
    y = torch.empty_like(x)
    constants = {"WAY_OUT_BLOCK": way_out, "HOLD": hold}
    split_call(forward_kernel, (x, y), block_n, num_warps, 2, **constants)
    return y


def variant_backward(y, dy, block_n, num_warps, way_out, reread):
    dx = torch.empty_like(y)
    constants = {"WAY_OUT_BLOCK": way_out, "REREAD": reread}
    split_call(backward_kernel, (y, dy, dx), block_n, num_warps, 1, **constants)
    return dx


WAY_OUT = 1024
LAUNCHES = [(4096, 4), (8192, 4), (8192, 8), (16384, 8)]


# Registers, without a GPU ------------------------------------------------------------------
# Integers a launch at the timed sizes passes as multiples of 16, which Triton specializes on
# (``tt.divisibility``), as it does every pointer here: without it the counts run higher.
MULTIPLES_OF_16 = ("n_cols", "N", "x_row_stride", "y_row_stride", "dy_row_stride", "dx_row_stride")


def compile_split(kernel, arguments: list, dtype: str, constants: dict, num_warps: int, maxnreg: int | None = None):
    """``kernel`` compiled for sm_90 (no GPU needed), specialized as a launch at the timed
    sizes would be. ``arguments``: (name, kind) pairs, kind "data" for a pointer of ``dtype``."""
    signature = {name: (f"*{dtype}" if kind == "data" else kind) for name, kind in arguments}
    aligned = [name for name, kind in arguments if kind != "i32" or name in MULTIPLES_OF_16]
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return sm90.compile_sm90(kernel, signature, constants, aligned, **options)


def registers(
    kernel, arguments: list, dtype: str, constants: dict, num_warps: int, maxnreg: int | None = None
) -> tuple:
    """Registers a thread of ``kernel`` compiled for sm_90 (at most ``maxnreg``) and its stack
    bytes (spills), read off the cubin."""
    compiled = compile_split(kernel, arguments, dtype, constants, num_warps, maxnreg)
    usage = sm90.nvidia_tool("cuobjdump", "-res-usage", sm90.cubin_file(compiled))
    registers_used = int(re.search(r"REG:(\d+)", usage).group(1))
    return registers_used, int(re.search(r"STACK:(\d+)", usage).group(1))


def programs_per_sm(regs: int, num_warps: int) -> int:
    per_warp = -(-regs * 32 // 256) * 256  # registers are given out per warp, 256 at a time
    return min(65_536 // (per_warp * num_warps), 64 // num_warps)


SCALARS = [("n_cols", "i32"), ("n_chunks", "i32")]
FORWARD_ARGUMENTS = [("x_ptr", "data"), ("y_ptr", "data"), ("stats_ptr", "*fp32"),
                     ("counter_ptr", "*i32"), *SCALARS, ("x_row_stride", "i32"),
                     ("y_row_stride", "i32")]  # fmt: skip
BACKWARD_ARGUMENTS = [("y_ptr", "data"), ("dy_ptr", "data"), ("dx_ptr", "data"),
                      ("partial_ptr", "*fp32"), ("counter_ptr", "*i32"), *SCALARS,
                      ("y_row_stride", "i32"), ("dy_row_stride", "i32"),
                      ("dx_row_stride", "i32")]  # fmt: skip


WALKED_IN_CHUNKS = "a78c087"  # the last commit whose package walked its way out in chunks


# Where the modules that the package's softmax imported before the wings (commit b8fc02f) are now
MOVED = {"stepkernels._core": "stepkernels.runtime.core", "stepkernels.launch": "stepkernels.runtime.launch"}


def package_at(commit: str):
    """``stepkernels.softmax`` as it was at ``commit`` (read with git), imported as a module,
    its imports pointed at the modules' places today."""
    source = subprocess.run(["git", "show", f"{commit}:src/stepkernels/softmax.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    for old, new in MOVED.items():
        source = source.replace(f"from {old} import", f"from {new} import")
    return sm90.module_from_source(f"softmax_{commit}", source)


def count_registers() -> None:
    before = package_at(WALKED_IN_CHUNKS)
    kernels = [
        (f"forward, package at {WALKED_IN_CHUNKS}", before.softmax_split_kernel, FORWARD_ARGUMENTS,
         {"LOG": False}),
        (f"backward, package at {WALKED_IN_CHUNKS}", before.softmax_backward_split_kernel,
         BACKWARD_ARGUMENTS, {"LOG": False}),
        ("forward, package", softmax_split_kernel, FORWARD_ARGUMENTS, {"LOG": False}),
        ("forward, way out 1,024", forward_kernel, FORWARD_ARGUMENTS, {"WAY_OUT_BLOCK": WAY_OUT, "HOLD": False}),
        ("backward, package (held)", softmax_backward_split_kernel, BACKWARD_ARGUMENTS, {"LOG": False}),
        ("backward, held, way out 1,024", backward_kernel, BACKWARD_ARGUMENTS,
         {"WAY_OUT_BLOCK": WAY_OUT, "REREAD": False}),
        ("backward, read again, way out 1,024", backward_kernel, BACKWARD_ARGUMENTS,
         {"WAY_OUT_BLOCK": WAY_OUT, "REREAD": True}),
    ]  # fmt: skip
    print(f"registers a thread (r) and programs an SM (p), sm_90, triton {triton.__version__}")
    for dtype in ("fp16", "fp32"):
        for name, kernel, arguments, extra in kernels:
            line = f"{dtype} {name:38s}"
            for block_n, warps in LAUNCHES:
                constants = {"BLOCK_N": block_n, "CHUNKS_POW2": 8, "MAX_POLLS": 100_000, **extra}
                regs, stack = registers(kernel, arguments, dtype, constants, warps)
                spill = f" +{stack} B stack" if stack else ""
                line += f"  {block_n}/{warps}w {regs:3d} r {programs_per_sm(regs, warps)} p{spill}"
            print(line, flush=True)


# Checks and timings --------------------------------------------------------------------------
def check(n_rows=3, n_cols=40_000, block_n=8192):
    """The variants against torch (fp32; under the interpreter only a row's last chunk finds
    its siblings' statistics, the others take the way out)."""
    x = torch.randn(n_rows, n_cols, device=DEVICE) * 4
    y, dy = torch.softmax(x, dim=-1), torch.randn_like(x)
    for hold in (False, True):
        torch.testing.assert_close(variant_forward(x, block_n, 4, WAY_OUT, hold), y)
    expected = y * (dy - (dy * y).sum(-1, keepdim=True))
    for reread in (False, True):
        torch.testing.assert_close(variant_backward(y, dy, block_n, 4, WAY_OUT, reread), expected)
    print("the variants match torch")


def print_rates(x, forward: dict, backward: dict) -> None:
    """One line each for ``forward`` and ``backward`` calls on rows like ``x``: GB/s of GPU
    time, counting 2 and 3 passes over x's bytes."""
    size = x.numel() * x.element_size()
    for direction, calls, passes in (("forward", forward, 2), ("backward", backward, 3)):
        if not calls:
            continue
        line = f"{direction:8} {dtype_name(x.dtype):8} N={x.shape[1]:7}"
        for name, fn in calls.items():
            line += f"  {name} {bench.rate(passes * size, fn):5.0f}"
        print(line, flush=True)


def rows_and_baselines(dtype, n_cols):
    """M = 2^26 / N rows x, their softmax y, a gradient dy, and the calls every sweep times:
    a copy of the same bytes and the package, forward and backward."""
    x = torch.randn(2**26 // n_cols, n_cols, device=DEVICE, dtype=dtype)
    y, dy = torch.softmax(x, dim=-1), torch.randn_like(x)
    size = x.numel() * x.element_size()
    forward = {"copy": bench.copy_of(2 * size), "package": lambda: softmax_forward(x)}
    backward = {"copy": bench.copy_of(3 * size), "package": lambda: softmax_backward(y, dy)}
    return x, y, dy, forward, backward


def sweep(dtype, n_cols):
    x, y, dy, forward, backward = rows_and_baselines(dtype, n_cols)
    for block_n, warps in LAUNCHES:
        launch = f"{block_n}/{warps}w"
        forward[f"package {launch}"] = lambda b=block_n, w=warps: softmax_forward(
            x, launch=Launch("split", b, num_warps=w)
        )
        forward[f"way out {launch}"] = lambda b=block_n, w=warps: variant_forward(x, b, w, WAY_OUT)
        for reread, name in ((False, "held"), (True, "read again")):
            backward[f"{name} {launch}"] = lambda b=block_n, w=warps, r=reread: variant_backward(
                y, dy, b, w, WAY_OUT, r
            )
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype != torch.float32 else {}
    torch.testing.assert_close(variant_forward(x, 4096, 4, WAY_OUT), softmax_forward(x), **tolerance)
    reference = softmax_backward(y, dy)
    for reread in (False, True):
        dx = variant_backward(y, dy, 8192, 4, WAY_OUT, reread)
        torch.testing.assert_close(dx, reference, **tolerance)
    print_rates(x, forward, backward)


HOLD_LAUNCHES = [(4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16)]


def hold_sweep(dtype, n_cols):
    """``--hold``: the package (its way out in blocks of 1,024 since this script's first run)
    over launches, its forward against one holding its chunk as loaded through the wait."""
    x, y, dy, forward, backward = rows_and_baselines(dtype, n_cols)
    for block_n, warps in HOLD_LAUNCHES:
        launch = Launch("split", block_n, num_warps=warps)
        name = f"{block_n}/{warps}w"
        forward[f"read again {name}"] = lambda la=launch: softmax_forward(x, launch=la)
        forward[f"hold {name}"] = lambda b=block_n, w=warps: variant_forward(x, b, w, WAY_OUT, True)
        backward[name] = lambda la=launch: softmax_backward(y, dy, launch=la)
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype != torch.float32 else {}
    held = variant_forward(x, 8192, 8, WAY_OUT, True)
    torch.testing.assert_close(held, softmax_forward(x), **tolerance)
    print_rates(x, forward, backward)


if __name__ == "__main__":
    if "--registers" in sys.argv:
        count_registers()
    elif "--hold" in sys.argv:
        check()
        for dtype in (torch.float16, torch.float32) if ON_GPU else ():
            for n_cols in (65_536, 131_072, 262_144):
                hold_sweep(dtype, n_cols)
    else:
        check()
        if ON_GPU:
            for dtype in (torch.float16, torch.float32):
                for n_cols in (65_536, 131_072, 262_144):
                    sweep(dtype, n_cols)
