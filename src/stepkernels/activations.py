"""activations: the code of chapter 04, Matrix multiplication at cuBLAS speed."""

# Generated from tutorials/04-matrix-multiplication.py by tools/export.py: edit the chapter, then
# `make export`.

import torch
import triton
import triton.language as tl

ACTIVATIONS = (None, "relu", "leaky_relu", "gelu", "squared_relu")


@triton.jit
def apply_activation(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        return tl.maximum(z, 0.0)
    elif ACTIVATION == "leaky_relu":  # slope 0.01, torch's default
        return tl.where(z > 0, z, 0.01 * z)
    elif ACTIVATION == "gelu":  # the exact form, z * Phi(z), as torch's default
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACTIVATION == "squared_relu":
        relu = tl.maximum(z, 0.0)
        return relu * relu
    else:
        return z


@triton.jit
def activation_derivative(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        return tl.where(z > 0, 1.0, 0.0)
    elif ACTIVATION == "leaky_relu":
        return tl.where(z > 0, 1.0, 0.01)
    elif ACTIVATION == "gelu":  # Phi(z) + z * phi(z)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        return cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACTIVATION == "squared_relu":
        return 2.0 * tl.maximum(z, 0.0)
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
