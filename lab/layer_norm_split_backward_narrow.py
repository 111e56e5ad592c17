"""Chapter 13's split layer-norm backward with fewer registers held across its wait.

Nsight Compute put the package's split backward at 224 registers a thread in fp16 (2 programs of
4 warps an SM) and DRAM 52% busy (``layer_norm_split_ncu.log``). Across each batch's wait it
holds the batch's x_hat and w * dy in fp32 and dy for dW, next to the next batch's loads. The
variant here adds the batch to dW and dB before it waits and holds only x and dy as loaded
(16-bit in fp16), converting them again after the wait. So that the compiler does not reuse the
conversions made before the wait (and hold their fp32 results), the values pass through an
opaque register move (``launder``), on the GPU only: the interpreter runs no inline assembly.

    TRITON_INTERPRET=0 PYTHONPATH=src python lab/layer_norm_split_backward_narrow.py --registers
    python lab/layer_norm_split_backward_narrow.py   # check; on a GPU also time

``--registers`` compiles both for sm_90 on the CPU machine and prints registers a thread and
programs an SM. Otherwise it checks the variant's dx, dW and dB against the package's and, on a
GPU, times both (GB/s of GPU time, M = 4,096 as chapter 03's benchmark) next to a copy of the
same bytes, at the package's launch and with BATCH = 8.
"""

import functools
import os
import sys

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--registers" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

from register_caps import LAYER_NORM_BACKWARD_ARGUMENTS
from softmax_split_way_out import programs_per_sm, registers
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm, long_rows
from stepkernels.ops.long_rows import load_rows
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
from stepkernels.runtime.partials import flush_partials, sum_partials_kernel
from stepkernels.runtime.waiting import MAX_POLLS, publish, wait_for
import torch
import triton
import triton.language as tl


@triton.jit
def launder(x, OPAQUE: tl.constexpr):
    """x through a register move the compiler cannot see into (16-bit values two a register)."""
    if OPAQUE:
        pack: tl.constexpr = 2 if x.dtype.primitive_bitwidth == 16 else 1
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype,
                                         is_pure=False, pack=pack)  # fmt: skip
    return x


