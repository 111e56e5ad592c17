"""One layer-norm forward and backward of 4,096 rows of 65,536 values, fp16 then fp32, for
Nsight Compute to read chapter 13's split kernels (GPU only):

    ncu --clock-control none --kernel-name regex:split --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis python lab/layer_norm_split_ncu.py

What limits them, in fp16 most (57% of a copy in the backward, 76% in the forward): memory
throughput, occupancy, or warps stalled (on the wait's atomics, or on loads)?
"""

from stepkernels import layer_norm
import torch


def main():
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(4096, 65536, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.rand(65536, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.randn(65536, device="cuda", dtype=dtype, requires_grad=True)
        y = layer_norm(x, (65536,), w, b)
        torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
