"""How many lock-guarded buffers? The backward of chapter 03's layer norm with the lock-based
dW/dB reduction, over GROUP_SIZE_M, for three sizes of program (GPU: measured; without one:
the recording of benchmark ``layer-norm-group-size``).

``GROUP_SIZE_M`` trades waiting for work: with one buffer every program queues for the same
lock; with many, the queue disappears but the second stage has more rows to add. How much the
queue hurts depends on how often programs take a lock (once per program here), so we sweep it
for 1, 4 and 32 rows per program, on the backward at M = N = 4,096, fp16:

    python lab/layer_norm_group_size.py
"""

from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import layer_norm_backward, layer_norm_forward
from stepkernels.runtime.core import DEVICE
import torch

ROWS, COLS = bench.choose(gpu=4096, cpu=8), bench.choose(gpu=4096, cpu=64)


def make_group_sweep(provider, group_size_m, dtype):
    rows_per_program = int(provider.split()[0])
    x = torch.randn(ROWS, COLS, device=DEVICE, dtype=dtype)
    dy = torch.randn_like(x)
    weight = torch.rand(COLS, device=DEVICE, dtype=dtype)
    _, mean, rstd = layer_norm_forward(x, weight, None, 1e-5)
    return lambda: layer_norm_backward(
        dy, x, weight, mean, rstd, reduction="lock", group_size_m=group_size_m, rows_per_program=rows_per_program
    )


group_sweep = bench.Benchmark(
    name="layer-norm-group-size",
    x_name="GROUP_SIZE_M (lock-guarded buffers)",
    x_values=[2**i for i in range(0, 9)],
    providers=["1 row per program", "4 rows per program", "32 rows per program"],
    make=make_group_sweep,
    work=lambda group_size_m, dtype: 3 * ROWS * COLS * dtype.itemsize,
    dtypes=(torch.float16,),
    smoke_x=4,
)

if __name__ == "__main__":
    results = bench.run(group_sweep)
    if results is not None:
        print(f"{group_sweep.name}, {results.how}, GB/s:")
        for provider in group_sweep.providers:
            rates = ", ".join(f"{g}: {results.value(provider, g, 'float16'):,.0f}" for g in group_sweep.x_values)
            print(f"  {provider}: {rates}")
