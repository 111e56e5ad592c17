"""runtime.partials: the code of chapter 03, Layer normalization: forward, backward, and a lock
done right."""

# Generated from tutorials/03-layer-norm.py by tools/export.py: edit the chapter, then `make
# export`.

import triton
import triton.language as tl


@triton.jit
def flush_partials(buffers, sums, columns, N, slots, REDUCTION: tl.constexpr):
    """Hand a program's sums over its rows, ``sums`` = (dw, db), to the ``REDUCTION``.

    ``buffers``: (partial_ptr, lock_ptr), rows of 2 N fp32 sums (N for dW, then N for
    dB), and for "lock" the locks followed by as many visit counters; ``columns``:
    (cols, col_mask), the columns of the row that ``sums`` cover; ``slots``: (slot,
    lock_index, num_locks), the partial row written ("two-stage") or added into under
    lock ``lock_index`` of ``num_locks`` ("lock")."""
    partial_ptr, lock_ptr = buffers
    dw, db = sums
    cols, col_mask = columns
    slot, lock_index, num_locks = slots
    row_ptr = partial_ptr + slot.to(tl.int64) * 2 * N  # N dW sums, then N dB sums, fp32
    if REDUCTION == "two-stage":
        tl.store(row_ptr + cols, dw, mask=col_mask)
        tl.store(row_ptr + N + cols, db, mask=col_mask)
    elif REDUCTION == "lock":
        lock, visits_ptr = lock_ptr + lock_index, lock_ptr + num_locks + lock_index
        while tl.atomic_cas(lock, 0, 1, sem="acquire") == 1:
            pass
        # Held. Count the visit; the first visitor finds garbage and must not read it.
        visits = tl.atomic_add(visits_ptr, 1, sem="relaxed")
        earlier = cols < tl.where(visits > 0, N, 0)
        dw += tl.load(row_ptr + cols, mask=earlier, other=0.0, cache_modifier=".cg")
        db += tl.load(row_ptr + N + cols, mask=earlier, other=0.0, cache_modifier=".cg")
        tl.store(row_ptr + cols, dw, mask=col_mask)
        tl.store(row_ptr + N + cols, db, mask=col_mask)
        tl.debug_barrier()  # every thread's stores issued before the release
        tl.atomic_xchg(lock, 0, sem="release")


from stepkernels.runtime.core import sm_count  # noqa: E402
from stepkernels.runtime.launch import cdiv, lean, next_power_of_2  # noqa: E402


@lean
@triton.jit
def sum_partials_kernel(
    partial_ptr,
    visits_ptr,
    dw_ptr,
    db_ptr,
    num_partials,
    N,
    HAS_COUNTS: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(axis=0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for first in tl.range(0, num_partials, BLOCK_P, num_stages=2):
        slots = first + tl.arange(0, BLOCK_P)
        keep = slots < num_partials
        if HAS_COUNTS:  # lock buffers no program visited hold garbage
            keep = keep & (tl.load(visits_ptr + slots, mask=keep, other=0) > 0)
        mask = keep[:, None] & col_mask[None, :]
        ptrs = partial_ptr + slots.to(tl.int64)[:, None] * 2 * N + cols[None, :]
        if HAS_DW:
            dw += tl.load(ptrs, mask=mask, other=0.0)
        if HAS_DB:
            db += tl.load(ptrs + N, mask=mask, other=0.0)
    if HAS_DW:  # one rounding, into the weight's dtype
        dw_sum = tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty)
        tl.store(dw_ptr + cols, dw_sum, mask=col_mask)
    if HAS_DB:
        db_sum = tl.sum(db, axis=0).to(db_ptr.dtype.element_ty)
        tl.store(db_ptr + cols, db_sum, mask=col_mask)


def sum_partials(partials, visits, dw, db, n_cols, **flags):
    """``sum_partials_kernel`` over the rows of ``partials`` (one a program of the first
    stage), with ``flags`` its HAS_COUNTS, HAS_DW and HAS_DB: narrow column blocks, two
    programs per SM whenever N allows, each program's rows loaded in tiles of up to
    4,096 sums, all in flight together."""
    block_n = min(128, max(16, next_power_of_2(cdiv(n_cols, 2 * sm_count()))))
    n_partials = partials.shape[0]
    block_p = min(next_power_of_2(n_partials), max(32, 4096 // block_n))
    sum_partials_kernel[(cdiv(n_cols, block_n),)](
        partials,
        visits,
        dw,
        db,
        n_partials,
        n_cols,
        **flags,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=4,
    )
