"""The sweep behind chapter 02's split-row launch for long rows (GPU only; not in the gallery).

Times the chapter's split kernel (each row over several programs, x read once) for chunks of
4,096 to 16,384 values and 8 or 16 warps, next to the looped kernel and torch, at M = 2^26 / N:

    PYTHONPATH=tutorials python tools/experiments/softmax_split_rows.py
"""

import kit
import torch

chapter = kit.load_chapter("02")


def sweep(x):
    nbytes = 2 * x.numel() * x.element_size()
    calls = {
        "looped": lambda: chapter.softmax_forward(x, launch=chapter.LOOPED_LAUNCH),
        "torch": lambda: torch.softmax(x, -1),
    }
    for chunk in (4096, 8192, 16384):
        for warps in (8, 16):
            launch = chapter.Launch(chunk, num_warps=warps, split=True)
            calls[f"split {chunk}/{warps}w"] = lambda launch=launch: chapter.softmax_forward(x, launch=launch)
    line = f"{kit.dtype_name(x.dtype):8} N={x.shape[1]:7}"
    for name, fn in calls.items():
        line += f"  {name} {kit.rate(nbytes, fn):6.0f}"
    print(line, flush=True)


with kit.side_stream():  # as kit.measure does
    for dtype in (torch.float32, torch.float16):
        for n_cols in (65_536, 131_072, 262_144):
            sweep(torch.randn(2**26 // n_cols, n_cols, device="cuda", dtype=dtype))
