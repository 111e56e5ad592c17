"""The split kernels under a register cap: more programs an SM, for some spills.

Registers set how many programs of chapters 02 and 13's split kernels share an SM, and so how
many loads are in flight while programs wait for one another. Triton's ``maxnreg`` launch
option caps the registers a thread; what does not fit spills to local memory. Compiled for
sm_90 on the CPU machine (``--registers``), the caps tried here and what they cost:

    TRITON_INTERPRET=0 PYTHONPATH=src python lab/register_caps.py --registers
    python lab/register_caps.py     # GPU: time the package against each cap

On a GPU it times, in GB/s of GPU time next to a copy of the same bytes, each kernel at the
package's launch with no cap and with each cap of ``CAPS``: chapter 02's split softmax forward
and backward (M = 2^26 / N) and chapter 13's split layer-norm forward and backward (M = 4,096,
as chapter 03's benchmark), after checking the capped results against the package's. Without
a GPU and without ``--registers`` it checks the capped calls under the interpreter (where the
cap means nothing: the check is of the plumbing).
"""

import itertools
import os
import sys

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--registers" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

from softmax_split_way_out import (
    BACKWARD_ARGUMENTS,
    FORWARD_ARGUMENTS,
    programs_per_sm,
    registers,
    split_call,
)
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm, long_rows, softmax  # the modules, not the functions
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
import torch

# kernel: (package launch's warps, caps to try)
CAPS = {
    "softmax forward": (softmax.SPLIT_FORWARD[1], (48, 40)),
    "softmax backward": (softmax.SPLIT_BACKWARD[1], (128, 96)),
    "layer-norm forward": (4, (128, 96)),
    "layer-norm backward": (4, (168, 128)),
}
LAYER_NORM_FORWARD_ARGUMENTS = [
    ("x_ptr", "data"), ("y_ptr", "data"), ("weight_ptr", "data"), ("bias_ptr", "data"),
    ("mean_ptr", "*fp32"), ("rstd_ptr", "*fp32"), ("stats_ptr", "*fp32"), ("counter_ptr", "*i32"),
    ("x_row_stride", "i32"), ("y_row_stride", "i32"), ("N", "i32"), ("n_chunks", "i32"),
    ("eps", "fp32"),
]  # fmt: skip
LAYER_NORM_BACKWARD_ARGUMENTS = [
    ("x_ptr", "data"), ("dy_ptr", "data"), ("dx_ptr", "data"), ("weight_ptr", "data"),
    ("mean_ptr", "*fp32"), ("rstd_ptr", "*fp32"), ("partial_ptr", "*fp32"), ("lock_ptr", "*i32"),
    ("sums_ptr", "*fp32"), ("counter_ptr", "*i32"), ("x_row_stride", "i32"),
    ("dy_row_stride", "i32"), ("dx_row_stride", "i32"), ("M", "i32"), ("N", "i32"),
    ("num_locks", "i32"), ("n_chunks", "i32"),
]  # fmt: skip


def count_registers():
    """Registers and stack bytes a thread at each cap, N = 65,536 (CHUNKS_POW2 as there)."""
    softmax_constants = {"CHUNKS_POW2": 8, "MAX_POLLS": 100_000, "LOG": False}
    backward_config = layer_norm.backward_config(65_536, 4096)
    kernels = {
        "softmax forward": (softmax.softmax_split_kernel, FORWARD_ARGUMENTS,
                            {"BLOCK_N": softmax.SPLIT_FORWARD[0], **softmax_constants}),
        "softmax backward": (softmax.softmax_backward_split_kernel, BACKWARD_ARGUMENTS,
                             {"BLOCK_N": softmax.SPLIT_BACKWARD[0], **softmax_constants}),
        "layer-norm forward": (long_rows.layer_norm_forward_split_kernel,
                               LAYER_NORM_FORWARD_ARGUMENTS,
                               {"BLOCK_N": layer_norm.SPLIT_CHUNK, "CHUNKS_POW2": 8,
                                "HAS_WEIGHT": True, "HAS_BIAS": True, "MAX_POLLS": 100_000}),
        "layer-norm backward": (long_rows.layer_norm_backward_split_kernel,
                                LAYER_NORM_BACKWARD_ARGUMENTS,
                                {"BLOCK_N": backward_config["BLOCK_N"],
                                 "ROWS_PER_PROGRAM": backward_config["ROWS_PER_PROGRAM"],
                                 "BATCH": backward_config["BATCH"], "CHUNKS_POW2": 64,
                                 "HAS_WEIGHT": True, "REDUCTION": "two-stage",
                                 "GROUP_SIZE_M": layer_norm.GROUP_SIZE_M,
                                 "MAX_POLLS": 100_000}),
    }  # fmt: skip
    for (name, (warps, caps)), dtype in itertools.product(CAPS.items(), ("fp16", "fp32")):
        kernel, arguments, constants = kernels[name]
        line = f"{name:20} {dtype} {warps} warps:"
        for cap in (None, *caps):
            regs, stack = registers(kernel, arguments, dtype, constants, warps, maxnreg=cap)
            spill = f" +{stack} B stack" if stack else ""
            line += f"  cap {cap or '-'}: {regs} r {programs_per_sm(regs, warps)} p{spill}"
        print(line, flush=True)


