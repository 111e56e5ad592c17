"""Chapter 03's forward on rows of 32 KB (fp16 N = 16,384, fp32 N = 8,192) over launches.

The launch rule gives rows of exactly 32 KB a capped grid (8 programs an SM) with two stages of
loads through shared memory, a choice ``layer_norm_forward_variants.log`` made for fp16
N = 16,384 and which the rule applies by row bytes, so to fp32 N = 8,192 too. Nsight Compute
(``layer_norm_forward_ncu.log``) finds the fp32 launch at 80 registers and 2 programs an SM
(25% occupancy), so its 1,056 programs run in four turns. Here each point's launches, one row a
program uncapped at 4 to 32 warps and the rule's, next to torch.compile and a copy of the same
bytes (M = 4,096, calls alternated, mean of 3)::

    python lab/layer_norm_forward_32kb_rows.py   # GPU: time; CPU: check
"""

from layer_norm_backward_launch import alternating, shares
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm
from stepkernels.runtime import core
import torch
import torch.nn.functional as F


def launches(n_cols, n_rows, itemsize):
    rule = layer_norm.forward_config(n_cols, n_rows, None, itemsize)
    yield "rule", rule
    for warps in (4, 8, 16, 32):
        yield f"row, {warps} warps", dict(BLOCK_N=n_cols, ROWS_PER_PROGRAM=1, NUM_STAGES=1,
                                          num_warps=warps)  # fmt: skip


def time_point(dtype, n_cols, n_rows=4096):
    x = torch.randn(n_rows, n_cols, device=core.DEVICE, dtype=dtype)
    w, b = (torch.randn(n_cols, device=x.device, dtype=dtype) for _ in "wb")
    want = layer_norm.layer_norm_forward(x, w, b, 1e-5)[0]
    calls = {}
    for name, config in launches(n_cols, n_rows, x.element_size()):
        got = layer_norm.layer_norm_forward(x, w, b, 1e-5, config=config)[0]
        torch.testing.assert_close(got, want)
        calls[name] = lambda config=config: layer_norm.layer_norm_forward(x, w, b, 1e-5, config=config)
    if not core.ON_GPU:
        return
    compiled = bench.compile_static(lambda x, w, b: F.layer_norm(x, (n_cols,), w, b))
    calls["torch.compile"] = lambda: compiled(x, w, b)
    nbytes = 2 * x.numel() * x.element_size()
    totals = alternating(calls, nbytes)
    copy = bench.rate(nbytes, bench.copy_of(nbytes))
    print(f"{str(dtype)[6:]} N = {n_cols:,}: {shares(totals, copy)}; copy {copy:,.0f}", flush=True)


if __name__ == "__main__":
    rows = bench.choose(gpu=4096, cpu=4)
    for dtype, n_cols in [(torch.float16, 16384), (torch.float32, 8192)]:
        time_point(dtype, bench.choose(gpu=n_cols, cpu=n_cols // 64), rows)
    print("every launch gives the rule's y" if not core.ON_GPU else "")
