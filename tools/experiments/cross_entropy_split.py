"""Chapter 09's loss kernels by launch, forward + backward, on a GPU.

    python tools/experiments/cross_entropy_split.py

Prints GB/s (logits read once, gradient written once) for 8,192 tokens, timed as called
(do_bench, L2 flushed): the kernel by chunk, warps and grid (a program per row, or 2 per SM).
Chose ``default_launch``. The log beside it (cross_entropy_split.log) also holds the first
run, with a split-row kernel (chapter 02's, waiting for the row's programs) that lost."""

import importlib
import itertools

import stepkernels  # noqa: F401  (first: it picks the interpreter where there is no GPU)
import torch
import triton

module = importlib.import_module("stepkernels.cross_entropy")  # the module, not the function
TOKENS = 8192
LAUNCHES = [
    module.Launch(block, warps, per_sm)
    for block, warps, per_sm in itertools.product((2048, 4096, 8192), (4, 8, 16), (0, 2))
]


def gbps(fn, n_cols, dtype, passes):
    ms = triton.testing.do_bench(fn)
    return passes * TOKENS * n_cols * dtype.itemsize / ms / 1e6


for write_grad in (True, False):
    for dtype, n_cols in itertools.product((torch.bfloat16, torch.float32), (32_768, 131_072)):
        logits = torch.randn(TOKENS, n_cols, device="cuda", dtype=dtype)
        target = torch.randint(0, n_cols, (TOKENS,), device="cuda")
        options = module.Options(-100, 0.0, "sum")
        grad = torch.empty_like(logits) if write_grad else None
        line = [f"{'fwd+bwd' if write_grad else 'fwd'} {dtype} V={n_cols}:"]
        results = []
        for launch in LAUNCHES:
            call = lambda launch=launch, x=logits, t=target, o=options, g=grad: module.loss_rows(
                x, t, o, g, launch=launch
            )
            results.append((gbps(call, n_cols, dtype, 2 if write_grad else 1), launch))
        for rate, launch in sorted(results, key=lambda r: -r[0])[:6]:
            line.append(f"{rate:,.0f} {launch.block_n}/{launch.num_warps}w/{launch.programs_per_sm}")
        print(" ".join(line), flush=True)
