"""Chapter 03's one-block forward beside torch.compile's, for Nsight Compute (GPU only):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python lab/layer_norm_forward_ncu.py

At the points of the forward benchmark (M = 4,096) where torch.compile leads ours by 2 to 5%
(fp16 N = 16,384 and 32,768, fp32 8,192 and 32,768; ``layer_norm_forward_one_reduction.log``):
one call of each, compiled and warmed up first, profiled between ``cudaProfilerStart`` and
``Stop``. Does torch.compile's kernel (two walks of the row, the second from L2) keep more
bytes in flight, or stall less, than ours holding the row in registers?
"""

import functools

from stepkernels import layer_norm
import torch
import torch.nn.functional as F

POINTS = [(torch.float16, 16384), (torch.float16, 32768), (torch.float32, 8192),
          (torch.float32, 32768)]  # fmt: skip


def main():
    compiled = torch.compile(F.layer_norm, dynamic=False)  # a graph per shape (4, under the limit)
    calls = []
    for dtype, n_cols in POINTS:
        x = torch.randn(4096, n_cols, device="cuda", dtype=dtype)
        w, b = (torch.rand(n_cols, device="cuda", dtype=dtype) for _ in "wb")
        for fn in (layer_norm, compiled):
            call = functools.partial(fn, x, (n_cols,), w, b)
            call()  # compiles, autotunes
            calls.append(call)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:  # ours, then torch.compile's, at each point in turn
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
