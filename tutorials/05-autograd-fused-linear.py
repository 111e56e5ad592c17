r"""
Autograd: a fused linear layer that trains
==========================================

We build a linear layer with bias and activation fused into chapter 04's matrix product, with its
backward (``linear`` and a drop-in ``FusedLinear``), compile it, and train a network with it.

What you will learn:

* why the backward of a matrix product is two more products with the *same* kernel, on transposed
  views, and how a ``torch.autograd.Function`` pairs a forward kernel with its backward;
* the backward of a fused activation, dZ = dY * act'(Z), and whether to keep Z or recompute it;
* ``torch.library.custom_op``, which makes a Triton kernel an operator ``torch.compile`` accepts.

Prerequisites: chapter 04 (matrix multiplication), whose ``matmul`` we import from the package.
"""

# %%
# Setup
# -----
# Chapter 04's ``matmul(a, b, activation, *, bias, return_preactivation)``: ``activation(a @ b +
# bias)`` for any strides (and ``a @ b + bias`` if asked) in one kernel; fp32 as PyTorch's setting.

import functools

from stepkernels.lessons import bench, figures_linear, tutorial
from stepkernels.ops.matmul import matmul
from stepkernels.runtime.activations import ACTIVATIONS, activation_reference
import torch
from torch import nn

tutorial.announce()
DEVICE = tutorial.DEVICE
# sphinx_gallery_thumbnail_number = 2

# %%
# The backward of a matrix product
# --------------------------------
# Autograd runs a network backwards: each operation receives the gradient of the loss with respect
# to its output and returns the gradients with respect to its inputs. For C = A B, with A (M, K),
# B (K, N) and dC = dLoss/dC (M, N), the chain rule gives two matrix products::
#
#     dA = dC  @ B^T      (M, N) @ (N, K) -> (M, K)
#     dB = A^T @ dC       (K, M) @ (M, N) -> (K, N)
#
# Each costs 2 M N K operations, as much as the forward. ``b.mT`` is a *view*: B's memory with the
# strides swapped, which chapter 04's kernel reads as they are. A ``torch.autograd.Function``
# pairs a forward, which saves what the backward needs, with a backward that returns one gradient
# per input (``None`` where nobody asked). The check passes a product that notes what it receives:
# the backward's transposes arrive as views, with swapped strides. Tolerances, here and below:
# 1e-4 in fp32, 1e-2 in fp16, 4e-2 in bf16, in absolute terms scaled by the largest element.


class Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, product):
        ctx.save_for_backward(a, b)
        ctx.product = product
        return product(a, b)

    @staticmethod
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:  # B^T: a view, same memory, strides swapped
            grad_a = ctx.product(grad_c, b.mT)
        if ctx.needs_input_grad[1]:
            grad_b = ctx.product(a.mT, grad_c)
        return grad_a, grad_b, None  # no gradient for ``product``


def recorded_matmul(a, b):
    seen.append([(t.data_ptr(), t.stride()) for t in (a, b)])
    return matmul(a, b)


def assert_close(got, want, dtype):
    assert got.dtype == dtype, got.dtype
    unit = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype]
    atol = unit * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float(), want, rtol=unit, atol=atol)


torch.manual_seed(0)
a = torch.randn(67, 45, device=DEVICE, requires_grad=True)
b = torch.randn(45, 83, device=DEVICE, requires_grad=True)
grad_c, seen = torch.randn(67, 83, device=DEVICE), []
grads = torch.autograd.grad(Matmul.apply(a, b, recorded_matmul), (a, b), grad_c)
for got, want in zip(grads, torch.autograd.grad(a @ b, (a, b), grad_c), strict=True):
    assert_close(got, want, torch.float32)
(_, forward_b), (_, b_transposed), (a_transposed, _) = seen
assert b_transposed == (b.data_ptr(), b.stride()[::-1])
assert a_transposed == (a.data_ptr(), a.stride()[::-1])
strides = forward_b[1], b_transposed[1], a_transposed[1]
print("strides: B, B^T in dA, A^T in dB:", *strides)

