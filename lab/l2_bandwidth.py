"""How fast the SMs read from L2: the bound behind chapter 07's tile shapes (issue 41).

lab/NOTES.md ("GPT-2 small's products against cuBLAS", cause 3) works out how many bytes a
second the SMs read from L2 when chapter 07's kernel runs at the tensor cores' peak: 15.5 TB/s
with 128 x 128 tiles, 11.6 with 128 x 256, 9.0 for cuBLAS's 192 x 128 pairs that multicast an
operand. Whether that binds depends on the L2's rate, which no recording of this repo gives.

A kernel of ``PER_SM`` programs an SM reads one buffer over and over: each pass reads every
block of it once, the blocks dealt to the programs in turn (a program's share moves by one
block each pass, so no program reads its own blocks again) with ``.cg`` loads, which L1 does
not keep; each program sums what it read so that nothing is left out. A buffer well under the
L2's size stays there after the first pass. The first pass (from HBM: ``bench.measure_ms``
flushes L2 before each replay) is taken out by timing ``passes`` and ``2 x passes``: the rate
is ``passes`` x the buffer's bytes over the difference. A buffer larger than L2 gives HBM's.
Plain loads, not TMA copies: chapter 07's tiles arrive by TMA, whose rate from L2 may differ.
Compiled here for sm_90 (Triton 3.9): 48 registers, no spills, ``LDG.E.128.STRONG.GPU`` (L2)
loads, 4 of 16 bytes a thread an iteration: 80 KB in flight an SM, so the rate is a floor
where the L2's latency times its rate an SM exceeds that.

    python lab/l2_bandwidth.py     # GPU: GB/s by buffer size; CPU: a check at a toy size
"""

from __future__ import annotations

from stepkernels.lessons import bench
from stepkernels.runtime.core import DEVICE, ON_GPU, sm_count
import torch
import triton
import triton.language as tl

BLOCK = 4096  # fp32 values a load of a program: 16 KB, 64 B a thread with 8 warps
PER_SM = 5  # programs an SM: 48 registers x 256 threads x 5 fit 64K; 80 KB in flight
MB = 2**20


@triton.jit
def read_kernel(x_ptr, out_ptr, n_blocks, passes, BLOCK: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for step in range(passes):
        for block in range(program, n_blocks, programs):
            moved = (block + step) % n_blocks  # another program's block each pass
            total += tl.load(x_ptr + moved * BLOCK + offsets, cache_modifier=".cg")
    tl.store(out_ptr + program * BLOCK + offsets, total)


def read(x: torch.Tensor, passes: int, programs: int) -> torch.Tensor:
    """Each program's sums after ``passes`` passes over ``x`` (fp32, a multiple of BLOCK)."""
    out = torch.empty(programs, BLOCK, device=x.device, dtype=torch.float32)
    read_kernel[(programs,)](x, out, x.numel() // BLOCK, passes, BLOCK=BLOCK, num_warps=8)
    return out


def check():
    """Under the interpreter: every value read ``passes`` times, none left out."""
    x = torch.randn(64 * BLOCK, device=DEVICE)
    for passes, programs in ((1, 4), (3, 5)):
        got = read(x, passes, programs).sum(dtype=torch.float64)
        want = passes * x.sum(dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    print("every block read once a pass (toy size, interpreter)")


def rates(megabytes=(4, 8, 16, 24, 32, 48, 64, 1024), passes=20):
    programs = PER_SM * sm_count()
    print(f"{torch.cuda.get_device_name()}: {programs} programs, {passes} and {2 * passes} passes")
    for size in megabytes:
        x = torch.randn(size * MB // 4 // BLOCK * BLOCK, device=DEVICE)
        once = passes if size < 512 else 1  # HBM: no need for many passes
        short = bench.measure_ms(lambda x=x, p=once: read(x, p, programs))[0]
        long = bench.measure_ms(lambda x=x, p=2 * once: read(x, p, programs))[0]
        rate = bench.per_time(once * x.numel() * 4, long - short, "GB/s")
        print(f"{size:5} MB: {rate:8.0f} GB/s ({short * 1e3:7.1f} us, {long * 1e3:7.1f} us)", flush=True)


if __name__ == "__main__":
    if ON_GPU:
        rates()
    else:
        check()
