"""Chapter 03's two-stage layer-norm backward with its second stage inside the first kernel.

Run from the repository root (``PYTHONPATH=src``)::

    python lab/layer_norm_backward_one_kernel.py   # GPU: time; CPU: check

At M = 4,096 and N = 4,096 / 8,192 in fp16 the package's backward reaches 83% / 88% of a copy,
while its first kernel without dW and dB reached 83% / 94% before its 4 stages
(``layer_norm_backward_parts.log``). What dW and dB add: each program's partial sums written,
then a second launch, ``sum_partials_kernel``, reading them back. Here the programs finish the
sums themselves: each announces its partials (an atomic count), waits for the others (at most
``MAX_POLLS`` reads), then sums one slice of columns over every partial row, straight from L2,
and writes it as dW and dB. The slices and their order are fixed, so the bits are the same
every run.

A way out keeps it correct when not all programs are resident at once (a busy GPU): a program
that stops waiting leaves its slice unmarked; the last to arrive, which needs no wait, waits
for the others to finish (they have all arrived, so they are running), sums every unmarked
slice and sets the scratch back to zero for the next launch (``core.zeroed``).

Timed against the package, alternating, at M = 4,096 and N = 1,024 to 8,192, fp16 and fp32,
GB/s of the compulsory bytes (x and dy read, dx written): with the scratch kept between calls
(an eager call's) and a fresh zeroed one per call (a CUDA graph's capture makes one, whose
zeroing every replay repeats), and the package without dW and dB (``dx only``).
"""

import itertools

from layer_norm_backward_launch import alternating, inputs, shares
from layer_norm_backward_parts import FLUSH, SIGNATURE, WITH_SUMS
import sm90
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm as package
from stepkernels.runtime import core
from stepkernels.runtime.waiting import MAX_POLLS
import torch
import triton
import triton.language as tl

FINISH = """        finish_sums(partial_ptr, dw_ptr, db_ptr, lock_ptr, N, SLICE, BLOCK_P, PROGRAMS_POW2,
                    MAX_POLLS)  # fmt: skip
"""
CONSTANTS = "SLICE: tl.constexpr, BLOCK_P: tl.constexpr, PROGRAMS_POW2: tl.constexpr, MAX_POLLS: tl.constexpr"


