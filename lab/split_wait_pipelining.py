"""Does Triton's software pipeliner stage a split kernel's loads in shared memory?

Chapter 13's split layer-norm backward holds the next batch of x and dy in registers while it
waits, and registers cap it at 2 programs an SM. Triton's pipeliner can instead stage a loop's
loads in shared memory (``cp.async``, ``tl.range(..., num_stages=...)``), if it accepts the
loop. This compiles, for sm_90 on the CPU machine, a loop shaped like the split backward's
batches (load x and dy, store a row sum, read the sums back, store dx) with one suspect added
at a time, and counts the asynchronous copies in the generated TTGIR: 0 means not pipelined.

    PYTHONPATH=src python lab/split_wait_pipelining.py

The CPU machine's Triton (3.9) may pipeline otherwise than the H100's (3.6): a lead, not a
measurement.
"""

import os

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"

import sm90
from stepkernels.runtime.waiting import publish, wait_for
import triton
import triton.language as tl

SUSPECTS = {
    0: "nothing between the loads and the stores",
    1: "publish (barrier + release increment) and wait_for (a loop of acquire reads)",
    2: "publish and one acquire read",
    3: "publish and a for loop of 4 acquire reads",
    4: "tl.debug_barrier() alone",
    5: "a relaxed atomic increment alone",
    6: "a release atomic increment alone",
    7: "wait_for alone (its while loop, no barrier)",
    8: "one acquire read alone",
    9: "8 polls unrolled with tl.static_range, each an acquire read under an if",
}


@triton.jit
def batch_loop(x_ptr, dy_ptr, dx_ptr, sums_ptr, counter_ptr, stride, M,
               BLOCK_N: tl.constexpr, BATCH: tl.constexpr, SUSPECT: tl.constexpr):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_batch = tl.arange(0, BATCH)
    for start in tl.range(0, M, BATCH, num_stages=3):
        rows = start + in_batch
        offsets = rows.to(tl.int64)[:, None] * stride + cols[None, :]
        x = tl.load(x_ptr + offsets).to(tl.float32)
        dy = tl.load(dy_ptr + offsets).to(tl.float32)
        tl.store(sums_ptr + rows, tl.sum(x * dy, axis=1))
        if SUSPECT == 1:
            publish(counter_ptr, start)
            wait_for(counter_ptr, start, 4, 100)
        if SUSPECT == 2 or SUSPECT == 3:
            publish(counter_ptr, start)
        if SUSPECT == 2 or SUSPECT == 8:
            tl.atomic_add(counter_ptr + start, 0, sem="acquire")
        if SUSPECT == 3:
            for _ in range(4):
                tl.atomic_add(counter_ptr + start, 0, sem="acquire")
        if SUSPECT == 4:
            tl.debug_barrier()
        if SUSPECT == 5 or SUSPECT == 6:
            tl.atomic_add(counter_ptr + start, 1, sem="relaxed" if SUSPECT == 5 else "release")
        if SUSPECT == 7:
            wait_for(counter_ptr, start, 4, 100)
        if SUSPECT == 9:
            seen = tl.atomic_add(counter_ptr + start, 0, sem="acquire")
            for _ in tl.static_range(8):
                if seen < 4:
                    seen = tl.atomic_add(counter_ptr + start, 0, sem="acquire")
        total = tl.load(sums_ptr + rows, volatile=True)
        dx = (dy - x * total[:, None]).to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offsets, dx)


SIGNATURE = {"x_ptr": "*fp16", "dy_ptr": "*fp16", "dx_ptr": "*fp16", "sums_ptr": "*fp32",
             "counter_ptr": "*i32", "stride": "i32", "M": "i32"}  # fmt: skip

if __name__ == "__main__":
    print(f"Triton {triton.__version__}, sm_90, fp16, 8 x 1,024 batches, 4 warps, num_stages=3")
    for suspect, what in SUSPECTS.items():
        compiled = sm90.compile_sm90(batch_loop, SIGNATURE,
                                     {"BLOCK_N": 1024, "BATCH": 8, "SUSPECT": suspect},
                                     aligned=("x_ptr", "dy_ptr", "dx_ptr", "stride"),
                                     num_warps=4, num_stages=3)  # fmt: skip
        copies = compiled.asm["ttgir"].count("async_copy_global_to_local")
        print(f"{suspect}: {copies} asynchronous copies   {what}", flush=True)
