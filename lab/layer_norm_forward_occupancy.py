"""Does occupancy hold chapter 03's forward behind torch.compile's? Registers capped to find out.

Nsight Compute (``layer_norm_forward_ncu.log``) found our one-block forward holding its row in
63 to 80 registers a thread, so 25 to 50% of an SM's warps resident, where torch.compile's
kernel, walking the row in blocks, needs 32 to 64 (up to 100%). Triton's ``maxnreg`` launch
option caps the registers a thread: here the package's launch at each point where torch.compile
leads, uncapped and capped at 48, 40 and 32 registers (32 lets two programs of 32 warps share
an SM, four of 16), with the registers and spilled bytes the compiler reports, torch.compile
and a copy of the same bytes beside (M = 4,096, calls alternated, mean of 3)::

    python lab/layer_norm_forward_occupancy.py   # GPU only
"""

import sys

from layer_norm_backward_launch import alternating, shares
import sm90
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm
from stepkernels.runtime import core
import torch
import torch.nn.functional as F
import triton

POINTS = [(torch.float16, 16384), (torch.float16, 32768), (torch.float32, 8192),
          (torch.float32, 16384), (torch.float32, 32768)]  # fmt: skip


def forward(x, w, b, config, maxnreg=None):
    """y by the package's kernel at ``config``, registers capped at ``maxnreg``; and the
    compiled kernel (its ``n_regs`` and ``n_spills``)."""
    (n_rows, n_cols), config = x.shape, dict(config)
    y = torch.empty_like(x)
    mean, rstd = (torch.empty(n_rows, device=x.device) for _ in "mr")
    grid = triton.cdiv(n_rows, config["ROWS_PER_PROGRAM"])
    grid = min(grid, config.pop("programs", None) or grid)
    options = {"maxnreg": maxnreg} if maxnreg else {}
    kernel = sm90.jit_function(layer_norm.layer_norm_forward_kernel)  # Triton's path: maxnreg
    compiled = kernel[(grid,)](x, y, w, b, mean, rstd, x.stride(0), y.stride(0), n_rows, n_cols,
                               1e-5, HAS_WEIGHT=True, HAS_BIAS=True, **config, **options)  # fmt: skip
    return y, compiled


def time_point(dtype, n_cols, n_rows=4096):
    x = torch.randn(n_rows, n_cols, device=core.DEVICE, dtype=dtype)
    w, b = (torch.randn(n_cols, device=x.device, dtype=dtype) for _ in "wb")
    config = layer_norm.forward_config(n_cols, n_rows, None, x.element_size())
    want = layer_norm.layer_norm_forward(x, w, b, 1e-5)[0]
    calls, notes = {}, []
    for cap in (None, 48, 40, 32):  # 1,024 threads: 1 program an SM at 64, 2 at 32
        y, compiled = forward(x, w, b, config, cap)
        torch.testing.assert_close(y, want)
        name = f"cap {cap}" if cap else "uncapped"
        notes.append(f"{name}: {compiled.n_regs} registers, {compiled.n_spills} spilled")
        calls[name] = lambda cap=cap: forward(x, w, b, config, cap)
    compiled_tc = bench.compile_static(lambda x, w, b: F.layer_norm(x, (n_cols,), w, b))
    calls["torch.compile"] = lambda: compiled_tc(x, w, b)
    nbytes = 2 * x.numel() * x.element_size()
    totals = alternating(calls, nbytes)
    copy = bench.rate(nbytes, bench.copy_of(nbytes))
    print(f"{str(dtype)[6:]} N = {n_cols:,} ({config}; {'; '.join(notes)}): "
          f"{shares(totals, copy)}; copy {copy:,.0f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    if not core.ON_GPU:
        sys.exit("a GPU is needed: maxnreg is a GPU compiler's option")
    for dtype, n_cols in POINTS:
        time_point(dtype, n_cols)
