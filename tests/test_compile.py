"""torch.compile over our operators: the kernels as Inductor copies them, each registered
operator traced without a graph break, and the GPT compiled whole."""

import builtins
import dis
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import stepkernels  # noqa: F401  (chooses the interpreter before triton is imported)
import stepkernels.ops
from torch._inductor.codegen.wrapper import (
    user_defined_triton_kernel_transitive_closure_source_code as inductor_source,
)
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def jit_function(value):
    """The @triton.jit function under lean, autotune or heuristics layers, else None."""
    for _ in range(4):
        if isinstance(value, (triton.runtime.JITFunction, InterpretedFunction)):
            return value
        value = getattr(value, "kernel", None) or getattr(value, "fn", None)
        if value is None:
            return None
    return None


def launched_kernels():
    """Every kernel an operation module launches (device functions come with them)."""
    found = {}
    for info in pkgutil.iter_modules(stepkernels.ops.__path__):
        module = importlib.import_module(f"stepkernels.ops.{info.name}")
        for name, value in vars(module).items():
            jit = jit_function(value)
            launched = jit is not None and jit is not value  # under lean or autotune
            if launched and jit.fn.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = jit
    return found


KERNELS = launched_kernels()
# Chapter 07's kernel builds an Epilogue (a NamedTuple class) in its signature: Inductor copies
# functions and int, str and bool globals, not classes. So the matmul and the linear layer stay
# opaque operators (custom_op), which Inductor calls rather than recompiles.
NOT_COPIED = {"matmul_hopper.matmul_tma_tuned": "Epilogue"}


def source_of(function) -> str:
    """A kernel's source from its ``def``, as Triton's ``JITFunction.src`` holds it."""
    lines = textwrap.dedent(inspect.getsource(function.fn)).splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return "".join(lines[first:])


def test_kernels_found():
    assert "dropout.bias_act_dropout_kernel" in KERNELS and len(KERNELS) > 10


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(strict=True, reason=f"Inductor cannot copy {NOT_COPIED[name]}"),
        )
        if name in NOT_COPIED
        else name
        for name in sorted(KERNELS)
    ],
)
def test_inductor_copies_every_name_a_kernel_reads(name, monkeypatch):
    """Inductor compiles a Triton kernel from a copy of its source, with the @triton.jit
    functions the kernel names and its int, str and bool globals
    (``user_defined_triton_kernel_transitive_closure_source_code``); a function read from a
    module (``activations.apply_activation``) is not copied, and the compiled step died
    with ``NameError: activations is not defined``. Under the interpreter our kernels are
    ``InterpretedFunction``s, so we let Inductor's walk take them for ``JITFunction``s."""
    monkeypatch.setattr(triton, "JITFunction", InterpretedFunction)
    monkeypatch.setattr(InterpretedFunction, "src", property(source_of), raising=False)
    source = inductor_source(KERNELS[name])
    namespace = {"triton": triton, "tl": tl}  # the imports of Inductor's generated file
    exec(compile(f"@triton.jit\n{source}", name, "exec"), namespace)
    missing = set()
    for function in namespace.values():
        if isinstance(function, InterpretedFunction):
            reads = {i.argval for i in dis.Bytecode(function.fn) if i.opname == "LOAD_GLOBAL"}
            missing |= {n for n in reads if n not in namespace and not hasattr(builtins, n)}
    assert not missing, f"{name}: Inductor's copy reads {sorted(missing)}, never defined"
