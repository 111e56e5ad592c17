"""runtime.activations: the code of chapter 04, Matrix multiplication at cuBLAS speed."""

# Generated from tutorials/04-matrix-multiplication.py by tools/export.py: edit the chapter, then
# `make export`.

import torch
import triton
import triton.language as tl

ACTIVATIONS = (None, "relu", "leaky_relu", "gelu", "squared_relu")


@triton.jit
def normal_tail(z, ACCURATE: tl.constexpr):
    """Phi(-|z|) from erfc: to about 1e-7 (ACCURATE, for fp32), else 1e-4 (chapter
    06)."""
    a = tl.abs(z) * 0.7071067811865476  # Phi(-|z|) = erfc(a) / 2
    t = tl.math.rsqrt(1.0 + 0.5 * a)
    t = t * t  # 1 / (1 + a / 2) without a division's range checks
    if ACCURATE:  # erfc(a) = t exp(-a^2 + P(t)): Numerical Recipes' P, degree 9
        poly = -0.82215223 + t * 0.17087277  # by Horner's rule, from the highest power
        poly = 1.48851587 + t * poly
        poly = -1.13520398 + t * poly
        poly = 0.27886807 + t * poly
        poly = -0.18628806 + t * poly
        poly = 0.09678418 + t * poly
        poly = 0.37409196 + t * poly
        poly = 1.00002368 + t * poly
        poly = -1.26551223 + t * poly
    else:  # our fit of degree 5: fractional error under 8.6e-5, below fp16's rounding
        poly = -0.554100522 + t * 0.172230977
        poly = 0.317568607 + t * poly
        poly = 0.326171283 + t * poly
        poly = 1.0035986 + t * poly
        poly = -1.26555438 + t * poly
    return t * tl.math.exp2(1.4426950408889634 * (poly - a * a) - 1.0)  # - 1: erfc / 2


@triton.jit
def apply_activation(z, ACTIVATION: tl.constexpr, OUT: tl.constexpr):
    if ACTIVATION == "relu":  # where, not maximum, which drops a NaN: torch keeps it
        return tl.where(z < 0.0, 0.0, z)
    elif ACTIVATION == "leaky_relu":  # slope 0.01, torch's default
        return tl.where(z > 0, z, 0.01 * z)
    elif ACTIVATION == "gelu":  # the exact form, z Phi(z) = max(z, 0) - |z| Phi(-|z|)
        magnitude = tl.minimum(tl.abs(z), 3e38)  # at +-inf inf and 0, not inf - inf x 0
        return tl.maximum(z, 0.0) - magnitude * normal_tail(z, OUT == tl.float32)
    elif ACTIVATION == "squared_relu":
        return tl.where(z < 0.0, 0.0, z * z)
    else:
        return z


@triton.jit
def activation_derivative(z, ACTIVATION: tl.constexpr, OUT: tl.constexpr):
    if ACTIVATION == "relu":  # 1 at NaN, as torch's
        return tl.where(z <= 0, 0.0, 1.0)
    elif ACTIVATION == "leaky_relu":
        return tl.where(z > 0, 1.0, 0.01)
    elif ACTIVATION == "gelu":  # Phi(z) + z phi(z), phi by exp2
        tail = normal_tail(z, OUT == tl.float32)
        density = tl.math.exp2(-0.7213475204444817 * z * z - 1.3257480647361595)
        return tl.where(z >= 0, 1.0 - tail, tail) + z * density
    elif ACTIVATION == "squared_relu":
        return 2.0 * tl.where(z < 0.0, 0.0, z)
    else:
        return tl.full(z.shape, 1.0, tl.float32)


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation {activation!r} unknown; choose one of {ACTIVATIONS}"
        )


def activation_reference(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The same activation in PyTorch, to check kernels against and to benchmark."""
    check_activation(activation)
    if activation is None:
        return z
    if activation == "squared_relu":
        return torch.relu(z).square()
    return getattr(torch.nn.functional, activation)(z)
