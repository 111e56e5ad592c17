"""Chapter 03's one-block layer-norm backward with fewer instructions an element.

Run from the repository root (``PYTHONPATH=src``)::

    python lab/layer_norm_backward_fewer_instructions.py   # GPU: time; CPU: check
    TRITON_INTERPRET=0 PYTHONPATH=src python lab/layer_norm_backward_fewer_instructions.py --sass

The package's row loop issues about 19 SASS instructions an element in fp16 and in fp32
(``layer_norm_backward_rows_at_once.log``): per byte, twice as many in fp16, which reaches 83%
of a copy at M = N = 4,096 against 91% in fp32. Each variant removes some, one change at a time:

* ``mask``: the row's mask as ``col_mask & (row < M)`` instead of ``cols < where(row < M, N, 0)``
  (``row < M`` broadcast over the columns: a scalar there fails in Triton 3.9's interpreter);
* ``dx``: dx = (wdy rstd - c2 rstd) - x_hat (c1 rstd), two FFMAs where the package has an FFMA,
  an FADD and an FMUL (the same conditioning: a difference of the same terms);
* ``x_hat``: x_hat = x rstd - mean rstd, one FFMA for an FADD and an FMUL. It cancels where the
  mean is large next to the spread, so it is only a candidate for 16-bit inputs, whose own
  rounding (2^-11 of x) is far above the error it adds (2^-24 of mean rstd);
* ``all``: the three together.

``--sass`` compiles each for sm_90 without a GPU and counts the row loop's instructions an
element. On a GPU: each against the package, alternating, at M = 4,096 and N = 1,024 to 8,192,
in GB/s of the compulsory bytes (x and dy read, dx written).
"""

import itertools
import os
import sys

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--sass" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

from layer_norm_backward_launch import alternating, inputs, shares
import layer_norm_backward_rows_at_once as rows_at_once
import sm90
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm as package
from stepkernels.runtime import core
import torch

MASK = (
    "        mask, row64 = cols < tl.where(row < M, N, 0), row.to(tl.int64)\n",
    "        mask, row64 = col_mask & (cols * 0 + row < M), row.to(tl.int64)\n",
    1,
)
DX = (
    "        dx = (wdy - (x_hat * c1 + c2)) * rstd\n",
    "        dx = (wdy * rstd - c2 * rstd) - x_hat * (c1 * rstd)\n",
    1,
)
X_HAT = (
    "x_hat, wdy = (x - mean) * rstd, ",
    "x_hat, wdy = x * rstd - mean * rstd, ",
    1,
)
CHANGES = {"mask": [MASK], "dx": [DX], "x_hat": [X_HAT], "all": [MASK, DX, X_HAT]}
VARIANTS = {
    name: sm90.kernel_variant(package.layer_norm_backward_kernel, f"ln_backward_{name}", changes)
    for name, changes in CHANGES.items()
}


def backward(name, args):
    if name == "package":
        return package.layer_norm_backward(*args)
    with rows_at_once.in_package(VARIANTS[name]):
        return package.layer_norm_backward(*args)


def check():
    """Each variant against the package, also on rows whose mean is 100 standard deviations."""
    torch.manual_seed(0)  # the same inputs, and differences, at every run
    for dtype, offset in itertools.product((torch.float32, torch.float16), (0.0, 100.0)):
        args = inputs(37, 300, dtype, offset)
        want = backward("package", args)
        for name in VARIANTS:
            got = backward(name, args)
            worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want, strict=True))
            tolerance = 2e-3 if dtype == torch.float16 else 1e-4 if offset else 1e-5
            print(f"{core.dtype_name(dtype)}, mean {offset:g}: {name} largest difference "
                  f"from the package {worst:.2e}")  # fmt: skip
            if name not in ("x_hat", "all") or dtype == torch.float16:
                assert worst <= tolerance * max(1.0, want[1].abs().max().item()), name


def sass():
    for dtype, name in itertools.product(("fp16", "fp32"), ("package", *VARIANTS)):
        kernel = package.layer_norm_backward_kernel if name == "package" else VARIANTS[name]
        config = package.backward_config(4096, 4096, itemsize=2 if dtype == "fp16" else 4)
        compiled = rows_at_once.compiled_sm90(kernel, dtype, config["num_warps"], config["NUM_STAGES"])
        counts = sm90.loop_instructions(compiled)
        per_element = 4096 // (config["num_warps"] * 32)
        fp = sum(counts[k] for k in ("FFMA", "FMUL", "FADD")) / per_element
        print(f"{dtype}, N = 4,096, {name}: {sum(counts.values()) / per_element:.1f} "
              f"instructions an element, {fp:.2f} of them FFMA, FMUL or FADD")  # fmt: skip


def sweep():
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (1024, 2048, 4096, 8192)):
        args = inputs(4096, n_cols, dtype)
        nbytes = 3 * args[1].numel() * args[1].element_size()
        copy = bench.rate(nbytes, bench.copy_of(nbytes))
        names = ["package", *(n for n in VARIANTS if n != "x_hat" or dtype == torch.float16)]
        totals = alternating({n: lambda n=n, a=args: backward(n, a) for n in names}, nbytes)
        print(f"{core.dtype_name(dtype)}, N = {n_cols:,}: copy {copy:,.0f};", shares(totals, copy), flush=True)


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass()
    else:
        check()
        if core.ON_GPU:
            with bench.side_stream():
                sweep()
