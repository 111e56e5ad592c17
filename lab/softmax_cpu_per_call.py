"""What a call of chapter 02's softmax costs the CPU (benchmark softmax-cpu-per-call).

The chapter's benchmarks time GPU work alone. This one times the CPU side of a forward+backward
call through ``torch.autograd.grad`` (the Python wrapper, Triton's launcher, autograd's engine
calling our Python ``backward``): 200 calls issued back to back, the GPU drained before and
after, fp16, M = 4,096 rows. Where it exceeds the GPU time, a program calling the layer from
Python one call at a time leaves the GPU idle (``autograd_path.py`` takes such a call apart).

    python lab/softmax_cpu_per_call.py          # STEPKERNELS_RECORD=1 to record
"""

from stepkernels import softmax
from stepkernels.lessons import bench, tutorial
from stepkernels.runtime.core import DEVICE
import torch


def make_forward_backward(provider, n_cols, dtype):
    x = torch.randn(tutorial.choose(gpu=4096, cpu=3), n_cols, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    if provider == "torch.compile":
        fn = bench.compile_static(lambda t: torch.softmax(t, dim=-1))
        torch.autograd.grad(fn(x), x, dy)  # compile forward and backward now
    else:
        fn = {"triton": softmax, "torch": lambda t: torch.softmax(t, dim=-1)}[provider]
    return lambda: torch.autograd.grad(fn(x), x, dy)


if __name__ == "__main__":
    cpu = bench.run(
        bench.Benchmark(
            name="softmax-cpu-per-call",
            x_name="N (columns), M = 4096 rows, forward + backward",
            x_values=[1024, 4096, 16384],
            providers=["triton", "torch", "torch.compile"],
            make=make_forward_backward,
            work=lambda n_cols, dtype: 5 * tutorial.choose(gpu=4096, cpu=3) * n_cols * dtype.itemsize,
            unit=bench.CPU_UNIT,
            dtypes=(torch.float16,),
            smoke_x=100,
            headline_x=4096,
        )
    )
    if cpu:
        print(f"ours over torch.softmax in CPU time at N = 4,096: {cpu.ratio('triton', 'torch', 4096, 'float16'):.1f}x")
