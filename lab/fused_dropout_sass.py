"""Instructions per element in the loop of chapter 06's fused kernels, counted without a GPU.

Run from the repository root, on any machine with Triton's NVIDIA backend (its wheel carries
``ptxas`` and ``nvdisasm``)::

    TRITON_INTERPRET=0 PYTHONPATH=src python lab/fused_dropout_sass.py

Each kernel is compiled for sm_90 (H100) with 4 warps, the package's with its own launch
(forward 2,048 columns, 1 stage: 16 elements a thread; backward 1,024 columns, 3 stages: 8),
the variants with 1,024 columns and 3 stages; the script disassembles it and counts the SASS
instructions of the row loop (from the label its closing branch jumps back to), divided by the
elements a thread holds.
IMAD (integer multiply-add) issues at half the rate of FFMA on Hopper, so its count is shown
apart; MUFU is the special-function unit (``rsqrt``, ``exp2``). The kernels: the package's
forward and backward with GELU; its forward with ``tl.randint4x`` instead of its own Philox
(``fused_dropout_philox``); and ``fused_dropout_cheaper.mixed_kernel`` with the mask of four
draws a call and libdevice's ``erf`` (the kernels before), and each half of that change.
"""

import os

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")

import fused_dropout_cheaper
import fused_dropout_philox
import sm90
from stepkernels.ops.dropout import (
    BACKWARD_STAGES,
    FUSED_COLS,
    bias_act_dropout_backward_kernel,
    bias_act_dropout_kernel,
)

THREADS = 4 * 32  # 4 warps


def loop_counts(kernel, signature: dict, constants: dict, aligned: tuple) -> tuple:
    names = sm90.jit_function(kernel).arg_names
    compiled = sm90.compile_sm90(kernel, signature, constants, [names[i] for i in aligned], num_warps=4)
    return sm90.loop_instructions(compiled), constants["BLOCK_COLS"] // THREADS


def show(name: str, counted: tuple) -> None:
    counts, elements = counted
    per = {op: counts[op] / elements for op in ("IMAD", "MUFU")}
    total = sum(counts.values()) / elements
    print(f"  {name:44s} {total:5.1f} per element (IMAD {per['IMAD']:.1f}, "
          f"MUFU {per['MUFU']:.1f})")  # fmt: skip


def main() -> None:
    common = {"n_rows": "i32", "n_cols": "i32", "rows_per_program": "i32"}
    for dtype in ("fp16", "fp32"):
        print(f"{dtype}, GELU, p = 0.1:")
        ptr = f"*{dtype}"
        forward = {"x_ptr": ptr, "bias_ptr": ptr, "out_ptr": ptr, **common,
                   "threshold": "i32", "scale": "fp32", "seed": "i64"}  # fmt: skip
        backward = {"grad_out_ptr": ptr, "x_ptr": ptr, "bias_ptr": ptr, "grad_in_ptr": ptr,
                    "bias_sum_ptr": "*fp32", "counter_ptr": "*i32", "grad_bias_ptr": ptr,
                    **common, "threshold": "i32", "scale": "fp32", "seed": "i64"}  # fmt: skip
        for backwards, signature, kernel, aligned in (
            (False, forward, bias_act_dropout_kernel, (0, 1, 2, 4)),
            (True, backward, bias_act_dropout_backward_kernel, (0, 1, 2, 3, 4, 5, 6, 8)),
        ):
            launch = {"ACTIVATION": "gelu", "BLOCK_COLS": FUSED_COLS[backwards],
                      "NUM_STAGES": BACKWARD_STAGES[2] if backwards else 1}  # fmt: skip
            if backwards:
                launch["DETERMINISTIC"] = False
            signature.update(dict.fromkeys(launch, "constexpr"))
            name = f"package {'backward' if backwards else 'forward'}"
            show(name, loop_counts(kernel, signature, launch, aligned))
        philox = {"OURS": 0, "BLOCK_COLS": FUSED_COLS[False], "NUM_STAGES": 1}
        signature = {**forward, **dict.fromkeys(philox, "constexpr")}
        del signature["ACTIVATION"]
        kernel = fused_dropout_philox.forward_kernel
        show("forward, tl.randint4x's Philox", loop_counts(kernel, signature, philox, (0, 1, 2, 4)))
        mixed = {"grad_out_ptr": ptr, "x_ptr": ptr, "bias_ptr": ptr, "out_ptr": ptr, **common,
                 "p": "fp32", "threshold": "i32", "scale": "fp32", "seed": "i64"}  # fmt: skip
        for name, mask, cheap, back in (
            ("before: 4 draws a call, libdevice erf", 4, 0, False),
            ("8 draws a call, libdevice erf", 8, 0, False),
            ("4 draws a call, GELU from erfc", 4, 1, False),
            ("backward before (no db)", 4, 0, True),
            ("backward, 8 draws a call, libdevice erf (no db)", 8, 0, True),
        ):
            constants = {"ACTIVATION": "gelu", "MASK": mask, "CHEAP": cheap, "BACKWARD": back,
                         "BLOCK_COLS": 1024, "NUM_STAGES": 3}  # fmt: skip
            signature = {**mixed, **dict.fromkeys(constants, "constexpr")}
            kernel = fused_dropout_cheaper.mixed_kernel
            show(name, loop_counts(kernel, signature, constants, (0, 1, 2, 3, 5)))


if __name__ == "__main__":
    main()
