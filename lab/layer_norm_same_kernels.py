"""Are the package's layer-norm kernels the ones the H100 recordings measured? (No GPU needed.)

The recorded ``layer-norm-forward`` and ``layer-norm-backward`` CSVs were measured with the
kernels of chapter 03 as it stood at commit afc0cda, before the redesign. The chapter has been
reformatted and shortened since; this compiles both versions of ``layer_norm_forward_kernel``
and ``layer_norm_backward_kernel`` to Triton IR (TTIR, before any GPU-specific pass) for the
specializations the launch rules produce (single-block and walked rows, each reduction, with and
without weight and bias, fp16 and fp32) and says how many are identical. Source locations, SSA
value names (taken from variable names) and the order in which constants are hoisted are
normalized away; anything else that differs, such as an operation moved or added, counts.

    python lab/layer_norm_same_kernels.py [commit]

It answered that question up to commit de7a9f1; since then the kernels themselves changed (long
rows split over programs, chapter 13) and were re-recorded, so there is no longer one to ask.
"""

import ast
import importlib.util
import itertools
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"

from stepkernels.ops import layer_norm as package  # the module, not the function
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("normalize_rows", "layer_norm_forward_kernel", "flush_partials", "layer_norm_backward_kernel")
BACKWARD = dict(x_ptr="*fp16", dy_ptr="*fp16", dx_ptr="*fp16", weight_ptr="*fp16", mean_ptr="*fp32",
                rstd_ptr="*fp32", partial_ptr="*fp32", lock_ptr="*i32", x_row_stride="i32",
                dy_row_stride="i32", dx_row_stride="i32", M="i32", N="i32", num_locks="i32")  # fmt: skip
FORWARD = dict(x_ptr="*fp16", y_ptr="*fp16", weight_ptr="*fp16", bias_ptr="*fp16", mean_ptr="*fp32",
               rstd_ptr="*fp32", x_row_stride="i32", y_row_stride="i32", M="i32", N="i32", eps="fp32")  # fmt: skip


def recorded_kernels(commit: str):
    """The kernels of tutorials/03-layer-norm.py at ``commit``, as a module (jit needs a file)."""
    chapter = subprocess.run(["git", "show", f"{commit}:tutorials/03-layer-norm.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
    defs = [node for node in ast.parse(chapter).body if isinstance(node, ast.FunctionDef) and node.name in KERNELS]
    text = "import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(
        ast.get_source_segment(chapter, d) for d in defs
    )
    text = text.replace("\ndef ", "\n@triton.jit\ndef ")  # get_source_segment leaves the decorator out
    path = Path(tempfile.mkdtemp()) / "recorded_layer_norm_kernels.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("recorded_layer_norm_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def normalized(text: str) -> str:
    """TTIR without locations, SSA values renamed in order of definition, constants by value."""
    text = re.sub(r"#loc\d*.*", "", re.sub(r"loc\(.*?\)", "", text))
    token = re.compile(r"%[\w.#]+")
    names, lines, constants, fresh = {}, [], [], itertools.count()
    for line in filter(str.strip, text.splitlines()):
        constant = re.match(r"\s*(%[\w.#]+) = arith\.constant (.*)$", line)
        if constant:  # hoisted to the top in an order that says nothing
            names[constant.group(1)] = f"%const<{constant.group(2).strip()}>"
            constants.append(constant.group(2).strip())
            continue
        defined = set()
        results = re.match(r"\s*(%[\w.#]+(?::\d+)?(?:, %[\w.#]+)*)\s*=", line)
        if results:
            defined |= {t.start() for t in token.finditer(line, 0, results.end())}
        for pattern in (r"\^bb\d+\((.*)$", r"scf\.for (%[\w.#]+) =", r"iter_args\((.*?)\)"):
            for group in re.finditer(pattern, line):
                for t in token.finditer(line, *group.span(1)):
                    after = line[t.end() : group.end(1)].lstrip()
                    if not pattern.startswith("iter") or after.startswith("="):
                        defined.add(t.start())

        def rename(t, defined=defined):
            if t.start() in defined or t.group(0) not in names:
                names[t.group(0)] = f"%v{next(fresh)}"
            return names[t.group(0)]

        lines.append(token.sub(rename, line).rstrip())
    return "\n".join(sorted(constants) + lines)


def ttir(kernel, signature: dict, constants: dict, dtype: str) -> str:
    signature = {k: v.replace("fp16", dtype) for k, v in signature.items()} | dict.fromkeys(constants, "constexpr")
    where = {(kernel.arg_names.index(k),): v for k, v in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=where)
    return normalized(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"])


def specializations():
    for single, block, rows, reduction, weight in itertools.product(
        (True, False), (256, 2048, 16384), (1, 8, 64), ("two-stage", "lock", "none"), (True, False)
    ):
        if single or block <= 2048:
            yield "layer_norm_backward_kernel", BACKWARD, dict(
                BLOCK_N=block, ROWS_PER_PROGRAM=rows, SINGLE_BLOCK=single, HAS_WEIGHT=weight,
                REDUCTION=reduction, GROUP_SIZE_M=64, NUM_STAGES=3 if single else 1)  # fmt: skip
    for single, block, rows, weight, bias in itertools.product(
        (True, False), (1024, 4096, 32768), (1, 4), (True, False), (True, False)
    ):
        if single or rows == 1:
            yield "layer_norm_forward_kernel", FORWARD, dict(
                BLOCK_N=block, ROWS_PER_PROGRAM=rows, SINGLE_BLOCK=single, HAS_WEIGHT=weight,
                HAS_BIAS=bias, NUM_STAGES=2 if single else 1)  # fmt: skip


if __name__ == "__main__":
    recorded = recorded_kernels(sys.argv[1] if len(sys.argv) > 1 else "afc0cda")
    same, differ = 0, []
    for dtype in ("fp16", "fp32"):
        for name, signature, constants in specializations():
            ours = ttir(getattr(package, name), signature, constants, dtype)
            theirs = ttir(getattr(recorded, name), signature, constants, dtype)
            if ours == theirs:
                same += 1
            else:
                differ.append(f"{name} {dtype} {constants}")
    print(f"identical TTIR in {same} of {same + len(differ)} specializations")
    for line in differ:
        print("  differs:", line)
    sys.exit(1 if differ else 0)
