"""ops.compiler_ops: the code of chapter 08, Launch overhead: what a call costs, and CUDA graphs
and torch.compile to remove it."""

# Generated from tutorials/08-launch-overhead.py by tools/export.py: edit the chapter, then `make
# export`.

import math

from stepkernels.ops.layer_norm import (
    REDUCTIONS,
    SUPPORTED_DTYPES,
    LayerNorm,
    layer_norm_backward,
    layer_norm_forward,
    rows_of,
)
from stepkernels.runtime.arguments import layer_norm_arguments
from stepkernels.runtime.core import refuse_double_backward
import torch
from torch import Tensor
from torch.library import triton_op


@triton_op("stepkernels::layer_norm_forward", mutates_args={})
def layer_norm_forward_op(
    x2d: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return layer_norm_forward(x2d, weight, bias, eps)  # y, mean, rstd


@triton_op("stepkernels::layer_norm_backward", mutates_args={})
def layer_norm_backward_op(
    dy2d: Tensor,
    x2d: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    want_dw: bool,
    want_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = layer_norm_backward(dy2d, x2d, weight, mean, rstd, want_dw, want_db)
    none = lambda: x2d.new_empty(0)  # an operator returns fresh tensors, never None
    return dx, none() if dw is None else dw, none() if db is None else db


def save_for_backward(ctx, inputs, output):
    x2d, weight, bias, _ = inputs
    ctx.save_for_backward(x2d, weight, *output[1:])
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)  # mean and rstd get no gradient


def backward(ctx, dy, _mean_grad, _rstd_grad):
    refuse_double_backward("layer_norm", "torch.nn.functional.layer_norm")
    x2d, weight, mean, rstd = ctx.saved_tensors
    want_dw = weight is not None and ctx.needs_input_grad[1]
    want_db = ctx.has_bias and ctx.needs_input_grad[2]
    grads = layer_norm_backward_op(
        dy.contiguous(), x2d, weight, mean, rstd, want_dw, want_db
    )
    return grads[0], grads[1] if want_dw else None, grads[2] if want_db else None, None


layer_norm_forward_op.register_autograd(backward, setup_context=save_for_backward)


def traced_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``stepkernels.layer_norm`` as operators that ``torch.compile`` traces into."""
    shape = layer_norm_arguments(
        x,
        normalized_shape,
        weight,
        bias,
        eps,
        "two-stage",
        None,
        SUPPORTED_DTYPES,
        REDUCTIONS,
    )
    x2d = rows_of(x, math.prod(shape))
    flat = lambda p: None if p is None else p.reshape(-1).contiguous()
    y, _, _ = layer_norm_forward_op(x2d, flat(weight), flat(bias), float(eps))
    return y.view(x.shape)


class TracedLayerNorm(LayerNorm):
    """``stepkernels.LayerNorm``, through the operators above while being compiled."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            return traced_layer_norm(
                x, self.normalized_shape, self.weight, self.bias, self.eps
            )
        return super().forward(x)
