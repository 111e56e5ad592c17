"""Which launch torch.compile's layer-norm forward runs, and ours beside it (GPU only).

``layer_norm_inductor_code.log`` has the kernel torch.compile writes for chapter 03's forward (a
looped two-pass reduction) but not the block sizes, warps and stages its autotuner picks at run
time. This compiles ``torch.nn.functional.layer_norm`` as the benchmark does
(``bench.compile_static``) at M = 4,096 for each N where ours trails it, runs it, and prints
the config of every Triton kernel the compiled module launched, with both rates (GB/s of GPU
time, x read and y written) and ours' launch config:

    python lab/layer_norm_inductor_config.py
"""

import sys

from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import forward_config, layer_norm
from stepkernels.runtime.core import ON_GPU
import torch

SIZES = [(torch.float16, n) for n in (4096, 8192, 16384, 32768)] + [
    (torch.float32, n) for n in (4096, 8192, 16384, 32768)
]


def inductor_configs():
    """(kernel name, config) of each autotuned kernel loaded by inductor so far."""
    from torch._inductor.codecache import PyCodeCache

    found = []
    for module in list(PyCodeCache.modules):
        for name, value in vars(module).items():
            launchers = getattr(value, "launchers", None)
            if name.startswith("triton_") and launchers:
                found.append((name, launchers[0].config))
    return found


def main():
    for dtype, n_cols in SIZES:
        x = torch.randn(4096, n_cols, device="cuda", dtype=dtype)
        w = torch.rand(n_cols, device="cuda", dtype=dtype)
        b = torch.randn(n_cols, device="cuda", dtype=dtype)
        nbytes = 2 * x.numel() * x.element_size()
        compiled = bench.compile_static(torch.nn.functional.layer_norm)
        ours = bench.rate(nbytes, lambda: layer_norm(x, (n_cols,), w, b))  # noqa: B023
        theirs = bench.rate(nbytes, lambda: compiled(x, (n_cols,), w, b))  # noqa: B023
        copy = bench.rate(nbytes, bench.copy_of(nbytes))
        configs = "; ".join(f"{name}: {config}" for name, config in inductor_configs())
        ours_config = forward_config(n_cols, 4096, None, x.element_size())
        print(f"{str(dtype)[6:]:8} N = {n_cols:6}: copy {copy:5.0f}  ours {ours:5.0f} {ours_config} | "
              f"torch.compile {theirs:5.0f} {configs}", flush=True)  # fmt: skip


if __name__ == "__main__":
    if not ON_GPU:
        print("GPU only: torch.compile's kernels and their autotuned launches")
        sys.exit(0)
    main()