@triton.jit
def narrow_backward_kernel(x_ptr, dy_ptr, dx_ptr, weight_ptr, mean_ptr, rstd_ptr,
        partial_ptr, lock_ptr, sums_ptr, counter_ptr, x_row_stride, dy_row_stride,
        dx_row_stride, M, N, num_locks, n_chunks, BLOCK_N: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr, BATCH: tl.constexpr, CHUNKS_POW2: tl.constexpr,
        HAS_WEIGHT: tl.constexpr, REDUCTION: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
        MAX_POLLS: tl.constexpr, OPAQUE: tl.constexpr, WAY_OUT: tl.constexpr = True):  # fmt: skip
    group, chunk = tl.program_id(0) // n_chunks, tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask, in_batch = cols < N, tl.arange(0, BATCH)
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    first = group * ROWS_PER_PROGRAM
    last = tl.minimum(first + ROWS_PER_PROGRAM, M)
    mask = (first + in_batch < last)[:, None] & col_mask[None, :]
    x_next = load_rows(x_ptr, x_row_stride, first + in_batch, cols, mask)
    dy_next = load_rows(dy_ptr, dy_row_stride, first + in_batch, cols, mask)
    for start in range(first, last, BATCH):
        rows = start + in_batch
        row_ok = rows < last
        x_held, dy_held = x_next, dy_next  # as loaded: what the wait holds
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        dy = dy_held.to(tl.float32)
        x_hat = (x_held.to(tl.float32) - mean) * rstd
        wdy = w * dy if HAS_WEIGHT else dy
        parts = sums_ptr + rows.to(tl.int64) * 2 * CHUNKS_POW2
        tl.store(parts + chunk, tl.sum(x_hat * wdy, axis=1), mask=row_ok)
        tl.store(parts + CHUNKS_POW2 + chunk, tl.sum(wdy, axis=1), mask=row_ok)
        dw += tl.sum(dy * x_hat, axis=0)  # before the wait: nothing fp32 is held across it
        db += tl.sum(dy, axis=0)
        batch = group * tl.cdiv(ROWS_PER_PROGRAM, BATCH) + (start - first) // BATCH
        publish(counter_ptr, batch)
        mask = (rows + BATCH < last)[:, None] & col_mask[None, :]
        x_next = load_rows(x_ptr, x_row_stride, rows + BATCH, cols, mask)
        dy_next = load_rows(dy_ptr, dy_row_stride, rows + BATCH, cols, mask)
        if wait_for(counter_ptr, batch, n_chunks, MAX_POLLS) or not WAY_OUT:
            chunks = tl.arange(0, CHUNKS_POW2)
            present = row_ok[:, None] & (chunks < n_chunks)[None, :]
            row_parts = parts[:, None] + chunks[None, :]
            sum_1 = tl.load(row_parts, mask=present, other=0.0, volatile=True)
            sum_2 = tl.load(row_parts + CHUNKS_POW2, mask=present, other=0.0, volatile=True)
            sum_1, sum_2 = tl.sum(sum_1, axis=1), tl.sum(sum_2, axis=1)
        else:  # the package's way out: walk the batch's rows
            sum_1, sum_2 = tl.zeros([BATCH], tl.float32), tl.zeros([BATCH], tl.float32)
            for walk in range(0, N, BLOCK_N):
                walked = walk + tl.arange(0, BLOCK_N)
                mask = row_ok[:, None] & (walked < N)[None, :]
                x_walked = load_rows(x_ptr, x_row_stride, rows, walked, mask)
                x_hat_walked = (x_walked.to(tl.float32) - mean) * rstd
                wdy_walked = load_rows(dy_ptr, dy_row_stride, rows, walked, mask)
                wdy_walked = wdy_walked.to(tl.float32)
                if HAS_WEIGHT:
                    w_walked = tl.load(weight_ptr + walked, mask=walked < N, other=0.0)
                    wdy_walked *= w_walked.to(tl.float32)[None, :]
                sum_1 += tl.sum(x_hat_walked * wdy_walked, axis=1)
                sum_2 += tl.sum(wdy_walked, axis=1)
        x_hat = (launder(x_held, OPAQUE).to(tl.float32) - mean) * rstd
        wdy = launder(dy_held, OPAQUE).to(tl.float32)
        if HAS_WEIGHT:
            wdy *= w
        dx = (wdy - (x_hat * (sum_1 / N)[:, None] + (sum_2 / N)[:, None])) * rstd
        dx_ptrs = dx_ptr + rows.to(tl.int64)[:, None] * dx_row_stride + cols[None, :]
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None] & col_mask)
    if REDUCTION != "none":
        slot = group % GROUP_SIZE_M if REDUCTION == "lock" else group
        flush_partials(partial_ptr, lock_ptr, dw, db, cols, col_mask, N, slot,
                       chunk * GROUP_SIZE_M + slot, num_locks, REDUCTION)  # fmt: skip


def narrow_backward(dy, x, weight, mean, rstd, batch=None, block_size=None):
    """dx, dW, dB by the variant, two-stage, at the package's launch (``batch`` rows a batch)."""
    (n_rows, n_cols), device = x.shape, x.device
    config = dict(layer_norm.backward_config(n_cols, n_rows, block_size))
    config["BATCH"] = batch or config["BATCH"]
    n_groups = triton.cdiv(n_rows, config["ROWS_PER_PROGRAM"])
    n_chunks = triton.cdiv(n_cols, config["BLOCK_N"])
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    dx = torch.empty_like(x)
    dw, db = (torch.empty(n_cols, device=device, dtype=weight.dtype) for _ in "wb")
    partials = torch.empty((n_groups, 2, n_cols), device=device, dtype=torch.float32)
    sums = torch.empty((n_rows, 2, chunks_pow2), device=device, dtype=torch.float32)
    batches = n_groups * triton.cdiv(config["ROWS_PER_PROGRAM"], config["BATCH"])
    counters = torch.zeros(batches, device=device, dtype=torch.int32)
    narrow_backward_kernel[(n_groups * n_chunks,)](x, dy, dx, weight, mean, rstd, partials,
        partials, sums, counters, x.stride(0), dy.stride(0), dx.stride(0), n_rows, n_cols, 0,
        n_chunks, CHUNKS_POW2=chunks_pow2, MAX_POLLS=MAX_POLLS, HAS_WEIGHT=True,
        REDUCTION="two-stage", GROUP_SIZE_M=layer_norm.GROUP_SIZE_M, OPAQUE=ON_GPU,
        **config)  # fmt: skip
    block_n = 128 if ON_GPU else 16
    sum_partials_kernel[(triton.cdiv(n_cols, block_n),)](partials, partials, dw, db,
        n_groups, n_cols, HAS_COUNTS=False, HAS_DW=True, HAS_DB=True, BLOCK_P=32,
        BLOCK_N=block_n, num_warps=4)  # fmt: skip
    return dx, dw, db


