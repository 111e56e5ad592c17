"""Argument checks of public functions whose chapters leave them out of the lesson.

Each raises with what to do instead; the chapter's function calls it before any kernel runs.
"""

import math

from stepkernels._core import check_tensor
import torch


def layer_norm_arguments(x, normalized_shape, weight, bias, eps, reduction, block_size, dtypes,
        reductions):  # fmt: skip
    """``normalized_shape`` as a tuple, once chapter 03's ``layer_norm`` arguments pass."""
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        if tensor is not None:
            check_tensor(tensor, name, dtypes)
    shape = normalized_shape
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    if not all(isinstance(size, int) for size in shape):
        raise TypeError(f"normalized_shape must be ints, got {normalized_shape!r}")
    if not shape or len(shape) > x.dim() or x.shape[x.dim() - len(shape) :] != shape:
        raise ValueError(f"normalized_shape {shape} must be the trailing dimensions of "
                         f"x {tuple(x.shape)}: pass x.shape[-k:] for k dimensions")  # fmt: skip
    if math.prod(shape) == 0:
        raise ValueError("normalized_shape has a zero dimension: nothing to normalize")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != shape:
            raise ValueError(f"{name} must have normalized_shape {shape}")
        if param is not None and param.dtype != x.dtype:
            raise TypeError(f"{name} is {param.dtype} but x is {x.dtype}: convert it")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if reduction not in reductions:
        raise ValueError(f"reduction {reduction!r} unknown: choose one of {reductions}")
    if block_size is not None and (block_size < 1 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return shape
