"""The correctness harness of the matmul chapters (04 and 07): one call checks a kernel against
the fp64 product over shapes, layouts, activations and dtypes, as the chapters describe.
Hand-written; the kernels it checks are generated from the chapters."""

from __future__ import annotations

from stepkernels.runtime.activations import ACTIVATIONS, activation_reference
from stepkernels.runtime.core import DEVICE, INTERPRET, ON_GPU, dtype_name
from stepkernels.runtime.tiles import dot_precision, output_dtype
import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def matmul_reference(a, b, activation=None, bias=None):
    """activation(a @ b + bias) in fp64, and the pre-activation: what kernels are checked against."""
    pre = a.double() @ b.double() + (0 if bias is None else bias.double())
    return activation_reference(pre, activation), pre


def tolerance(dtype: torch.dtype, K: int, scale: float = 1.0) -> dict:
    """assert_close tolerances for a product of ``randn * scale`` inputs of ``dtype`` over K.

    Two units of the output's last place (2^-10 fp16, 2^-7 bf16 and fp8's bf16 output), and
    for fp32 1e-4 exact (a few times the fp32 accumulation error here, 40 times below tf32's)
    or 2^-8 as tf32; relative, and times sqrt(K) * scale**2 absolute: products of such inputs
    grow like that."""
    if dtype == torch.float16:
        unit = 2**-10
    elif dtype == torch.float32:
        unit = 1e-4 if INTERPRET or dot_precision(dtype) == "ieee" else 2**-8
    else:
        unit = 2**-7
    return {"rtol": unit, "atol": unit * max(K, 1) ** 0.5 * scale**2}


def layouts(
    a: torch.Tensor, b: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same product with A and B as given, both transposed in memory, and A row-strided
    (a slice whose row stride exceeds its width)."""
    padded = torch.zeros(a.shape[0], a.shape[1] + 8, device=a.device, dtype=a.dtype)
    padded[:, : a.shape[1]] = a
    transposed = (a.t().contiguous().t(), b.t().contiguous().t())
    return [(a, b), transposed, (padded[:, : a.shape[1]], b)]


def small_config(dtype: torch.dtype) -> dict:
    """One fixed tile shape per dtype, for the small shapes of a check on a GPU: autotuning
    each would time every config for each shape, minutes that check nothing more."""
    blocks = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128 // dtype.itemsize}
    return blocks | {"GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 3}


def check(kernel, dtypes, shapes, skip=None, seed: int = 0) -> None:
    """Check ``kernel(a, b, activation, bias=, return_preactivation=True, config=)`` against
    ``matmul_reference`` for every dtype and (M, N, K), in every layout of ``layouts`` (fp8:
    A row-major and B column-major only, values scaled by 4 to use e4m3's range), each call
    with a bias and the next activation. ``skip(a, b)``: layouts the kernel cannot take."""
    generator = torch.Generator().manual_seed(seed)
    for dtype in dtypes:
        fp8 = dtype in FP8_DTYPES
        scale = 4.0 if fp8 else 1.0
        for index, (M, N, K) in enumerate(shapes):
            a = (torch.randn(M, K, generator=generator) * scale).to(DEVICE, dtype)
            b = (torch.randn(N, K, generator=generator) * scale).to(DEVICE, dtype).t()
            bias = torch.randn(N, generator=generator).to(DEVICE)
            activation = ACTIVATIONS[index % len(ACTIVATIONS)]
            expected, expected_pre = matmul_reference(a, b, activation, bias)
            config = small_config(dtype) if ON_GPU and M * N < 2**20 else None
            tol = tolerance(output_dtype(dtype), K, scale)
            if (
                fp8
            ):  # Triton's fp8 dot on Hopper accumulates in the fast, imprecise mode
                tol["atol"] *= 2
            # squared_relu doubles the relative error of its input (d(z²)/z² = 2 dz/z).
            out_tol = tol | {
                "rtol": tol["rtol"] * (2 if activation == "squared_relu" else 1)
            }
            for a_view, b_view in [(a, b)] if fp8 else layouts(a, b.contiguous()):
                if skip is not None and skip(a_view, b_view):
                    continue
                out, pre = kernel(
                    a_view,
                    b_view,
                    activation,
                    bias=bias,
                    return_preactivation=True,
                    config=config,
                )
                assert (
                    out.shape == (M, N)
                    and out.dtype == output_dtype(dtype)
                    and out.is_contiguous()
                )
                torch.testing.assert_close(pre.double(), expected_pre, **tol)
                # That accumulation error, which squared_relu scales by 2z, fills fp8's
                # tolerance: fp8 outputs are checked against the activation of the
                # pre-activation just checked, which comes from the same accumulator.
                reference = (
                    activation_reference(pre.double(), activation) if fp8 else expected
                )
                torch.testing.assert_close(out.double(), reference, **out_tol)
    names = ", ".join(dtype_name(d) for d in dtypes)
    print(f"{kernel.__name__}: {names} x {len(shapes)} shapes match the fp64 product")