@triton.jit
def sum_slice(partial_ptr, dw_ptr, db_ptr, n_partials, N, slice_index,
        SLICE: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """dW and dB of columns [slice_index * SLICE, + SLICE): the partial rows' sums, in order."""
    cols = slice_index * SLICE + tl.arange(0, SLICE)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_P, SLICE], dtype=tl.float32)
    db = tl.zeros([BLOCK_P, SLICE], dtype=tl.float32)
    for first in tl.range(0, n_partials, BLOCK_P):
        slots = first + tl.arange(0, BLOCK_P)
        mask = (slots < n_partials)[:, None] & col_mask[None, :]
        ptrs = partial_ptr + slots.to(tl.int64)[:, None] * 2 * N + cols[None, :]
        dw += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # L2: not L1's copy
        db += tl.load(ptrs + N, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(dw_ptr + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    tl.store(db_ptr + cols, tl.sum(db, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def finish_sums(partial_ptr, dw_ptr, db_ptr, sync_ptr, N, SLICE: tl.constexpr,
        BLOCK_P: tl.constexpr, PROGRAMS_POW2: tl.constexpr, MAX_POLLS: tl.constexpr):  # fmt: skip
    """After this program's partials are stored: wait for the others', sum a slice."""
    program, n_programs = tl.program_id(axis=0), tl.num_programs(axis=0)
    n_slices = tl.cdiv(N, SLICE)
    arrived_ptr, done_ptr, marks_ptr = sync_ptr, sync_ptr + 1, sync_ptr + 2
    tl.debug_barrier()  # every thread's partial stores issued before the release
    arrived = tl.atomic_add(arrived_ptr, 1, sem="acq_rel") + 1
    last = arrived == n_programs
    polls = 0
    while (arrived < n_programs) & (polls < MAX_POLLS):
        arrived = tl.atomic_add(arrived_ptr, 0, sem="acquire")
        polls += 1
    if last:
        if program < n_slices:
            sum_slice(partial_ptr, dw_ptr, db_ptr, n_programs, N, program, SLICE, BLOCK_P)
        # The others have all arrived, so they run: wait until they are done, then sum the
        # slices none of them summed (those whose wait gave out) and reset the scratch.
        done = tl.atomic_add(done_ptr, 0, sem="acquire")
        while done < n_programs - 1:
            done = tl.atomic_add(done_ptr, 0, sem="acquire")
        slices = tl.arange(0, PROGRAMS_POW2)
        owned = (slices < n_slices) & (slices != program)
        marks = tl.load(marks_ptr + slices, mask=owned, other=1, cache_modifier=".cg")
        if tl.sum(tl.where(marks == 0, 1, 0)) > 0:  # rare: a busy GPU
            for q in range(n_slices):
                if tl.sum(tl.where((slices == q) & (marks == 0), 1, 0)) > 0:
                    sum_slice(partial_ptr, dw_ptr, db_ptr, n_programs, N, q, SLICE, BLOCK_P)
        tl.store(marks_ptr + slices, 0, mask=slices < n_slices)
        tl.store(arrived_ptr, 0)
        tl.store(done_ptr, 0)
    else:
        if (arrived == n_programs) & (program < n_slices):
            sum_slice(partial_ptr, dw_ptr, db_ptr, n_programs, N, program, SLICE, BLOCK_P)
            tl.store(marks_ptr + program, 1)  # published by the release below
        tl.debug_barrier()
        tl.atomic_add(done_ptr, 1, sem="release")


# Chapter 03's kernel with its flush followed by finish_sums; lock_ptr (unused by a
# two-stage flush) carries the scratch.
backward_one_kernel = sm90.kernel_variant(
    package.layer_norm_backward_kernel,
    "layer_norm_one_kernel",
    [
        (FLUSH, FLUSH + FINISH, 1),
        (SIGNATURE, WITH_SUMS, 1),
        ("    NUM_STAGES: tl.constexpr,\n):", "    NUM_STAGES: tl.constexpr,\n    " + CONSTANTS + ",\n):", 1),
    ],
    names={"finish_sums": finish_sums},
)


def one_kernel(dy2d, x2d, weight, mean, rstd, scratch="kept", config=None, max_polls=None):
    """dx, dW, dB as ``package.layer_norm_backward`` (two-stage, weight given) in one launch."""
    (n_rows, n_cols), device = x2d.shape, x2d.device
    config = dict(config or package.backward_config(n_cols, n_rows, itemsize=x2d.element_size()))
    n_programs = triton.cdiv(n_rows, config["ROWS_PER_PROGRAM"])
    slice_width = min(config["BLOCK_N"], max(16, triton.next_power_of_2(triton.cdiv(n_cols, n_programs))))
    programs_pow2 = triton.next_power_of_2(n_programs)
    dx = torch.empty_like(x2d)
    dw, db = (torch.empty(n_cols, device=device, dtype=weight.dtype) for _ in "wb")
    partials = torch.empty((n_programs, 2, n_cols), device=device, dtype=torch.float32)
    size = 2 + programs_pow2
    sync = (core.zeroed(device, size) if scratch == "kept"
            else torch.zeros(size, device=device, dtype=torch.int32))  # fmt: skip
    backward_one_kernel[(n_programs,)](
        x2d, dy2d, dx, weight, mean, rstd, partials, sync, dw, db, x2d.stride(0),
        dy2d.stride(0), dx.stride(0), n_rows, n_cols, 0, HAS_WEIGHT=True, REDUCTION="two-stage",
        GROUP_SIZE_M=1, SLICE=slice_width,
        BLOCK_P=max(1, min(programs_pow2, 4096 // slice_width)), PROGRAMS_POW2=programs_pow2,
        MAX_POLLS=max_polls or MAX_POLLS, **config,
    )  # fmt: skip
    return dx, dw, db


def check():
    torch.manual_seed(0)
    for dtype, (n_rows, n_cols, rows) in itertools.product(
        (torch.float32, torch.float16), ((37, 300, 8), (64, 1000, 4), (5, 70, 1))
    ):
        args = inputs(n_rows, n_cols, dtype)
        block = triton.next_power_of_2(n_cols)
        config = dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, NUM_STAGES=2, num_warps=4)
        want = package.layer_norm_backward(*args, config=config)
        for max_polls in (None, 1):  # 1: the way out, whoever sums the slices
            for _ in range(2):  # the scratch is back at zero for the next launch
                got = one_kernel(*args, config=config, max_polls=max_polls)
                for ours, theirs in zip(got, want, strict=True):
                    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)
        sync = core.zeroed(args[1].device, 2 + triton.next_power_of_2(-(-n_rows // rows)))
        assert not sync.any(), sync
    print("one kernel gives the package's dx, dW and dB, twice, also by the way out")


def sweep():
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (1024, 2048, 4096, 8192)):
        args = inputs(4096, n_cols, dtype)
        nbytes = 3 * args[1].numel() * args[1].element_size()
        copy = bench.rate(nbytes, bench.copy_of(nbytes))
        calls = {
            "package": lambda a=args: package.layer_norm_backward(*a),
            "one kernel": lambda a=args: one_kernel(*a),
            "one kernel, zeroed per call": lambda a=args: one_kernel(*a, scratch="fresh"),
            "dx only": lambda a=args: package.layer_norm_backward(*a, False, False),
        }
        print(
            f"{core.dtype_name(dtype)}, N = {n_cols:,}: copy {copy:,.0f};",
            shares(alternating(calls, nbytes), copy),
            flush=True,
        )


if __name__ == "__main__":
    check()
    if core.ON_GPU:
        with bench.side_stream():
            sweep()
