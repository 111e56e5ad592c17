"""Triton kernels compiled for sm_90 (the H100) without a GPU, and what came out.

Triton's NVIDIA backend compiles for any target on any machine, and its wheel carries ``ptxas``,
``cuobjdump`` and ``nvdisasm``: the experiments that count registers, instructions or shared
memory on the CPU machine share these pieces. Set ``TRITON_INTERPRET=0`` before Triton is
imported, or the kernels are the interpreter's; this module imports Triton only when called,
so that importing it first leaves that to ``stepkernels``. The CPU machine's Triton may
allocate otherwise than the H100's: counts made here are leads.
"""

import collections
import functools
import hashlib
import importlib.util
import inspect
import os
import re
import subprocess
import tempfile


def jit_function(kernel):
    """The ``@triton.jit`` function under ``@lean``, ``@triton.autotune`` or ``@triton.heuristics``."""
    import triton

    while not isinstance(kernel, triton.runtime.JITFunction):
        inner = getattr(kernel, "kernel", None) or getattr(kernel, "fn", None)
        if inner is None:  # the interpreter's kernels wrap a plain function
            raise TypeError(f"{kernel!r} is not compiled by Triton: set TRITON_INTERPRET=0 before triton is imported")
        kernel = inner
    return kernel


def compile_sm90(kernel, signature: dict, constants: dict, aligned=(), **options):
    """``kernel`` compiled for sm_90. ``signature`` gives each runtime argument its Triton type
    (``"*fp16"``, ``"i32"``...), ``constants`` the constexprs, ``aligned`` the names of the
    arguments specialized as multiples of 16 (as Triton does at launch for pointers and
    integers that are), ``options`` the compiler's (``num_warps``, ``maxnreg``...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit = jit_function(kernel)
    attrs = {(jit.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    full = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(jit, full, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cubin_file(compiled) -> str:
    """The path of a file holding ``compiled``'s cubin, for the tools below."""
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    return path


def nvidia_tool(name: str, *arguments) -> str:
    """What ``cuobjdump`` or ``nvdisasm`` from Triton's wheel prints for ``arguments``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)
    return subprocess.run([tool, *arguments], capture_output=True, text=True, check=True).stdout


@functools.cache
def source_folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="stepkernels-lab-")  # removed when Python exits


def module_from_source(name: str, source: str):
    """``source`` imported as module ``name`` from a file of its own, so that Triton, which
    reads a kernel's source from its file, can compile the kernels it defines. The files go to
    one folder a process, removed when it exits."""
    path = os.path.join(source_folder().name, f"{name}_{hashlib.sha256(source.encode()).hexdigest()[:12]}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_variant(kernel, name: str, replacements: list, names: dict | None = None):
    """``kernel`` (``@triton.jit``) with its source changed, as a kernel of a module ``name`` of
    its own, which sees every public name of the kernel's module and ``names`` (other jit
    functions the new source calls). ``replacements``: (old, new, how many times old must
    occur) for each change, made in turn."""
    function = kernel  # the Python function under the JIT (or the interpreter) and wrappers
    while not inspect.isfunction(function):
        function = getattr(function, "kernel", None) or function.fn
    source = inspect.getsource(function)
    for old, new, count in replacements:
        assert source.count(old) == count, f"{function.__name__} changed: {old.strip()[:60]!r} is not there {count}x"
        source = source.replace(old, new)
    module = module_from_source(name, f"from {function.__module__} import *\n{source}")
    vars(module).update(names or {})  # before the variant's first compile, which reads them
    return getattr(module, function.__name__)


def loop_instructions(compiled) -> collections.Counter:
    """SASS instructions by opcode in ``compiled``'s first loop: from the label that the first
    branch back jumps to, through that branch."""
    lines = nvidia_tool("nvdisasm", "-c", cubin_file(compiled)).splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^(\.L_x_\d+):", line))}  # fmt: skip
    for end, line in enumerate(lines):
        jump = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if jump and labels.get(jump.group(1), end) < end:  # a branch back: the loop
            break
    counts = collections.Counter()
    for line in lines[labels[jump.group(1)] : end + 1]:
        op = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", line)
        if op:
            counts[op.group(1)] += 1
    return counts
