"""One softmax forward and backward of 1,024 rows of 65,536 values, fp16 then fp32, for Nsight
Compute to read chapter 02's split kernels (GPU only):

    ncu --clock-control none --kernel-name regex:split --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python lab/softmax_split_ncu.py

Why the split forward moves fp16 at about the elements per second of fp32, half a copy's
bytes: memory throughput, occupancy, or warps stalled (on the wait's atomics, or on loads)?
"""

from stepkernels import softmax
import torch


def main():
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(1024, 65536, device="cuda", dtype=dtype, requires_grad=True)
        y = softmax(x)
        torch.autograd.grad(y, x, torch.randn_like(y))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