# %%
# A fused linear layer
# --------------------
# For x (..., in_features) flattened to X (M, K) and a weight W (N, K) as ``nn.Linear`` holds it, a
# layer computes Z = X W^T + b and Y = act(Z). Eager PyTorch writes Z to memory and reads it back
# for the activation; chapter 04's kernel applies both to its accumulator: Z never leaves the chip.
# The backward, with the chain rule through the activation::
#
#     dZ = dY * act'(Z)      element-wise
#     dX = dZ @ W            (M, N) @ (N, K)
#     dW = dZ^T @ X          (N, M) @ (M, K)
#     db = dZ summed over the M rows
#
# W^T and dZ^T are views again. The backward needs Z: we **keep** it (the forward also writes it)
# as ``nn.Linear`` + GELU does, or ``recompute=True`` runs ``X @ W^T + b`` again: a third more work.
#
# The dZ kernel
# -------------
# dZ = dY * act'(Z) is element-wise and memory bound, with ``activation_derivative``, the
# counterpart of the epilogue's ``apply_activation``. Each program also sums its tile's columns into
# a row of partial sums, which ``column_sums`` turns into db: the same db on every run.
# dY may have any strides (``y.sum()``'s gradient has strides 0). The backward computes only the
# gradients asked for, and a new empty tensor for the others: an operator's outputs may not alias.
# In fp32 on Hopper, where dW's product runs as tf32 and wants dZ^T K-major (chapter 07), the
# kernel also writes dZ^T, for half what a copy of dZ would cost in memory traffic.
#
# Without an activation dZ is dY, and db its column sums: a read of all of dY, for a vector. In a
# training step that is the attention's QKV projection, whose dY is the widest of a block (3C
# columns). ``column_sums`` reads it once, in one launch: each program sums a run of rows of
# a block of columns into a row of fp32 partial sums, then counts itself in on that block's
# counter; the last to arrive adds the rows in their order (the same bits whichever program
# comes last), rounds once into the bias's dtype, and sets the counter back to zero for the
# next launch, so no launch pays for zeroing it (``zeroed``: scratch kept per stream, as chapter
# 07's split products keep theirs). The same kernel adds the dZ kernel's partial rows.

# @save ops/linear
from stepkernels.ops.matmul import bound_product, copies_for_tf32, product
from stepkernels.runtime.activations import activation_derivative
from stepkernels.runtime.arguments import (
    OPTIONAL_TENSOR_TYPES,
    TENSOR_TYPES,
    linear_arguments,
    linear_options,
)
from stepkernels.runtime.core import refuse_double_backward, sm_count, zeroed
from stepkernels.runtime.launch import (
    bound_launches,
    cdiv,
    layout,
    lean,
    lean_now,
    plan_cache,
    recorded_launches,
)
import torch
from torch import Tensor, nn
import triton
import triton.language as tl


