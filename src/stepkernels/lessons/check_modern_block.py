"""The harness of chapter 14 (RMSNorm, rotary embeddings, SwiGLU): one call checks an
operation's outputs and gradients against a reference computed in fp64, for every dtype and
case, as the chapter describes. Hand-written; the tests call it too."""

from __future__ import annotations

from collections.abc import Callable

from stepkernels.runtime.core import DEVICE, FLOAT_DTYPES
import torch

# One rounding of the dtype relative to the tensor's largest value: ours are fp32 computations
# rounded once (two units for bf16: the interpreter truncates where a GPU rounds). Gradients
# summed over rows (RMSNorm's dW) add a few roundings of fp32.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def check(
    name: str,
    ours: Callable,
    reference: Callable,
    cases: dict,
    dtypes=FLOAT_DTYPES,
    seed: int = 0,
) -> None:
    """For each case (label -> ``make(rand, dtype)``, which returns the inputs: tensors and
    anything else, ``rand(shape)`` drawing normal values of the dtype) and dtype: the outputs
    of ``ours(*inputs)`` and the gradients of every floating input that requires one, against
    ``reference(*inputs)`` with the tensors in fp64. Tensors that should get a gradient are
    made with ``requires_grad_()``; their strides reach ``ours`` as they are (views stay
    views). Raises on the first mismatch; prints one line when all agree."""
    generator = torch.Generator().manual_seed(seed)
    for dtype in dtypes:
        for label, make in cases.items():

            def rand(*shape, dtype=dtype):
                return torch.randn(shape, generator=generator).to(DEVICE, dtype)

            inputs = make(rand, dtype)
            exact = [
                t.detach().double().requires_grad_(t.requires_grad)
                if isinstance(t, torch.Tensor)
                else t
                for t in inputs
            ]
            got, want = as_tuple(ours(*inputs)), as_tuple(reference(*exact))
            leaves = [
                t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            exact_leaves = [
                t for t in exact if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            grads_out = [rand(*t.shape, dtype=t.dtype) for t in got]
            named = [
                (f"output {i}", g, w)
                for i, (g, w) in enumerate(zip(got, want, strict=True))
            ]
            if leaves:
                mine = torch.autograd.grad(got, leaves, grads_out)
                grads_exact = [g.double() for g in grads_out]
                expected = torch.autograd.grad(want, exact_leaves, grads_exact)
                named += [
                    (f"gradient {i}", g, w)
                    for i, (g, w) in enumerate(zip(mine, expected, strict=True))
                ]
            for what, mine, expected in named:
                assert mine.dtype == dtype or what.startswith("gradient"), (what, dtype)
                tol = TOLERANCE[dtype]
                scale = expected.abs().max().item() if expected.numel() else 0.0
                torch.testing.assert_close(
                    mine.double(),
                    expected.double(),
                    rtol=tol,
                    atol=tol * scale,
                    msg=lambda m, where=f"{name}, {label}, {dtype}, {what}": (
                        f"{where}: {m}"
                    ),
                )
    print(f"{name} as its fp64 reference: {len(cases)} cases x {len(dtypes)} dtypes")