def softmax_calls(dtype, n_cols):
    """x, and for a cap the forward and backward of chapter 02's split kernels at the
    package's launches, on the same inputs."""
    x = torch.randn(2**26 // n_cols if ON_GPU else 3, n_cols, device=DEVICE, dtype=dtype) * 4
    y, dy = torch.softmax(x.float(), dim=-1).to(dtype), torch.randn_like(x)
    return x, lambda cap: softmax_pair(x, y, dy, {"LOG": False, **({"maxnreg": cap} if cap else {})})


def softmax_pair(x, y, dy, options):
    def forward():
        out = torch.empty_like(x)
        split_call(softmax.softmax_split_kernel, (x, out), *softmax.SPLIT_FORWARD, 2, **options)
        return out

    def backward():
        dx = torch.empty_like(x)
        launch = softmax.SPLIT_BACKWARD
        split_call(softmax.softmax_backward_split_kernel, (y, dy, dx), *launch, 1, **options)
        return dx

    return forward, backward


def layer_norm_calls(dtype, n_cols):
    """x, and for a cap the forward and backward of chapter 13's split kernels at the
    package's configurations, on the same inputs."""
    n_rows = 4096 if ON_GPU else 3
    x = torch.randn(n_rows, n_cols, device=DEVICE, dtype=dtype)
    weight, bias = (torch.randn(n_cols, device=DEVICE, dtype=dtype) for _ in "wb")
    dy = torch.randn_like(x)
    _, mean, rstd = layer_norm.layer_norm_forward(x, weight, bias, 1e-5)
    return x, lambda cap: layer_norm_pair(x, weight, bias, dy, mean, rstd, cap)


def layer_norm_pair(x, weight, bias, dy, mean, rstd, cap):
    n_rows, n_cols = x.shape
    capped = {"maxnreg": cap} if cap else {}
    block = None if ON_GPU else 1024  # the package's rules; on the CPU small chunks, so rows split
    forward_config = {**layer_norm.forward_config(n_cols, n_rows, block, x.element_size()), **capped}
    backward_config = {**layer_norm.backward_config(n_cols, n_rows, block, None, x.element_size()), **capped}

    def forward():
        return layer_norm.layer_norm_forward(x, weight, bias, 1e-5, config=forward_config)

    def backward():
        return layer_norm.layer_norm_backward(dy, x, weight, mean, rstd, config=backward_config)

    return forward, backward


def compare(name, calls, dtype, n_cols):
    """The capped calls against the package's, then (on a GPU) one line of rates."""
    x, pair = calls(dtype, n_cols)
    uncapped, size = pair(None), x.numel() * x.element_size()
    line = f"{name:10} {dtype_name(dtype):8} N={n_cols:7}"
    for index, direction in enumerate(("forward", "backward")):
        caps, passes = CAPS[f"{name} {direction}"][1], 2 + index
        capped = {cap: pair(cap)[index] for cap in caps}
        reference = uncapped[index]()
        for call in capped.values():
            for ours, theirs in zip(as_tuple(reference), as_tuple(call()), strict=True):
                if ours is not None:
                    torch.testing.assert_close(theirs, ours)
        if ON_GPU:
            line += f"  {direction}: copy {bench.rate(passes * size, bench.copy_of(passes * size)):5.0f}"
            line += f" package {bench.rate(passes * size, uncapped[index]):5.0f}"
            line += "".join(f" cap {c} {bench.rate(passes * size, f):5.0f}" for c, f in capped.items())
    print(line if ON_GPU else f"{line}: the capped calls match the package's", flush=True)


def as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


if __name__ == "__main__":
    if "--registers" in sys.argv:
        count_registers()
    else:
        for dtype in (torch.float16, torch.float32):
            for n_cols in (65_536, 262_144) if ON_GPU else (20_000,):
                compare("softmax", softmax_calls, dtype, n_cols)
            for n_cols in (16_384, 65_536) if ON_GPU else (3_000,):
                compare("layer-norm", layer_norm_calls, dtype, n_cols)
