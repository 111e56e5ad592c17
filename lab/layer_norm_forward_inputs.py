"""Does chapter 03's forward run at another rate on the benchmark's inputs than on the
experiments'? Two experiment runs timed it at fp16 N = 4,096 near 2,490 GB/s where the
recordings have 2,185 to 2,250 (NOTES.md, 2026-11-26).

    python lab/layer_norm_forward_inputs.py     # GPU only

For M = 4,096 and N = 4,096 / 8,192 (fp16) and 4,096 (fp32), GB/s of GPU time (2 x M x N x
itemsize) of the package's ``layer_norm`` (as the benchmark calls it) and ``layer_norm_forward``
(as the experiments do), and torch.compile, on the benchmark's inputs (weight and bias
``torch.rand``) and on the experiments' (weight ``rand + 0.5``, bias ``randn``), each input set
made fresh, the two sets alternating twice.
"""

import functools
import itertools

from stepkernels import layer_norm
from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import layer_norm_forward
from stepkernels.runtime import core
import torch


def inputs(kind, n_cols, dtype):
    x = torch.randn(4096, n_cols, device="cuda", dtype=dtype)
    if kind == "benchmark's":
        w, b = (torch.rand(n_cols, device="cuda", dtype=dtype) for _ in "wb")
    else:
        w, b = torch.rand(n_cols, device="cuda", dtype=dtype) + 0.5, torch.randn_like(x[0])
    return x, w, b


if __name__ == "__main__":
    with bench.side_stream():
        for dtype, n_cols in ((torch.float16, 4096), (torch.float16, 8192), (torch.float32, 4096)):
            nbytes = 2 * 4096 * n_cols * dtype.itemsize
            compiled = bench.compile_static(torch.nn.functional.layer_norm)
            for kind in itertools.islice(itertools.cycle(("benchmark's", "experiments'")), 4):
                x, w, b = inputs(kind, n_cols, dtype)
                calls = {
                    "layer_norm": functools.partial(layer_norm, x, (n_cols,), w, b),
                    "layer_norm_forward": functools.partial(layer_norm_forward, x, w, b, 1e-5),
                    "torch.compile": functools.partial(compiled, x, (n_cols,), w, b),
                }
                rates = "  ".join(f"{name} {bench.rate(nbytes, call):,.0f}" for name, call in calls.items())
                print(f"{core.dtype_name(dtype)}, N = {n_cols:,}, {kind:13} inputs: {rates}", flush=True)