@lean
@triton.jit
def column_sums_kernel(
    x_ptr,
    partial_ptr,
    counter_ptr,
    out_ptr,
    M,
    N,
    stride_m,
    stride_n,
    rows_per_program,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    part, block_n = tl.program_id(axis=0), tl.program_id(axis=1)
    parts = tl.num_programs(axis=0)
    columns = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    column_mask = columns < N
    first = part.to(tl.int64) * rows_per_program  # a whole number of BLOCK_M rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in tl.range(0, rows_per_program, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & column_mask[None, :]
        ptrs = (
            x_ptr + rows[:, None] * stride_m + columns.to(tl.int64)[None, :] * stride_n
        )
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    partial_row = partial_ptr + part.to(tl.int64) * N
    tl.store(partial_row + columns, tl.sum(acc, axis=0), mask=column_mask)
    tl.debug_barrier()  # every thread of this program has stored
    arrived = tl.atomic_add(counter_ptr + block_n, 1, sem="acq_rel")
    if arrived == parts - 1:  # the last of its column block: add every row, in order
        total = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for slot in tl.range(0, parts, BLOCK_P):
            slots = slot + tl.arange(0, BLOCK_P)
            mask = (slots < parts)[:, None] & column_mask[None, :]
            ptrs = partial_ptr + slots.to(tl.int64)[:, None] * N + columns[None, :]
            total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # L2
        out = tl.sum(total, axis=0).to(out_ptr.dtype.element_ty)  # one rounding
        tl.store(out_ptr + columns, out, mask=column_mask)
        tl.store(counter_ptr + block_n, 0)  # ready for the next launch


COLUMN_SUMS_BLOCK = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_P": 16, "num_warps": 4}
COLUMN_SUMS_WAVES = 4  # programs for about this many per SM


def column_sums(x, dtype=torch.float32):
    """x (M, N), any strides, summed over its rows in fp32 and rounded once to ``dtype``:
    a bias gradient, in one launch, the same bits every run on a GPU. A repeated call
    launches its kernel bound (chapter 08), under a key of x's layout and ``dtype``."""
    fast = type(x) is torch.Tensor and lean_now()
    if fast:
        key = (layout(x), dtype)
        planned = COLUMN_SUMS_PLANS.get(key)
        if planned is not None:
            return planned(x)
    with recorded_launches(fast) as launches:
        out, partial, counters = column_sums_launch(x, dtype)
    if fast and (bound := bound_launches(launches, (x, partial, counters, out))):
        COLUMN_SUMS_PLANS[key] = planned_column_sums(bound[0], partial, counters, out)
    return out


COLUMN_SUMS_PLANS = plan_cache()


def planned_column_sums(launch, partial, counters, out):
    """``column_sums_launch`` for one key, its launch bound; the counters are the
    stream's (``zeroed``), fetched each call as the keyed path does."""
    partial_shape, blocks_n, n, dtype = (
        partial.shape,
        counters.numel(),
        *out.shape,
        out.dtype,
    )

    def column_sums_bound(x):
        out = torch.empty(n, device=x.device, dtype=dtype)
        partial = torch.empty(partial_shape, device=x.device, dtype=torch.float32)
        launch(x, partial, zeroed(x.device, blocks_n), out)
        return out

    return column_sums_bound


def column_sums_launch(x, dtype):
    """The sums (``dtype``), the partial rows and the counters of one launch."""
    M, N = x.shape
    out = torch.empty(N, device=x.device, dtype=dtype)
    if N == 0 or M == 0:
        return out.zero_(), out, out
    block_m, block_n = COLUMN_SUMS_BLOCK["BLOCK_M"], COLUMN_SUMS_BLOCK["BLOCK_N"]
    blocks_n = cdiv(N, block_n)
    # programs for a few waves, each a whole number of row blocks, none without rows
    parts = min(cdiv(M, block_m), max(1, COLUMN_SUMS_WAVES * sm_count() // blocks_n))
    rows_per_program = cdiv(cdiv(M, parts), block_m) * block_m
    parts = cdiv(M, rows_per_program)
    partial = torch.empty((parts, N), device=x.device, dtype=torch.float32)
    counters = zeroed(x.device, blocks_n)
    column_sums_kernel[(parts, blocks_n)](
        x,
        partial,
        counters,
        out,
        M,
        N,
        *x.stride(),
        rows_per_program,
        **COLUMN_SUMS_BLOCK,
    )
    return out, partial, counters


@lean  # cheap repeated launches: chapter 08
@triton.jit
def activation_backward_kernel(
    grad_y_ptr,
    z_ptr,
    grad_z_ptr,
    grad_z_t_ptr,
    bias_partial_ptr,
    M,
    N,
    stride_grad_y_m,
    stride_grad_y_n,
    stride_z_m,
    stride_z_n,
    ACTIVATION: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    block_m = tl.program_id(axis=0)
    rows = block_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.program_id(axis=1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (columns[None, :] < N)
    grad_y_offsets = (
        rows[:, None] * stride_grad_y_m + columns[None, :] * stride_grad_y_n
    )
    grad_y_ptrs = grad_y_ptr + grad_y_offsets
    z_ptrs = z_ptr + rows[:, None] * stride_z_m + columns[None, :] * stride_z_n
    # fp32 arithmetic whatever the storage dtype (bf16 must be converted first anyway).
    grad_y = tl.load(grad_y_ptrs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    grad_z = grad_y * activation_derivative(z, ACTIVATION, grad_z_ptr.dtype.element_ty)
    grad_z_ptrs = grad_z_ptr + rows[:, None] * N + columns[None, :]
    tl.store(grad_z_ptrs, grad_z.to(grad_z_ptr.dtype.element_ty), mask=mask)
    if TRANSPOSED:  # dZ^T too (N x M, row-major): dW's K-major operand
        grad_z_t_ptrs = grad_z_t_ptr + columns[None, :].to(tl.int64) * M + rows[:, None]
        tl.store(grad_z_t_ptrs, grad_z.to(grad_z_t_ptr.dtype.element_ty), mask=mask)
    if BIAS_GRAD:  # masked lanes hold dY = 0, so they add nothing to the column sums
        partial_ptrs = bias_partial_ptr + block_m * N + columns
        tl.store(partial_ptrs, tl.sum(grad_z, axis=0), mask=columns < N)


ACTIVATION_BACKWARD_BLOCK = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}


def activation_backward(
    grad_y,
    z,
    activation,
    bias_grad: bool,
    over_z=False,
    transposed=False,
    bias_dtype=torch.float32,
):
    """dZ = dY * act'(Z) in Z's dtype (over Z if ``over_z``); db (``bias_dtype``) from
    block sums (``column_sums``);
    dZ^T, contiguous, if ``transposed`` (else None). A repeated call launches its kernel
    bound (chapter 08), under a key of dY's and Z's layouts and the options."""
    options = (activation, bias_grad, over_z, transposed)
    fast = type(grad_y) is torch.Tensor and type(z) is torch.Tensor and lean_now()
    if fast:
        key = (layout(grad_y), layout(z), *options)
        planned = ACTIVATION_PLANS.get(key)
        if planned is not None:
            grad_z, partial, grad_z_t = planned(grad_y, z)
            return (
                grad_z,
                (column_sums(partial, bias_dtype) if bias_grad else None),
                grad_z_t,
            )
    with recorded_launches(fast) as launches:
        grad_z, partial, grad_z_t = activation_backward_launch(grad_y, z, *options)
    outputs = (grad_z, grad_z if grad_z_t is None else grad_z_t, partial)
    if fast and (bound := bound_launches(launches, (grad_y, z, *outputs))):
        ACTIVATION_PLANS[key] = planned_activation_backward(bound[0], partial, *options)
    return grad_z, (column_sums(partial, bias_dtype) if bias_grad else None), grad_z_t


ACTIVATION_PLANS = plan_cache()


def planned_activation_backward(
    launch, partial, activation, bias_grad, over_z, transposed
):
    """``activation_backward_launch`` for one key, its launch bound."""
    partial_shape = partial.shape

    def activation_backward_bound(grad_y, z):
        M, N = z.shape
        grad_z = z if over_z else torch.empty((M, N), device=z.device, dtype=z.dtype)
        grad_z_t = z.new_empty((N, M)) if transposed else None
        partial = torch.empty(partial_shape, device=z.device, dtype=torch.float32)
        launch(grad_y, z, grad_z, grad_z if grad_z_t is None else grad_z_t, partial)
        return grad_z, partial, grad_z_t

    return activation_backward_bound


def activation_backward_launch(grad_y, z, activation, bias_grad, over_z, transposed):
    """dZ, the block sums of dZ (fp32) and dZ^T (or None), from one launch."""
    M, N = z.shape
    grad_z = z if over_z else torch.empty((M, N), device=z.device, dtype=z.dtype)
    grad_z_t = z.new_empty((N, M)) if transposed else None
    blocks_m = cdiv(M, ACTIVATION_BACKWARD_BLOCK["BLOCK_M"])
    partial = torch.empty((blocks_m, N), device=z.device, dtype=torch.float32)
    if grad_z.numel() > 0:
        grid = (blocks_m, cdiv(N, ACTIVATION_BACKWARD_BLOCK["BLOCK_N"]))
        outputs = (grad_z, grad_z if grad_z_t is None else grad_z_t, partial)
        strides = (*grad_y.stride(), *z.stride())
        flags = dict(ACTIVATION=activation, BIAS_GRAD=bias_grad, TRANSPOSED=transposed)
        activation_backward_kernel[grid](
            grad_y, z, *outputs, M, N, *strides, **flags, **ACTIVATION_BACKWARD_BLOCK
        )
    return grad_z, partial, grad_z_t


def fused_linear_forward(x, weight, bias, activation, keep_z):
    if activation is not None and keep_z:
        return product(x, weight.mT, activation, bias, True)
    return product(x, weight.mT, activation, bias), x.new_empty(0)


def fused_linear_backward(grad_y, x, weight, bias, z, activation, needs_grad):
    need_x, need_weight, need_bias = needs_grad
    if activation is None:  # act' = 1: dZ is dY itself
        grad_z, grad_z_t = grad_y, None
        grad_bias = column_sums(grad_y, x.dtype) if need_bias else None
    else:
        again = z is None  # recompute: the forward product, without the activation,
        z = product(x, weight.mT, None, bias) if again else z  # then dZ over it
        # dZ^T from the dZ kernel where dW's product would copy it (fp32 as tf32)
        transposed = need_weight and copies_for_tf32(x.dtype, *weight.shape, len(x))
        grad_z, grad_bias, grad_z_t = activation_backward(
            grad_y, z, activation, need_bias, again, transposed, x.dtype
        )
    grad_z_t = grad_z.mT if grad_z_t is None else grad_z_t  # a view, or the kernel's
    return (  # a new empty tensor for each gradient not asked for: none may alias
        product(grad_z, weight) if need_x else x.new_empty(0),
        product(grad_z_t, x) if need_weight else x.new_empty(0),
        grad_bias.to(x.dtype) if need_bias else x.new_empty(0),
    )


# %%
# A custom operator
# -----------------
# ``torch.compile`` keeps an operator made with ``torch.library.custom_op`` (here
# ``torch.ops.stepkernels.fused_linear``) as one opaque node. Its annotations are the schema;
# ``register_fake`` gives outputs of the right shape, dtype and device for inputs without data, so
# the compiler traces without running it; ``register_autograd`` gives the derivative, a second
# operator. Operators return no input or view of one and declare what they modify
# (``mutates_args=()``). The backward refuses ``create_graph=True``: autograd cannot differentiate
# our kernels.

# @save ops/linear


@torch.library.custom_op("stepkernels::fused_linear", mutates_args=())
def fused_linear_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, keep_z: bool
) -> tuple[Tensor, Tensor]:
    return fused_linear_forward(x, weight, bias, activation, keep_z)


@fused_linear_op.register_fake
def _(x, weight, bias, activation, keep_z):
    y = x.new_empty((x.shape[0], weight.shape[0]))
    return y, (torch.empty_like(y) if activation and keep_z else x.new_empty(0))


@torch.library.custom_op("stepkernels::fused_linear_backward", mutates_args=())
def fused_linear_backward_op(
    grad_y: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    z: Tensor | None,
    activation: str | None,
    needs_grad: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    return fused_linear_backward(grad_y, x, weight, bias, z, activation, needs_grad)


@fused_linear_backward_op.register_fake
def _(grad_y, x, weight, bias, z, activation, needs_grad):
    shapes = (x.shape, weight.shape, weight.shape[:1])
    return tuple(
        x.new_empty(s if n else (0,)) for s, n in zip(shapes, needs_grad, strict=True)
    )


def autograd_setup(ctx, inputs, output):
    x, weight, bias, activation, keep_z = inputs
    ctx.activation = activation
    ctx.save_for_backward(x, weight, bias, output[1] if activation and keep_z else None)
    ctx.set_materialize_grads(False)  # Z's gradient is never used: do not fill one in


def autograd_backward(ctx, grad_y, _grad_z, backward=fused_linear_backward_op):
    refuse_double_backward("linear", "torch.nn.functional.linear and the activation")
    needs_grad = list(ctx.needs_input_grad[:3])  # of x, weight, bias
    args = (grad_y, *ctx.saved_tensors, ctx.activation, needs_grad)
    grads = backward(*args)
    grads = [g if n else None for g, n in zip(grads, needs_grad, strict=True)]
    return *grads, None, None  # none for activation and keep_z


fused_linear_op.register_autograd(autograd_backward, setup_context=autograd_setup)


class FusedLinearFunction(torch.autograd.Function):
    """The same forward and backward without the operator, for eager calls."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, keep_z, planned=None):
        if planned is None:
            output = fused_linear_forward(x, weight, bias, activation, keep_z)
        else:
            output = planned(x, weight, bias)
        autograd_setup(ctx, (x, weight, bias, activation, keep_z), output)
        return output

    @staticmethod
    def backward(ctx, grad_y, grad_z):
        grads = autograd_backward(ctx, grad_y, grad_z, backward=fused_linear_backward)
        return *grads, None  # none for planned


# %%
# The layer
# ---------
# ``linear`` checks its inputs, flattens x into rows and calls the operator under
# ``torch.compile``, keeping Z only when a gradient will be asked for. Eager calls take an
# ``autograd.Function`` with the same forward and backward (an operator's dispatch costs the CPU
# more than our kernels take: chapter 08), or the forward alone when nothing needs a gradient.
# Rows are counted, not ``-1``: with no input features ``reshape(-1, 0)`` fails. A repeated
# call skips the checks that passed for its inputs' layouts, and its products replay their
# launches bound (chapters 04 and 08).
# ``FusedLinear`` subclasses ``nn.Linear``: same parameters, initialisation and ``state_dict``.

# @save ops/linear
# A repeated call, checked before, replays its forward's product bound (chapters 04 and 08),
# under a key of the tensors' layouts and devices, the options, whether a gradient is wanted
# and fp32's precision.
FORWARD_PLANS = plan_cache()


def planned_forward(rows, weight, bias, activation, needs_grad, keep_z):
    """The forward for one key, its product bound; None where the product is not."""
    with_z = activation is not None and keep_z
    planned = bound_product(rows, weight.mT, activation, bias, with_z)
    if planned is None:
        return None
    if not needs_grad:  # y alone
        return lambda x, weight, bias: planned(x, weight.mT, bias, None)
    if with_z:  # (y, z)
        return lambda x, weight, bias: planned(x, weight.mT, bias, None)
    return lambda x, weight, bias: (planned(x, weight.mT, bias, None), x.new_empty(0))


def linear(x, weight, bias=None, activation=None, *, recompute=False):
    """``activation(x @ weight.T + bias)`` in one kernel, differentiable, for weight and
    bias as ``nn.Linear`` holds them; ``recompute``: recompute x @ weight.T + bias in
    the backward instead of keeping it from the forward."""
    fast = type(x) is torch.Tensor and type(weight) in TENSOR_TYPES
    fast = fast and type(bias) in OPTIONAL_TENSOR_TYPES and type(recompute) is bool
    fast = fast and type(activation) in (str, type(None))
    fast = fast and not torch.compiler.is_compiling() and lean_now()
    if fast:  # a call seen before: checked then, its product bound
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad
            or weight.requires_grad
            or (bias is not None and bias.requires_grad)
        )
        fp32 = x.dtype == torch.float32
        precision = torch.get_float32_matmul_precision() if fp32 else None
        key = (layout(x), layout(weight), layout(bias), activation)
        key = (*key, recompute, needs_grad, precision)
        planned = FORWARD_PLANS.get(key)
        if planned is not None:
            rows = x if x.dim() == 2 else x.reshape(x.shape[:-1].numel(), x.shape[-1])
            if needs_grad:
                keep_z = not recompute
                args = (rows, weight, bias, activation, keep_z, planned)
                y, _ = FusedLinearFunction.apply(*args)
            else:
                y = planned(rows, weight, bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    linear_arguments(
        x, weight, bias, activation, recompute
    )  # raises, saying what to do
    tensors = (x, weight) if bias is None else (x, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # A matrix as it is: a reshape and a view would add two autograd nodes to ours
    rows = x if x.dim() == 2 else x.reshape(x.shape[:-1].numel(), x.shape[-1])
    keep_z = needs_grad and not recompute
    if torch.compiler.is_compiling():
        y, _ = fused_linear_op(rows, weight, bias, activation, keep_z)
    elif needs_grad:
        y, _ = FusedLinearFunction.apply(rows, weight, bias, activation, keep_z)
    else:  # the forward's product alone
        y = product(rows, weight.mT, activation, bias)
    if fast:
        args = (rows, weight, bias, activation, needs_grad, keep_z)
        if (forward := planned_forward(*args)) is not None:
            FORWARD_PLANS[key] = forward
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


class FusedLinear(nn.Linear):
    """``nn.Linear`` followed by an activation, fused into one Triton kernel."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        activation=None,
        recompute=False,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        linear_options(activation, recompute)  # refused now, not at the first call
        self.activation, self.recompute = activation, recompute

    def forward(self, x):
        args = (x, self.weight, self.bias, self.activation)
        return linear(*args, recompute=self.recompute)

    def extra_repr(self):
        mine = f"activation={self.activation!r}, recompute={self.recompute}"
        return f"{super().extra_repr()}, {mine}"


# %%
# Correctness
# -----------
# The forward and the three gradients against PyTorch's in fp32 on the same rounded inputs, with Z
# kept and recomputed (equal to the bit); bf16 on a GPU only. Each activation and dtype compiles
# kernels, seconds each on a GPU: a quick GPU run checks GELU alone in fp16 (``STEPKERNELS_FULL=1``
# every activation, as the interpreter; ``tests/test_linear.py`` every activation and dtype).
# Then refusals; more in the tests.


def torch_linear(x, weight, bias=None, activation=None):
    """The same layer in plain PyTorch: nn.Linear's function, then the activation."""
    return activation_reference(nn.functional.linear(x, weight, bias), activation)


def check_linear(cases):
    for shape, out_features, dtype, activation, with_bias in cases:
        generator = torch.Generator().manual_seed(0)
        params = nn.Linear(shape[-1], out_features, bias=with_bias).parameters()
        inputs = [torch.randn(shape, generator=generator), *params]
        inputs = [t.detach().to(DEVICE, dtype) for t in inputs]
        grad_y = torch.randn(*shape[:-1], out_features, generator=generator).to(DEVICE)
        results = []
        for recompute in (False, True):
            leaves = [t.clone().requires_grad_() for t in inputs]
            y = linear(*leaves, activation=activation, recompute=recompute)
            results.append([y, *torch.autograd.grad(y, leaves, grad_y.to(dtype))])
        leaves = [t.float().requires_grad_() for t in inputs]
        y = torch_linear(*leaves, activation=activation)
        expected = [y, *torch.autograd.grad(y, leaves, grad_y)]
        for got, want in zip(results[0], expected, strict=True):
            assert_close(got, want, dtype)
        assert all(map(torch.equal, *results))
    print(f"forward and gradients match torch in {len(cases)} cases")


CHECK_ACTIVATIONS = tutorial.choose(gpu=["gelu"], cpu=ACTIVATIONS, full=ACTIVATIONS)
check_linear(
    [((3, 37, 45), 29, torch.float16, act, True) for act in CHECK_ACTIVATIONS]
    + [((37, 45), 29, torch.float32, "gelu", True), ((45,), 29, torch.float32, None, 0)]
    + bench.choose(gpu=[((37, 45), 29, torch.bfloat16, "gelu", True)], cpu=[])
)
x, weight = torch.randn(8, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
bad_calls = {
    "features differ": lambda: linear(x, weight.mT),
    "dtypes differ": lambda: linear(x.half(), weight),
    "activation": lambda: linear(x, weight, activation="tanh"),
}
tutorial.show_refusals("linear()", bad_calls)
try:
    y = linear(x, weight.requires_grad_(), activation="gelu")
    torch.autograd.grad(y.sum(), weight, create_graph=True)
except RuntimeError as error:
    print(f"create_graph=True: {error}")

# %%
# Keep or recompute: the memory
# -----------------------------
# ``torch.autograd.graph.saved_tensors_hooks`` calls a function of ours for every tensor saved for
# the backward: we count what 4 layers save, in activations (tokens x width).


def saved_activations(layer_fn, layers=4, tokens=64, width=32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=generator).to(DEVICE).requires_grad_()
    saved = {}

    def pack(tensor):
        saved[(tensor.data_ptr(), tensor.nbytes)] = tensor.nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for _ in range(layers):
            weight = torch.randn(width, width, generator=generator).to(DEVICE)
            bias = torch.randn(width, generator=generator).to(DEVICE)
            x = layer_fn(x, weight.requires_grad_(), bias.requires_grad_())
    return sum(saved.values()) / (tokens * width * 4)


for name, layer_fn in {
    "torch (nn.Linear + GELU)": lambda x, w, b: torch_linear(x, w, b, "gelu"),
    "fused, keep Z (default)": lambda x, w, b: linear(x, w, b, "gelu"),
    "fused, recompute Z": lambda x, w, b: linear(x, w, b, "gelu", recompute=True),
}.items():
    print(f"{name:<26} saves {saved_activations(layer_fn):4.1f} activations")

# %%
# Per layer PyTorch saves X (for dW), W (for dX) and Z (GELU's input), ours the bias too, and the
# recomputing one no Z. Without the weights (half an activation each), that halves what it holds.
#
# Training a small network
# ------------------------
# Two copies of a three-layer MLP start from the same weights (``FusedLinear`` initialises itself
# as ``nn.Linear`` does) and fit a smooth function on the same batches, in fp32 with tf32 products
# on a GPU: the precision, which ``matmul`` follows, is "high" for the run, restored after. A
# quick GPU run trains a network of width 128 on batches of 256, whose products are too small
# for the autotuner (chapter 04): ``STEPKERNELS_FULL=1`` trains width 512 on batches of 1,024.

INPUTS, STEPS = bench.choose(gpu=64, cpu=8), bench.choose(gpu=300, cpu=40)
HIDDEN, BATCH = tutorial.choose(gpu=(128, 256), cpu=(32, 32), full=(512, 1024))


def make_mlp(layer, gelu):
    torch.manual_seed(0)
    layers = [layer(INPUTS, HIDDEN, **gelu), layer(HIDDEN, HIDDEN, **gelu)]
    if layer is nn.Linear:
        layers = [layers[0], nn.GELU(), layers[1], nn.GELU()]
    return nn.Sequential(*layers, layer(HIDDEN, 1)).to(DEVICE)


def train(model, batches) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, target in batches:
        loss = nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


generator = torch.Generator().manual_seed(1)
projection = torch.randn(INPUTS, 4, generator=generator) / INPUTS**0.5
inputs = torch.randn(STEPS, BATCH, INPUTS, generator=generator)
targets = torch.sin(inputs @ projection).sum(dim=-1, keepdim=True)  # a smooth function
batches = list(zip(inputs.to(DEVICE), targets.to(DEVICE), strict=True))
fused_mlp = make_mlp(FusedLinear, {"activation": "gelu"})
torch_mlp = make_mlp(nn.Linear, {})
assert all(map(torch.equal, fused_mlp.parameters(), torch_mlp.parameters()))
print(fused_mlp)
precision = torch.get_float32_matmul_precision()
torch.set_float32_matmul_precision("high")
try:
    fused_losses, torch_losses = train(fused_mlp, batches), train(torch_mlp, batches)
finally:
    torch.set_float32_matmul_precision(precision)
# The curves differ only by rounding (the order of additions; on a GPU tf32's, which
# grows with each step): we allow a relative difference of 1e-4 per step here, 3e-2 on a
# GPU.
differences = [abs(a - b) / b for a, b in zip(fused_losses, torch_losses, strict=True)]
title = f"MLP {INPUTS}-{HIDDEN}-{HIDDEN}-1, batch {BATCH}, fp32"
figures_linear.draw_training_losses(torch_losses, fused_losses, title)
print(
    f"{STEPS} steps: loss {torch_losses[0]:.4f} -> {torch_losses[-1]:.4f} (torch), "
    f"{fused_losses[-1]:.4f} (fused), at most {max(differences):.1e} apart (relative)"
)
assert 2 * sum(torch_losses[-10:]) < sum(torch_losses[:10]), "it did not learn"
assert max(differences) <= bench.choose(gpu=3e-2, cpu=1e-4)

# %%
# torch.compile
# -------------
# ``torch.compile(fullgraph=True)`` captures the network as one graph, our operators as opaque
# nodes: with Inductor on a GPU under ``STEPKERNELS_FULL=1``, else with ``aot_eager`` (the same
# capture, run eagerly, without Inductor's code generation: seconds on a cold cache).

backend = tutorial.choose(gpu="aot_eager", cpu="aot_eager", full="inductor")
x, target = batches[0]
grads = []
for model in (fused_mlp, torch.compile(fused_mlp, fullgraph=True, backend=backend)):
    loss = nn.functional.mse_loss(model(x), target)
    grads.append(torch.autograd.grad(loss, list(fused_mlp.parameters())))
for compiled_grad, eager_grad in zip(*grads, strict=True):
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-6)
print(f"torch.compile(fullgraph=True, backend={backend!r}): same gradients as eager")

# %%
# Benchmark
# ---------
# One layer, forward and forward plus backward, against ``nn.Linear`` and the activation in eager
# PyTorch and ``torch.compile`` of it: 4,096 tokens and output features, K from 1,024 to 8,192,
# GELU; then K = 4,096 in fp16 for each activation. fp32 runs as tf32. We count 2 M N K FLOPs per
# product, three with the backward: the recomputing variant's fourth product lowers its rate. A
# quick GPU run measures fp16 at K = 8,192 over the recording, and shows the activations as
# recorded (each compiles kernels of its own); ``STEPKERNELS_FULL=1`` measures everything.

TOKENS = OUT_FEATURES = ACTIVATION_K = bench.choose(gpu=4096, cpu=32)
K_AXIS = "in_features K (M = N = 4096, GELU)"
ACTIVATION_AXIS = "activation (M = N = K = 4096)"


@functools.cache
def compiled_torch_linear(activation, backward):  # one compiled function per case
    return torch.compile(lambda x, w, b: torch_linear(x, w, b, activation))


def make_linear(provider, k, dtype, activation, backward):
    generator = torch.Generator().manual_seed(0)
    x, w, grad_y = (
        torch.randn(shape, generator=generator).to(DEVICE, dtype)
        for shape in ((TOKENS, k), (OUT_FEATURES, k), (TOKENS, OUT_FEATURES))
    )
    w, b = w / k**0.5, torch.zeros_like(w[:, 0])
    leaves = [t.requires_grad_(backward) for t in (x, w, b)]
    fn = {
        "triton": lambda: linear(x, w, b, activation),
        "triton (recompute)": lambda: linear(x, w, b, activation, recompute=True),
        "torch": lambda: torch_linear(x, w, b, activation),
        "torch.compile": lambda: compiled_torch_linear(activation, backward)(x, w, b),
    }[provider]
    return (lambda: torch.autograd.grad(fn(), leaves, grad_y)) if backward else fn


def linear_benchmark(name, backward, per_activation):
    """x is K (with GELU), or the activation's place in ACTIVATIONS (K = ACTIVATION_K),
    which the plot and the printed ratios show by name."""
    k = lambda x: ACTIVATION_K if per_activation else x
    activation = lambda x: ACTIVATIONS[int(x)] if per_activation else "gelu"
    recompute = ["triton (recompute)"] if backward and not per_activation else []
    return bench.Benchmark(
        name=name,
        unit="TFLOP/s",
        float32_matmul_precision="high",
        x_name=ACTIVATION_AXIS if per_activation else K_AXIS,
        x_values=list(range(5)) if per_activation else [1024, 2048, 4096, 8192],
        providers=["triton", *recompute, "torch", "torch.compile"],
        make=lambda p, x, dtype: make_linear(p, k(x), dtype, activation(x), backward),
        work=lambda x, dtype: (3 if backward else 1) * 2 * TOKENS * OUT_FEATURES * k(x),
        dtypes=(torch.float16,) if per_activation else (torch.float16, torch.float32),
        quick_dtypes=() if per_activation else (torch.float16,),
        smoke_x=3 if per_activation else 32,
        headline_x=None if per_activation else 4096,
        x_log2=not per_activation,  # categories: bars, one per activation
        x_labels=dict(enumerate(map(str, ACTIVATIONS))) if per_activation else None,
    )


def print_ratios(results, provider="triton", other="torch"):
    """A table of ``provider``'s TFLOP/s over ``other``'s, a row per dtype."""
    label = results.bench.x_labels or {}
    xs = results.bench.x_values
    print(f"  {provider} / {other}, by {'activation' if label else 'K'}:")
    print(f"    {'':9}" + "".join(f"{label.get(x, f'{x:,}'):>13}" for x in xs))
    for dtype in results.bench.dtypes:
        ratios = [results.ratio(provider, other, x, dtype) for x in xs]
        print(f"    {str(dtype)[6:]:9}" + "".join(f"{r:>12.2f}x" for r in ratios))


def print_called(results, x, dtype="float16"):
    """What calls from Python reach at ``x``, against their GPU time, and the CPU time
    of one call."""
    print(f"  called from Python at K = {x:,}, {dtype}:")
    for p in ("triton", "torch"):
        called, gpu = results.call(p, x, dtype), results.value(p, x, dtype)
        rate = f"{called:6,.0f} TFLOP/s (GPU time {gpu:,.0f})"
        print(f"    {p:8}{rate}, {results.cpu_us(p, x, dtype):,.0f} µs of CPU")


for name, backward, per_activation in [
    ("fused-linear-forward", False, False),
    ("fused-linear-forward-backward", True, False),
    ("fused-linear-activations", False, True),
    ("fused-linear-activations-forward-backward", True, True),
]:
    results = bench.run(linear_benchmark(name, backward, per_activation))
    if results is not None:  # None: not measured, nothing recorded
        print(f"{name}:")
        print_ratios(results)
        if "triton (recompute)" in results.bench.providers:
            print_ratios(results, "triton (recompute)", "triton")
        if results.bench.headline_x:  # small products: the CPU's share shows
            print_called(results, 1024)

# %%
# In fp16 with GELU (an erfc of one ``rsqrt`` and one ``exp2``, chapter 04) the forward runs ahead
# of eager PyTorch, whose GELU is a kernel of its own; forward + backward about level (chapter 07:
# two programs an SM hide the epilogue). Cheap activations are nearly free in the epilogue, where
# PyTorch runs extra kernels: fusion wins, most for squared ReLU; with none, nothing is fused and
# cuBLAS leads. Recomputing Z costs a fourth product. fp32 runs as tf32 on K-major copies (chapter
# 07). Dotted lines: calls from Python, whose CPU outlasts small products.
#
# What we learned
# ---------------
# * The backward of a matrix product is two products, dA = dC B^T and dB = A^T dC; with a kernel
#   that takes any strides the transposes are views, and one kernel serves forward and backward.
# * The fused backward needs act'(Z): keeping Z costs an activation of memory per layer,
#   recomputing it a third more arithmetic. The bias gradient falls out of the dZ kernel.
# * ``torch.library.custom_op`` with a fake implementation and an autograd formula makes a Triton
#   kernel an operator that ``torch.compile(fullgraph=True)`` captures.
#
# Exercises
# ---------
# 1. For relu and leaky_relu, act'(Z) is 1 where Y > 0: save Y instead of Z for those two. Why does
#    that save memory in a network, where Y is the next layer's input, saved there anyway?
# 2. Fuse dZ into the dX product: load tiles of dY and Z in the matmul's K loop and multiply them
#    there, so dZ is never written. Why is that harder for dW, whose K loop runs over rows of dZ?
