"""Chapter 03's forward on long rows (N = 16,384 to 65,536, M = 4,096): one block or walked?

Run on a GPU from the repository root (``PYTHONPATH=src``)::

    python lab/layer_norm_long_forward.py

The recorded forward holds rows up to 32,768 values in one block (fp32 at N = 32,768: 70% of a
copy, where torch.compile reached 98%) and walks longer rows in blocks of 4,096, reading each
row twice (65% at N = 65,536). This times, per dtype and N, the launch rule's choice, one-block
launches over warps and stages, walked launches over block and warps (a row walked twice by
one program: the second read can come from L2), torch.compile and a copy of the same bytes.

It ran against the package as of commit de7a9f1, whose layer norm walked long rows (a
``SINGLE_BLOCK`` switch in its configs); chapter 13 replaced those kernels, so to rerun it,
check that commit out.
"""

import itertools

from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import forward_config, layer_norm_forward
from stepkernels.runtime import core
import torch
import triton

ROWS = 4096


def configs(n_cols, itemsize):
    yield "rule", forward_config(n_cols, ROWS, None, itemsize)
    block = triton.next_power_of_2(n_cols)
    if block <= 32768:
        for warps, stages in itertools.product((8, 16, 32), (1, 2)):
            yield f"one block, {warps} warps, {stages} stages", dict(
                BLOCK_N=block, ROWS_PER_PROGRAM=1, SINGLE_BLOCK=True, NUM_STAGES=stages,
                num_warps=warps, programs=core.sm_count() * 8)  # fmt: skip
    for loop_block, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16)):
        if loop_block < block:
            yield f"walked by {loop_block}, {warps} warps", dict(
                BLOCK_N=loop_block, ROWS_PER_PROGRAM=1, SINGLE_BLOCK=False, NUM_STAGES=1,
                num_warps=warps)  # fmt: skip


def time_one_size(dtype, n_cols, compiled) -> None:
    x = torch.randn(ROWS, n_cols, device="cuda", dtype=dtype)
    w, b = torch.randn(n_cols, device="cuda", dtype=dtype), torch.randn_like(x[0])
    nbytes = 2 * x.numel() * x.element_size()
    calls = {"copy (same bytes)": bench.copy_of(nbytes),
             "torch.compile": lambda: compiled(x, (n_cols,), w, b)}  # fmt: skip
    for name, config in configs(n_cols, x.element_size()):
        calls[name] = lambda c=config: layer_norm_forward(x, w, b, 1e-5, config=c)
    rated = {}
    for name, fn in calls.items():
        try:
            rated[name] = bench.per_time(nbytes, bench.measure_ms(fn)[0], "GB/s")
        except Exception as error:  # too large to compile: say so, go on
            print(f"  {name}: {type(error).__name__} {str(error)[:80]}")
    print(f"{str(dtype)[6:]}, N = {n_cols:,}: the rule's choice {rated.get('rule', 0):,.0f} GB/s")
    for name, value in sorted(rated.items(), key=lambda item: -item[1])[:8]:
        print(f"  {value:7,.0f} GB/s  {name}")


def main() -> None:
    if not core.ON_GPU:
        x = torch.randn(3, 100)
        for _, config in configs(100, 4):
            y = layer_norm_forward(x, None, None, 1e-5, config=config)[0]
            torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (100,)))
        print("interpreter: every launch agrees with torch; run on a GPU for timings")
        return
    compiled = torch.compile(torch.nn.functional.layer_norm)
    for dtype in (torch.float32, torch.float16):
        for n_cols in (16384, 32768, 65536):
            time_one_size(dtype, n_cols, compiled)


if __name__ == "__main__":
    main()