def count_registers():
    arguments = LAYER_NORM_BACKWARD_ARGUMENTS
    for dtype in ("fp16", "fp32"):
        config = layer_norm.backward_config(65_536, 4096)
        for batch in (config["BATCH"], 8):
            constants = {"BLOCK_N": config["BLOCK_N"], "BATCH": batch,
                         "ROWS_PER_PROGRAM": config["ROWS_PER_PROGRAM"], "CHUNKS_POW2": 64,
                         "HAS_WEIGHT": True, "REDUCTION": "two-stage",
                         "GROUP_SIZE_M": layer_norm.GROUP_SIZE_M, "MAX_POLLS": 100_000}  # fmt: skip
            line = f"{dtype} BATCH {batch}:"
            for name, kernel, extra in (
                ("package", long_rows.layer_norm_backward_split_kernel, {}),
                ("narrow", narrow_backward_kernel, {"OPAQUE": True, "WAY_OUT": True}),
                ("narrow, not opaque", narrow_backward_kernel, {"OPAQUE": False, "WAY_OUT": True}),
                ("narrow, no way out", narrow_backward_kernel, {"OPAQUE": True, "WAY_OUT": False}),
            ):
                regs, stack = registers(kernel, arguments, dtype, {**constants, **extra}, 4)
                spill = f" +{stack} B stack" if stack else ""
                line += f"  {name} {regs} r {programs_per_sm(regs, 4)} p{spill}"
            print(line, flush=True)


def check_and_time():
    for dtype in (torch.float16, torch.float32):
        for n_cols in (16_384, 32_768, 65_536) if ON_GPU else (3_000,):
            n_rows = 4096 if ON_GPU else 6
            x, dy = (torch.randn(n_rows, n_cols, device=DEVICE, dtype=dtype) for _ in "xd")
            weight = torch.rand(n_cols, device=DEVICE, dtype=dtype) + 0.5
            bias = torch.zeros_like(weight)
            _, mean, rstd = layer_norm.layer_norm_forward(x, weight, bias, 1e-5)
            block = None if ON_GPU else 1024
            package = functools.partial(layer_norm.layer_norm_backward, dy, x, weight, mean,
                                        rstd, block_size=block)  # fmt: skip
            expected = package()
            calls = {"package": package}
            for batch in (None, 8):
                call = functools.partial(narrow_backward, dy, x, weight, mean, rstd, batch,
                                         block)  # fmt: skip
                if ON_GPU or batch is None:
                    for got, want in zip(call(), expected, strict=True):
                        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
                    calls[f"narrow, BATCH {batch or 'as package'}"] = call
            line = f"{dtype_name(dtype)}, N = {n_cols:,}:"
            if ON_GPU:
                size = 3 * x.numel() * x.element_size()
                line += f" copy {bench.rate(size, bench.copy_of(size)):,.0f}"
                line += "".join(f"  {k} {bench.rate(size, f):,.0f}" for k, f in calls.items())
            print(line if ON_GPU else f"{line} the variant matches the package", flush=True)


if __name__ == "__main__":
    count_registers() if "--registers" in sys.argv else check_and_time()
