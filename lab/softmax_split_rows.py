"""The sweep behind chapter 02's split-row launch for long rows (GPU only; not in the gallery).

Times the package's split kernel (each row over several programs, x read once) for chunks of
4,096 to 16,384 values and 4, 8 or 16 warps, next to the package's choice and torch, at
M = 2^26 / N (the looped kernel it replaced is timed in softmax_long_rows.py):

    python lab/softmax_split_rows.py
"""

from stepkernels.lessons import bench
from stepkernels.ops.softmax import Launch, softmax_forward
from stepkernels.runtime.core import dtype_name
import torch


def sweep(x):
    nbytes = 2 * x.numel() * x.element_size()
    calls = {"package": lambda: softmax_forward(x), "torch": lambda: torch.softmax(x, -1)}
    for chunk in (4096, 8192, 16384):
        for warps in (4, 8, 16):
            launch = Launch("split", chunk, num_warps=warps)
            calls[f"split {chunk}/{warps}w"] = lambda launch=launch: softmax_forward(x, launch=launch)
    line = f"{dtype_name(x.dtype):8} N={x.shape[1]:7}"
    for name, fn in calls.items():
        line += f"  {name} {bench.rate(nbytes, fn):6.0f}"
    print(line, flush=True)


def main():
    for dtype in (torch.float32, torch.float16):
        for n_cols in (65_536, 131_072, 262_144):
            sweep(torch.randn(2**26 // n_cols, n_cols, device="cuda", dtype=dtype))


if __name__ == "__main__":
    main()
