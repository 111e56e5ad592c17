"""runtime.waiting: the code of chapter 02, Fused softmax: one pass over memory, for rows of any
length."""

# Generated from tutorials/02-fused-softmax.py by tools/export.py: edit the chapter, then `make
# export`.

from stepkernels.runtime.core import ON_GPU
import triton
import triton.language as tl

# Split kernels: the tries before a program stops waiting and reads the row itself.
MAX_POLLS = 100_000 if ON_GPU else 2


@triton.jit
def publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS: tl.constexpr):
    """Announce this program's stores to the other programs of its row, then wait (at
    most MAX_POLLS tries) until all ``n_chunks`` have announced theirs. True if they all
    did."""
    publish(counter_ptr, row)
    return wait_for(counter_ptr, row, n_chunks, MAX_POLLS)


@triton.jit
def publish(counter_ptr, row):
    tl.debug_barrier()  # every thread of this program has stored
    tl.atomic_add(counter_ptr + row, 1, sem="release")


@triton.jit
def wait_for(counter_ptr, row, n_chunks, MAX_POLLS: tl.constexpr):
    published = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
    polls = 0
    while (published < n_chunks) & (polls < MAX_POLLS):
        published = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
        polls += 1
    return published >= n_chunks
