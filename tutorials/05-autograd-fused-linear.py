r"""
Autograd: a fused linear layer that trains
==========================================

We take chapter 04's matrix multiplication, teach PyTorch's autograd to differentiate it,
and build from it a linear layer with the bias and the activation fused into the kernel:
``linear(x, weight, bias, activation)`` and a drop-in ``FusedLinear`` module. We register
it as a custom operator so that ``torch.compile`` can take a whole model that uses it, and
we train a small network with it next to the same network in plain PyTorch.

What you will learn:

* how a ``torch.autograd.Function`` pairs a forward kernel with its backward, and why the
  backward of a matrix product is two more matrix products with the *same* kernel, on
  transposed operands that are read through their strides, not copied (fp32 on Hopper is
  the exception);
* the backward of a fused activation, dZ = dY * act'(Z), as a small element-wise kernel that
  also sums the bias gradient;
* what the backward needs from the forward: keep the pre-activation Z or recompute it, and
  what each choice costs in memory and time;
* ``torch.library.custom_op`` with ``register_fake`` and ``register_autograd``, which make a
  Triton kernel an operator that ``torch.compile(fullgraph=True)`` accepts;
* how to check a layer against ``nn.Linear`` and a training run against plain PyTorch.

Prerequisites: chapter 04 (matrix multiplication), whose ``matmul`` we reuse as it is.
"""

# %%
# Setup
# -----
# ``kit.load_chapter("04")`` imports chapter 04 as a module, quietly: its kernels and
# wrappers are defined, its benchmarks, plots and slow checks are skipped (they ran when
# chapter 04 ran; on a GPU they compile kernels for over three minutes). We take one function
# from it:
# ``matmul(a, b, activation=None, *, bias=None, return_preactivation=False)``, which
# computes ``activation(a @ b + bias)`` for a (M, K) and b (K, N) of any strides, in fp16,
# bf16 or fp32 (as tf32 on a GPU) with fp32 accumulation, and can also return the
# pre-activation ``a @ b + bias`` from the same kernel.

import time

import kit
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from torch import nn

kit.announce()
DEVICE = kit.DEVICE
matmul_chapter = kit.load_chapter("04")
matmul = matmul_chapter.matmul
# On a GPU, the checks below pin matmul to one config per dtype (chapter 04's check configs):
# autotuning each of their dozens of small shape and activation variants would take minutes.
CHECK_CONFIGS = kit.choose(gpu=matmul_chapter.CHECK_CONFIGS, cpu=None)
# sphinx_gallery_thumbnail_number = 2

# %%
# The backward of a matrix product
# --------------------------------
# Autograd runs a network backwards: for each operation it receives the gradient of the loss
# with respect to the operation's output and must return the gradients with respect to its
# inputs. For C = A B, with A of shape (M, K) and B of shape (K, N), and dC = dLoss/dC of
# shape (M, N), the chain rule gives two matrix products::
#
#     dA = dC  @ B^T      (M, N) @ (N, K) -> (M, K)
#     dB = A^T @ dC       (K, M) @ (M, N) -> (K, N)
#
# Each costs as much as the forward, 2 M N K floating-point operations, so a training step
# does three times the work of the forward alone.
#
# Both are products of the kind our kernel computes, with a transposed operand. A transpose
# moves no data in PyTorch: ``b.mT`` is a *view* of the same memory with the two strides
# swapped, element (i, j) at ``b.data_ptr() + i * stride(0) + j * stride(1)``. Chapter 04's
# kernel builds its tile pointers from the strides, so it reads B^T straight out of B; a
# ``.contiguous()`` copy would cost a pass over the matrix and as much memory again.
#
# One exception, from chapter 04: fp32 on Hopper. Its tf32 tensor-core instruction reads
# shared-memory operands K-major only (A row-major, B column-major), so before the descriptor
# kernel ``matmul`` copies an fp32 operand that is stored the other way, view or not. fp16 and
# bf16 take either order, and the portable kernel (every other GPU, and on Hopper the products
# with fewer 128 x 128 output tiles than SMs) reads any strides as given.
#
# ``torch.autograd.Function`` is how we hand autograd a forward and its backward.
# ``forward`` runs the kernel and saves what the backward will need with
# ``ctx.save_for_backward``; ``backward`` gets dC and returns one gradient per input of
# ``forward``, or ``None`` where ``ctx.needs_input_grad`` says nobody asked for it.


class Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return matmul(a, b)

    @staticmethod
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = matmul(grad_c, b.mT)  # B^T: a view, same memory, strides swapped
        if ctx.needs_input_grad[1]:
            grad_b = matmul(a.mT, grad_c)  # A^T: likewise
        return grad_a, grad_b


def matmul_with_grad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with chapter 04's kernel, differentiable."""
    return Matmul.apply(a, b)


# %%
# We check the gradients against PyTorch's own ``a @ b``, and we watch what reaches the
# kernel: for the duration of the check, the name ``matmul`` points to a wrapper that notes
# each operand's address, strides and whether it is contiguous before calling the kernel.
# The transposed operands of the backward arrive with the address of the tensor they view
# and swapped strides: no copy was made. These products are small, so even on an H100 they
# take the portable kernel, which gets the views unchanged; a large fp32 product there would be
# copied inside ``matmul``, past the point where we watch.
#
# Tolerances: fp32 is tf32 on a GPU (10 bits of mantissa, like fp16), so there fp32 and fp16
# get the same 1e-2; under the interpreter fp32 is exact fp32 and we ask for 1e-4. bf16 has
# 3 bits fewer than fp16 and gets 4e-2. Each is relative to the element and, for the absolute
# part, to the largest element of the tensor: a gradient such as dW sums over every row, so
# its elements reach 10 or more, and an element near 0 is the difference of such sums and
# carries their rounding (on the H100, dW in bf16 was off by 0.054 where the sums were about
# 16, against 0.04 allowed by a fixed absolute tolerance).


def tolerance(dtype: torch.dtype, expected: torch.Tensor | None = None) -> dict:
    if dtype == torch.float32 and kit.INTERPRET:
        unit = 1e-4
    elif dtype == torch.bfloat16:
        unit = 4e-2
    else:
        unit = 1e-2
    scale = 1.0 if expected is None else max(1.0, expected.abs().max().item())
    return {"rtol": unit, "atol": unit * scale}


def recording(kernel, calls):
    """``kernel``, noting the address, strides and contiguity of a and b at each call."""

    def record_then_call(a, b, *args, **kwargs):
        calls.append([(t.data_ptr(), t.stride(), t.is_contiguous()) for t in (a, b)])
        return kernel(a, b, *args, **kwargs)

    return record_then_call


kernel_matmul, seen = matmul, []
matmul = recording(kernel_matmul, seen)  # until the check below is done
torch.manual_seed(0)
a = torch.randn(67, 45, device=DEVICE, requires_grad=True)
b = torch.randn(45, 83, device=DEVICE, requires_grad=True)
grad_c = torch.randn(67, 83, device=DEVICE)
grad_a, grad_b = torch.autograd.grad(matmul_with_grad(a, b), (a, b), grad_c)
matmul = kernel_matmul

expected_a, expected_b = torch.autograd.grad(a @ b, (a, b), grad_c)
torch.testing.assert_close(grad_a, expected_a, **tolerance(torch.float32))
torch.testing.assert_close(grad_b, expected_b, **tolerance(torch.float32))
(_, forward_b), (_, b_transposed), (a_transposed, _) = seen
assert b_transposed[0] == b.data_ptr() and not b_transposed[2]
assert a_transposed[0] == a.data_ptr() and not a_transposed[2]
print(f"B in the forward:   strides {forward_b[1]}, contiguous: {forward_b[2]}")
print(f"B^T in dA = dC B^T: strides {b_transposed[1]}, same address as B: True")
print(f"A^T in dB = A^T dC: strides {a_transposed[1]}, same address as A: True")

# %%
# A fused linear layer
# --------------------
# A linear layer with an activation computes, for x of shape (..., in_features) flattened
# to X of shape (M, K) and a weight W of shape (N, K) as ``nn.Linear`` stores it::
#
#     Z = X @ W^T + b        the pre-activation, (M, N)
#     Y = act(Z)
#
# In eager PyTorch that is two kernels: cuBLAS writes Z to memory, and the activation reads
# it back and writes Y. Chapter 04's kernel applies bias and activation to its fp32
# accumulator before the one store, so Z never leaves the chip. The backward, with the
# chain rule through the activation::
#
#     dZ = dY * act'(Z)      element-wise
#     dX = dZ @ W            (M, N) @ (N, K)
#     dW = dZ^T @ X          (N, M) @ (M, K)
#     db = dZ summed over the M rows
#
# W^T in the forward and dZ^T in the backward are views again. In fp32 on Hopper only the
# forward reads them as they are (X row-major and W^T column-major are both K-major): for
# dX = dZ W ``matmul`` copies W, and for dW = dZ^T X it copies dZ^T and X. The benchmark
# below shows what that costs.
#
# The backward needs act'(Z), so it needs Z, which the forward computed and, in its fused
# form, did not store. There are two ways to get it:
#
# * **keep**: the forward also stores Z (``return_preactivation=True``: one extra M x N write
#   from the same kernel), and Z stays in memory until the backward;
# * **recompute**: the backward runs the forward product once more, ``X @ W^T + b``, without
#   the activation: no extra memory, one more matrix product (a third more work).
#
# PyTorch's own ``nn.Linear`` followed by ``F.gelu`` keeps Z too (GELU saves its input). We
# keep it by default, since a matrix product costs far more time than Z costs memory, and
# offer ``recompute=True`` for when memory is what runs out; we measure both below. When no
# gradient is needed (inference, ``torch.no_grad()``) we store neither.
#
# The dZ kernel
# -------------
# dZ = dY * act'(Z) is element-wise and memory bound: it reads dY and Z and writes dZ. The
# derivative comes from ``kit.activation_derivative``, the counterpart of the
# ``kit.apply_activation`` that chapter 04's epilogue calls. The bias gradient is the sum of
# dZ over rows, and this kernel already holds tiles of dZ in registers, so each program also
# sums its tile's columns and writes one row of partial sums; a small ``sum`` over those rows
# (one per BLOCK_M rows of dZ) finishes db. We avoid atomics on purpose: the order of the
# additions is then fixed, and db is the same on every run.
#
# dY may come in with any strides (the gradient of ``y.sum()`` is a broadcast tensor whose
# strides are all zero), so the kernel reads it through its strides, like the matmul does.


@triton.jit
def activation_backward_kernel(
    grad_y_ptr, z_ptr, grad_z_ptr, bias_partial_ptr,
    M, N,
    stride_grad_y_m, stride_grad_y_n, stride_z_m, stride_z_n,
    ACTIVATION: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    block_m = tl.program_id(axis=0)
    rows = block_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.program_id(axis=1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (columns[None, :] < N)
    grad_y_ptrs = (
        grad_y_ptr
        + rows[:, None] * stride_grad_y_m
        + columns[None, :] * stride_grad_y_n
    )
    z_ptrs = z_ptr + rows[:, None] * stride_z_m + columns[None, :] * stride_z_n
    # fp32 arithmetic whatever the storage dtype (and bf16 must be converted first anyway).
    grad_y = tl.load(grad_y_ptrs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    grad_z = grad_y * kit.activation_derivative(z, ACTIVATION)
    grad_z_ptrs = grad_z_ptr + rows[:, None] * N + columns[None, :]
    tl.store(grad_z_ptrs, grad_z.to(grad_z_ptr.dtype.element_ty), mask=mask)
    if BIAS_GRAD:  # masked lanes hold dY = 0, so they add nothing to the column sums
        partial_ptrs = bias_partial_ptr + block_m * N + columns
        tl.store(partial_ptrs, tl.sum(grad_z, axis=0), mask=columns < N)


ACTIVATION_BACKWARD_BLOCK = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}


def activation_backward(grad_y, z, activation, bias_grad: bool):
    """dZ = dY * act'(Z) (contiguous, in Z's dtype) and, if asked, db in fp32."""
    M, N = z.shape
    grad_z = torch.empty((M, N), device=z.device, dtype=z.dtype)
    blocks_m = triton.cdiv(M, ACTIVATION_BACKWARD_BLOCK["BLOCK_M"])
    partial = torch.empty((blocks_m, N), device=z.device, dtype=torch.float32)
    if grad_z.numel() > 0:
        grid = (blocks_m, triton.cdiv(N, ACTIVATION_BACKWARD_BLOCK["BLOCK_N"]))
        activation_backward_kernel[grid](
            grad_y, z, grad_z, partial, M, N,
            grad_y.stride(0), grad_y.stride(1), z.stride(0), z.stride(1),
            ACTIVATION=activation, BIAS_GRAD=bias_grad, **ACTIVATION_BACKWARD_BLOCK,
        )  # fmt: skip
    return grad_z, (partial.sum(dim=0) if bias_grad else None)


# %%
# Forward and backward as plain functions
# ---------------------------------------
# These two functions are the whole layer; the next sections only tell PyTorch about them.
# Both take the flattened X of shape (M, K). The forward returns Y and, when it keeps it, Z
# (otherwise an empty tensor). The backward computes only the gradients that are asked for:
# the first layer of a network needs no dX, since nobody differentiates with respect to the
# data, which saves one of its three products. A gradient that is not needed comes back as
# an empty tensor.


def fused_linear_forward(x, weight, bias, activation, keep_preactivation):
    if activation is not None and keep_preactivation:
        return matmul(x, weight.mT, activation, bias=bias, return_preactivation=True)
    return matmul(x, weight.mT, activation, bias=bias), x.new_empty(0)


def fused_linear_backward(grad_y, x, weight, bias, z, activation, needs_grad):
    need_x, need_weight, need_bias = needs_grad
    if activation is None:  # act' = 1: dZ is dY itself
        grad_z = grad_y
        grad_bias = grad_y.sum(dim=0, dtype=torch.float32) if need_bias else None
    else:
        if z is None:  # recompute: the forward product again, without the activation
            z = matmul(x, weight.mT, None, bias=bias)
        grad_z, grad_bias = activation_backward(grad_y, z, activation, need_bias)
    # A gradient not asked for is an empty tensor, a new one each: an operator's outputs may
    # not alias one another.
    return (
        matmul(grad_z, weight) if need_x else x.new_empty(0),
        matmul(grad_z.mT, x) if need_weight else x.new_empty(0),  # dZ^T: a view
        grad_bias.to(x.dtype) if need_bias else x.new_empty(0),
    )


# %%
# A custom operator
# -----------------
# We could wrap these two functions in a ``torch.autograd.Function`` as we did for the
# matmul, and eager PyTorch would be happy. ``torch.compile`` would not: it traces Python to
# build a graph, and our wrappers are Python that Triton's launcher, the autotuner and the
# input checks make hard to trace. ``torch.library.custom_op`` turns a function into an
# operator, ``torch.ops.tutorials.fused_linear``, that the compiler treats as one opaque node
# in its graph. It needs three things from us:
#
# * the implementation, the decorated function itself; its type annotations become the
#   operator's schema (``Tensor? bias`` for an optional tensor, ``str? activation``);
# * a *fake* implementation, ``register_fake``: given tensors that have shapes, dtypes and
#   devices but no data, it returns outputs with the right metadata, so the compiler can
#   trace through the operator without running it;
# * the derivative, ``register_autograd``: ``setup_context`` saves what the backward needs
#   (the same ``ctx`` as in an ``autograd.Function``) and ``backward`` returns one gradient
#   per input. Our backward calls a second custom operator, so that the backward graph is
#   opaque to the compiler too.
#
# Operators must not return an input or a view of one, and must say which inputs they
# modify (``mutates_args=()``: none). Registering the same name again, as happens when this
# script runs twice in one process, replaces the operator.


@torch.library.custom_op("tutorials::fused_linear", mutates_args=())
def fused_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    keep_preactivation: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_linear_forward(x, weight, bias, activation, keep_preactivation)


@fused_linear_op.register_fake
def _(x, weight, bias, activation, keep_preactivation):
    y = x.new_empty((x.shape[0], weight.shape[0]))
    keeps = activation is not None and keep_preactivation
    return y, (torch.empty_like(y) if keeps else x.new_empty(0))


@torch.library.custom_op("tutorials::fused_linear_backward", mutates_args=())
def fused_linear_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None,
    activation: str | None,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_linear_backward(grad_y, x, weight, bias, z, activation, needs_grad)


@fused_linear_backward_op.register_fake
def _(grad_y, x, weight, bias, z, activation, needs_grad):
    need_x, need_weight, need_bias = needs_grad
    return (
        x.new_empty(x.shape if need_x else (0,)),
        x.new_empty(weight.shape if need_weight else (0,)),
        x.new_empty(bias.shape if need_bias else (0,)),
    )


def setup_context(ctx, inputs, output):
    x, weight, bias, activation, keep_preactivation = inputs
    _, z = output
    keeps = activation is not None and keep_preactivation
    ctx.activation = activation
    ctx.save_for_backward(x, weight, bias, z if keeps else None)
    ctx.set_materialize_grads(False)  # Z's gradient is never used: do not fill one in


def backward(ctx, grad_y, _grad_z):
    x, weight, bias, z = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_x, grad_weight, grad_bias = fused_linear_backward_op(
        grad_y, x, weight, bias, z, ctx.activation, [need_x, need_weight, need_bias]
    )
    return (
        grad_x if need_x else None,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
        None,  # activation: not a tensor
        None,  # keep_preactivation
    )


fused_linear_op.register_autograd(backward, setup_context=setup_context)

# %%
# The layer
# ---------
# ``linear`` is what users call. It checks its inputs (the kernel would read out of bounds
# or answer wrongly otherwise), flattens the leading dimensions of x into rows (a view when
# x is contiguous), and calls the operator. It keeps Z only when a gradient will be asked
# for. ``FusedLinear`` subclasses ``nn.Linear``, so that it has the same parameters, the
# same initialisation and the same ``state_dict``: a model can swap one for the other and
# load the same checkpoint.

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_linear_inputs(x, weight, bias, activation):
    kit.check_tensor(x, "x", SUPPORTED_DTYPES, contiguous=False)
    kit.check_tensor(weight, "weight", SUPPORTED_DTYPES, contiguous=False)
    if weight.dim() != 2 or x.dim() == 0:
        raise ValueError(
            f"weight must be 2-D (out_features, in_features) and x at least 1-D, got "
            f"shapes {tuple(weight.shape)} and {tuple(x.shape)}"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x has {x.shape[-1]} features in its last dimension but weight "
            f"{tuple(weight.shape)} expects in_features = {weight.shape[1]}: pass "
            f"x of shape (..., {weight.shape[1]}), or the transposed weight?"
        )
    if x.dtype != weight.dtype:
        raise TypeError(
            f"x is {x.dtype} but weight is {weight.dtype}: convert one with .to(...)"
        )
    if bias is not None:
        kit.check_tensor(bias, "bias", (weight.dtype,), contiguous=False)
        if bias.shape != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},), one value per output "
                f"feature, got {tuple(bias.shape)}"
            )
    if activation not in kit.ACTIVATIONS:
        raise ValueError(
            f"activation {activation!r} unknown; choose one of {kit.ACTIVATIONS}"
        )


def linear(x, weight, bias=None, activation=None, *, recompute=False):
    """``activation(x @ weight.T + bias)`` in one kernel, differentiable.

    x is (..., in_features), weight (out_features, in_features) as in ``nn.Linear``,
    bias (out_features,) or None, activation one of ``kit.ACTIVATIONS``. The backward
    keeps the pre-activation from the forward, or recomputes it if ``recompute``.
    """
    check_linear_inputs(x, weight, bias, activation)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad
        or weight.requires_grad
        or (bias is not None and bias.requires_grad)
    )
    rows = x.reshape(-1, x.shape[-1])
    y, _ = fused_linear_op(rows, weight, bias, activation, needs_grad and not recompute)
    return y.view(*x.shape[:-1], weight.shape[0])


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
        if activation not in kit.ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r} unknown; choose one of {kit.ACTIVATIONS}"
            )
        self.activation = activation
        self.recompute = recompute

    def forward(self, x):
        return linear(
            x, self.weight, self.bias, self.activation, recompute=self.recompute
        )

    def extra_repr(self):
        return f"{super().extra_repr()}, activation={self.activation}"


def torch_linear(x, weight, bias=None, activation=None):
    """The same layer in plain PyTorch: nn.Linear's function, then the activation."""
    return kit.activation_reference(nn.functional.linear(x, weight, bias), activation)


# %%
# Correctness
# -----------
# The forward and all three gradients against ``nn.functional.linear`` plus the activation,
# differentiated by PyTorch, for every activation, with a 3-D input whose sizes are not
# multiples of any block size. The reference runs in fp32 on the same (rounded) inputs; our
# fp16 results must be within the tolerances above. bf16 is checked on a GPU only, since the
# interpreter cannot multiply bf16 matrices. Each case runs with the pre-activation kept
# and recomputed, and the two must agree exactly: the recomputation is the same kernel on
# the same inputs.


def gradients_match(shape, out_features, dtype, activation, bias=True):
    generator = torch.Generator().manual_seed(0)
    reference = nn.Linear(shape[-1], out_features, bias=bias)  # nn.Linear's init
    x = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    grad_y = torch.randn(*shape[:-1], out_features, generator=generator).to(
        DEVICE, dtype
    )
    params = [p.detach().to(DEVICE, dtype) for p in reference.parameters()]
    results = []
    for recompute in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, *params)]
        y = linear(*leaves, activation=activation, recompute=recompute)
        results.append([y, *torch.autograd.grad(y, leaves, grad_y)])
    leaves = [t.detach().float().requires_grad_() for t in (x, *params)]
    y = torch_linear(*leaves, activation=activation)
    expected = [y, *torch.autograd.grad(y, leaves, grad_y.float())]
    for got, want in zip(results[0], expected, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, **tolerance(dtype, want))
    for kept, recomputed in zip(*results, strict=True):
        assert torch.equal(kept, recomputed)


# On a GPU each (dtype, activation) pair compiles kernels of its own, a few seconds each, so
# there we check every activation in fp16 and GELU alone in bf16 and fp32; the interpreter
# compiles nothing and checks every activation in fp32 and fp16.
cases = [(torch.float16, activation) for activation in kit.ACTIVATIONS] + kit.choose(
    gpu=[(torch.bfloat16, "gelu"), (torch.float32, "gelu")],
    cpu=[(torch.float32, activation) for activation in kit.ACTIVATIONS],
)
matmul_chapter.pin_configs(CHECK_CONFIGS)
for dtype, activation in cases:
    gradients_match((3, 37, 45), 29, dtype, activation)
gradients_match((1, 45), 29, torch.float32, "gelu", bias=False)
matmul_chapter.pin_configs(None)
print(
    "forward and gradients of x, weight and bias match torch for "
    + ", ".join(f"{kit.dtype_name(dtype)} {activation}" for dtype, activation in cases)
)

# %%
# Bad input is refused before any kernel runs:

x = torch.randn(8, 16, device=DEVICE)
weight = torch.randn(4, 16, device=DEVICE)
bad_calls = {
    "features differ": lambda: linear(x, weight.mT),
    "dtypes differ": lambda: linear(x.half(), weight),
    "bias length": lambda: linear(x, weight, torch.zeros(5, device=DEVICE)),
    "activation": lambda: linear(x, weight, activation="tanh"),
    "wrong device": lambda: linear(x.to("meta"), weight.to("meta")),
}
kit.show_refusals("linear()", bad_calls)

# %%
# Keep or recompute: memory and time
# ----------------------------------
# How much memory does keeping Z cost? PyTorch can tell us without a GPU:
# ``torch.autograd.graph.saved_tensors_hooks`` calls a function of ours for every tensor an
# operation saves for its backward. We count the bytes of the distinct tensors that a stack
# of layers saves, for PyTorch's ``nn.Linear`` + GELU, for our layer keeping Z, and for our
# layer recomputing it. The weights are counted too, though they live in memory anyway.


def saved_bytes(layer_fn, x, weights):
    saved = {}

    def pack(tensor):
        saved[(tensor.data_ptr(), tensor.nbytes)] = tensor.nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        for weight, bias in weights:
            x = layer_fn(x, weight, bias)
    return sum(saved.values())


def make_stack(layers, tokens, width, dtype, requires_grad=True):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=generator).to(DEVICE, dtype)
    weights = [
        [
            (torch.randn(shape, generator=generator) / width**0.5)
            .to(DEVICE, dtype)
            .requires_grad_(requires_grad)
            for shape in ((width, width), (width,))
        ]
        for _ in range(layers)
    ]
    return x.requires_grad_(requires_grad), weights


STACK = dict(
    layers=4, tokens=kit.choose(gpu=8192, cpu=64), width=kit.choose(gpu=4096, cpu=32)
)
STACK_DTYPE = torch.float16
strategies = {
    "torch (nn.Linear + GELU)": lambda x, w, b: torch_linear(x, w, b, "gelu"),
    "fused, keep Z (default)": lambda x, w, b: linear(x, w, b, "gelu"),
    "fused, recompute Z": lambda x, w, b: linear(x, w, b, "gelu", recompute=True),
}
activation_bytes = STACK["tokens"] * STACK["width"] * STACK_DTYPE.itemsize
print(
    f"{STACK['layers']} layers of {STACK['width']} features, {STACK['tokens']} tokens, "
    f"fp16; one activation (tokens x width) = {activation_bytes / 2**20:.2f} MiB"
)
print("saved for the backward, in activations (tokens x width):")
for name, layer_fn in strategies.items():
    saved = saved_bytes(layer_fn, *make_stack(**STACK, dtype=STACK_DTYPE))
    print(f"  {name:<26} {saved / activation_bytes:5.1f}")

# %%
# Per layer PyTorch saves X (for dW), W (for dX) and Z (GELU saves its input); our kept
# layer saves the same three, and the recomputing one only X and W. Each weight here is half
# an activation (width x width against tokens x width): 2.5 activations per layer against
# 1.5. Without the weights, which are in memory anyway, recomputing saves half the bytes.
#
# On a GPU we also measure the peak memory of a forward and backward through the stack
# (``torch.cuda.max_memory_allocated``, above what the inputs and weights already take) and
# the GPU time of one step (``kit.measure_ms``: do_bench on CUDA-graph replays).


def peak_and_time(layer_fn):
    x, weights = make_stack(**STACK, dtype=STACK_DTYPE)
    leaves = [x, *(p for pair in weights for p in pair)]

    def step():
        y = x
        for weight, bias in weights:
            y = layer_fn(y, weight, bias)
        return torch.autograd.grad(y, leaves, torch.ones_like(y))

    step()  # compile, autotune
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return peak, kit.measure_ms(step)[0]


if kit.ON_GPU:
    print(f"{'':<26} {'peak memory':>12} {'time':>9}")
    for name, layer_fn in strategies.items():
        peak, ms = peak_and_time(layer_fn)
        print(f"  {name:<24} {peak / 2**20:>8,.0f} MiB {ms:>6.2f} ms")
else:
    print("The peak-memory and time table is measured on a GPU only.")

# %%
# On the H100 (fp16, 4 layers of 4,096 features, 8,192 tokens, one activation 64 MiB) the
# table read::
#
#     torch (nn.Linear + GELU)      804 MiB   5.62 ms
#     fused, keep Z (default)       736 MiB   5.84 ms
#     fused, recompute Z            576 MiB   7.50 ms
#
# Keeping Z, our stack peaks 68 MiB (about one activation) below PyTorch's, which we have not
# traced to a tensor, and takes 4% longer, about the gap of the benchmark below. Recomputing Z
# lowers the peak by another 160 MiB (2.5 activations, 22%) and costs 1.66 ms more (28%): one
# more product per layer, 4 x 275 GFLOP, which puts the recomputations at about 660 TFLOP/s,
# close to a plain product's rate. Unless memory is short, keeping Z is the better trade.

# %%
# Training a small network
# ------------------------
# The real test of a backward is training. We fit a three-layer MLP (GELU between the
# layers) to a smooth function of its input, a synthetic regression task, with plain SGD
# and momentum. Two copies of the network start from the same weights: both are built after
# ``torch.manual_seed(0)``, and since ``FusedLinear`` initialises itself exactly as
# ``nn.Linear`` does, their parameters are equal. They see the same batches in the same
# order. Training runs in fp32, on a GPU as tf32 for both (we switch PyTorch's matmuls to
# tf32 for the comparison, as our kernel uses it).

MLP = dict(
    inputs=kit.choose(gpu=64, cpu=8),
    hidden=kit.choose(gpu=512, cpu=32),
    batch=kit.choose(gpu=1024, cpu=32),
    steps=kit.choose(gpu=300, cpu=40),
)


def make_mlp(fused: bool, inputs: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    if fused:
        layers = [
            FusedLinear(inputs, hidden, activation="gelu"),
            FusedLinear(hidden, hidden, activation="gelu"),
            FusedLinear(hidden, 1),
        ]
    else:
        layers = [
            nn.Linear(inputs, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 1),
        ]
    return nn.Sequential(*layers).to(DEVICE)


def make_data(inputs: int, batch: int, steps: int):
    generator = torch.Generator().manual_seed(1)
    projection = torch.randn(inputs, 4, generator=generator) / inputs**0.5
    x = torch.randn(steps, batch, inputs, generator=generator)
    y = torch.sin(x @ projection).sum(dim=-1, keepdim=True)  # a smooth target
    return x.to(DEVICE), y.to(DEVICE)


def train(model, data) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, target in zip(*data, strict=True):
        loss = nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


matmul_chapter.pin_configs(CHECK_CONFIGS)  # small products, many shapes: no tuning
fused_mlp = make_mlp(True, MLP["inputs"], MLP["hidden"])
torch_mlp = make_mlp(False, MLP["inputs"], MLP["hidden"])
for ours, theirs in zip(fused_mlp.parameters(), torch_mlp.parameters(), strict=True):
    assert torch.equal(ours, theirs)
print(fused_mlp)

data = make_data(MLP["inputs"], MLP["batch"], MLP["steps"])
precision_before = torch.get_float32_matmul_precision()
torch.set_float32_matmul_precision("high")  # tf32 for PyTorch's fp32 matmuls on a GPU
started = time.perf_counter()
fused_losses = train(fused_mlp, data)
fused_seconds = time.perf_counter() - started
torch_losses = train(torch_mlp, data)
torch.set_float32_matmul_precision(precision_before)

# %%
# The two loss curves must agree step by step. The only differences between the runs are
# rounding: the order in which the kernels add up products, and on a GPU tf32's rounding of
# the inputs. We allow a relative difference of 1e-4 per step under the interpreter, where
# both sides compute in exact fp32, and 3e-2 on a GPU, where tf32 differences grow a little
# with each step of training.

differences = [abs(a - b) / b for a, b in zip(fused_losses, torch_losses, strict=True)]
loss_tolerance = kit.choose(gpu=3e-2, cpu=1e-4)
fig, ax = plt.subplots(figsize=(6.2, 3.6))
ax.plot(torch_losses, label="PyTorch (nn.Linear + nn.GELU)", color="tab:red", lw=3)
ax.plot(fused_losses, label="FusedLinear (Triton)", color="tab:blue", lw=1.2)
ax.set(yscale="log", xlabel="step", ylabel="training loss (MSE)")
ax.set_title(
    f"MLP {MLP['inputs']}-{MLP['hidden']}-{MLP['hidden']}-1, batch {MLP['batch']}, "
    f"fp32: largest relative difference {max(differences):.1e}",
    fontsize=9,
)
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
print(
    f"{MLP['steps']} steps: loss {torch_losses[0]:.4f} -> {torch_losses[-1]:.4f} (torch), "
    f"{fused_losses[-1]:.4f} (fused); largest relative difference {max(differences):.2e} "
    f"(tolerance {loss_tolerance:.0e}); fused training took {fused_seconds:.1f} s"
)
first, last = (sum(losses) / 10 for losses in (torch_losses[:10], torch_losses[-10:]))
assert last < 0.5 * first, (
    f"the network did not learn: mean loss {first:.3f} -> {last:.3f}"
)
assert max(differences) <= loss_tolerance

# %%
# On the H100, 300 steps took PyTorch's loss from 2.2645 to 0.0486, and ours ended at 0.0490;
# the largest relative difference between the two curves at any step was 9.07e-03, under the
# 3e-02 allowed. The fused run took 4.8 s of wall-clock time (we did not time the PyTorch run
# against it).

# %%
# torch.compile
# -------------
# Because the layer is a registered operator with a fake implementation, ``torch.compile``
# can capture the whole network as one graph (``fullgraph=True`` makes any break an error):
# the compiler sees our operators as opaque nodes and compiles what is around them. On a GPU
# we use the default backend (Inductor). Under the interpreter we use ``aot_eager``, which
# captures and differentiates the graph the same way but runs it eagerly instead of
# generating C++ for the CPU, which would take longer than the rest of this chapter. On the
# H100, compiled with Inductor, the network gave the same gradients as in eager mode.

backend = kit.choose(gpu="inductor", cpu="aot_eager")
compiled_mlp = torch.compile(fused_mlp, fullgraph=True, backend=backend)
x, target = data[0][0], data[1][0]
for model in (fused_mlp, compiled_mlp):
    model.zero_grad()
    nn.functional.mse_loss(model(x), target).backward()
    if model is fused_mlp:
        eager_grads = [p.grad.clone() for p in model.parameters()]
for eager_grad, p in zip(eager_grads, fused_mlp.parameters(), strict=True):
    torch.testing.assert_close(p.grad, eager_grad, rtol=1e-5, atol=1e-6)
print(f"torch.compile(fullgraph=True, backend={backend!r}): same gradients as eager")
matmul_chapter.pin_configs(None)  # the benchmarks below autotune

# %%
# Benchmark
# ---------
# We time one linear layer, forward and forward plus backward, against ``nn.Linear``
# followed by the activation in eager PyTorch (cuBLAS, then an element-wise kernel) and
# against ``torch.compile`` of the same function (which hands the product to cuBLAS and
# fuses bias and activation into one generated kernel after it). 4,096 tokens, 4,096
# output features, and in_features K from 1,024 to 8,192 on the x axis; GELU, the most
# expensive of the activations. fp32 runs as tf32 for every provider (we call
# ``torch.set_float32_matmul_precision("high")`` for the benchmark).
#
# We count FLOPs, not bytes: 2 M N K for the forward, three times that for the forward and
# backward (dX and dW are products of the same size), whatever a provider does beyond that.
# The recomputing variant does a fourth product in the backward, which shows as a lower
# rate. The forward runs with tensors that need no gradient, so nobody stores Z; the
# forward and backward asks for the gradients of x, W and b with ``torch.autograd.grad``.

TOKENS = kit.choose(gpu=4096, cpu=32)
OUT_FEATURES = kit.choose(gpu=4096, cpu=32)
_compiled = {}


# Every case compiles the same Python function, and torch.compile keeps at most 8 compiled
# versions of one function (``recompile_limit``) before it falls back to eager PyTorch without
# an error. Our 26 cases (dtypes, sizes, activations, with and without gradients) need more.
torch._dynamo.config.recompile_limit = 64


def compiled_torch_linear(activation, backward):
    if (activation, backward) not in _compiled:  # one compiled function per case
        _compiled[activation, backward] = torch.compile(
            lambda x, w, b: torch_linear(x, w, b, activation)
        )
    return _compiled[activation, backward]


def make_linear(provider, in_features, dtype, activation="gelu", backward=False):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, in_features, generator=generator).to(DEVICE, dtype)
    weight = (
        torch.randn(OUT_FEATURES, in_features, generator=generator) / in_features**0.5
    )
    weight, bias = weight.to(DEVICE, dtype), torch.zeros(OUT_FEATURES).to(DEVICE, dtype)
    leaves = [t.requires_grad_(backward) for t in (x, weight, bias)]
    fn = {
        "triton": lambda: linear(x, weight, bias, activation),
        "triton (recompute)": lambda: linear(
            x, weight, bias, activation, recompute=True
        ),
        "torch": lambda: torch_linear(x, weight, bias, activation),
        "torch.compile": lambda: compiled_torch_linear(activation, backward)(
            x, weight, bias
        ),
    }[provider]
    if not backward:
        return fn
    grad_y = torch.randn(TOKENS, OUT_FEATURES, generator=generator).to(DEVICE, dtype)
    return lambda: torch.autograd.grad(fn(), leaves, grad_y)


def linear_flops(passes, in_features=None):
    """FLOPs of ``passes`` products of (TOKENS, K) by (K, OUT_FEATURES); K is x unless given."""

    def work(x, dtype):
        return passes * 2 * TOKENS * OUT_FEATURES * (in_features or x)

    return work


torch.set_float32_matmul_precision("high")
linear_forward = kit.Benchmark(
    name="fused-linear-forward",
    x_name="in_features K (M = N = 4096, GELU)",
    x_values=[1024, 2048, 4096, 8192],
    providers=["triton", "torch", "torch.compile"],
    make=make_linear,
    work=linear_flops(1),
    unit="TFLOP/s",
    dtypes=(torch.float16, torch.float32),
    smoke_x=32,
    headline_x=4096,
)
kit.run(linear_forward)

# %%
# What the H100 recording shows (TFLOP/s; triton / torch / torch.compile):
#
# * fp16: 382 / 413 / 412 at K = 1,024, 595 / 614 / 642 at 4,096, 632 / 643 / 641 at 8,192.
#   The fused layer runs at 92% of eager PyTorch at K = 1,024 and at 95% to 98% from 2,048 up
#   (514 against 542 at 2,048). Saving Z's round trip through memory did not make up for what
#   GELU costs in our epilogue; the comparison of activations below shows how much that is.
# * fp32 (tf32): 188 / 239 / 232 at K = 1,024, 248 / 336 / 333 at 4,096, 264 / 341 / 344 at
#   8,192: 74% to 79% of eager. Fusion is not the cause. The forward's operands, X row-major
#   and W^T column-major, are both K-major and are not copied, and chapter 04's operand-order
#   experiment measured the bare product in this order at 258 TFLOP/s against 363 for cuBLAS
#   at 4,096³ (71%): our tf32 kernel is that far behind cuBLAS's.
# * ``torch.compile`` stays within 5% of eager PyTorch at every point (642 against 614 in fp16
#   at 4,096).

# %%
# Forward and backward:


def make_linear_backward(provider, in_features, dtype):
    return make_linear(provider, in_features, dtype, backward=True)


linear_backward = kit.Benchmark(
    name="fused-linear-forward-backward",
    x_name="in_features K (M = N = 4096, GELU)",
    x_values=[1024, 2048, 4096, 8192],
    providers=["triton", "triton (recompute)", "torch", "torch.compile"],
    make=make_linear_backward,
    work=linear_flops(3),
    unit="TFLOP/s",
    dtypes=(torch.float16, torch.float32),
    smoke_x=32,
    headline_x=4096,
)
kit.run(linear_backward)

# %%
# What the H100 recording shows (TFLOP/s, three products counted; triton / triton
# (recompute) / torch / torch.compile):
#
# * fp16: 407 / 338 / 429 / 448 at K = 1,024, 564 / 448 / 596 / 604 at 4,096, 600 / 449 /
#   618 / 621 at 8,192. Keeping Z, we run at 95% to 97% of eager PyTorch at every K (514
#   against 535 at 2,048).
# * Recomputing Z does a fourth product that the count leaves out, so its rate is lower: 448
#   against 564 at K = 4,096 in fp16, 75% to 83% of the keeping variant across K, where a
#   fourth product as costly as the other three would give 75%. What it buys is memory: 576
#   against 736 MiB in the stack above.
# * fp32: 135 / 115 / 204 / 211 at K = 1,024, 194 / 158 / 281 / 285 at 4,096, 211 / 170 /
#   280 / 288 at 8,192: 66% to 75% of eager, below the forward's 74% to 79%. On top of our tf32
#   kernel's gap to cuBLAS, the backward's operands are not K-major, so ``matmul`` copies W
#   for dX = dZ W and both dZ^T and X for dW = dZ^T X, one pass over each. In chapter 04's
#   operand-order experiment at 4,096³, ``matmul`` ran dX's order (both row-major) at 209
#   TFLOP/s and dW's (A column-major, B row-major) at 173, against 258 for the forward's
#   order. Without the copies it was much worse: the first recording of this benchmark, made
#   before they existed, measured 66 TFLOP/s against PyTorch's 280 at K = 4,096 (its CSV is
#   kept as ``results/.../experiments/fused-linear-forward-backward-before-k-major-copy.csv``).
# * ``torch.compile`` runs 0.5% to 4.5% above eager PyTorch at every point, in both dtypes
#   (604 against 596 in fp16 at 4,096).

# %%
# Every activation
# ----------------
# The same comparison at K = 4,096 in fp16, one point per activation, numbered as in
# ``kit.ACTIVATIONS``: 0 none, 1 relu, 2 leaky_relu, 3 gelu, 4 squared_relu. First the
# forward, then the forward and backward.

ACTIVATION_AXIS = "activation (0 none, 1 relu, 2 leaky_relu, 3 gelu, 4 squared_relu)"
ACTIVATION_K = kit.choose(gpu=4096, cpu=32)


def make_activation_case(backward):
    def make(provider, index, dtype):
        activation = kit.ACTIVATIONS[int(index)]
        return make_linear(provider, ACTIVATION_K, dtype, activation, backward)

    return make


for backward in (False, True):
    kit.run(
        kit.Benchmark(
            name="fused-linear-activations" + ("-forward-backward" if backward else ""),
            x_name=ACTIVATION_AXIS,
            x_values=list(range(len(kit.ACTIVATIONS))),
            providers=["triton", "torch", "torch.compile"],
            make=make_activation_case(backward),
            work=linear_flops(3 if backward else 1, in_features=ACTIVATION_K),
            unit="TFLOP/s",
            dtypes=(torch.float16,),
            smoke_x=3,
            x_log2=False,
        )
    )
torch.set_float32_matmul_precision(precision_before)

# %%
# What the H100 recording shows (fp16, K = 4,096, TFLOP/s; triton / torch / torch.compile,
# then triton against eager torch):
#
# * forward: none 674 / 688 / 695 (0.98x), relu 662 / 628 / 628 (1.05x), leaky_relu
#   666 / 657 / 631 (1.01x), gelu 599 / 609 / 603 (0.98x), squared_relu 663 / 587 / 622
#   (1.13x);
# * forward and backward: none 635 / 653 / 640 (0.97x), relu 629 / 633 / 637 (0.99x),
#   leaky_relu 609 / 613 / 613 (0.99x), gelu 602 / 600 / 656 (1.00x), squared_relu
#   677 / 504 / 621 (1.34x).
#
# In time, one forward product of 4,096³ (137 GFLOP) takes our kernel 204 µs without an
# activation, 206 to 208 µs with relu, leaky_relu or squared_relu, and 230 µs with GELU. The
# cheap activations are a few instructions per element in the epilogue and nearly free, while
# eager PyTorch runs separate element-wise kernels after cuBLAS's 200 µs (9 to 34 µs more).
# That is where fusion wins: 1.05x for relu, 1.13x for squared ReLU, which PyTorch computes
# as ``relu`` then ``square``, and 1.34x for squared ReLU's forward and backward, where
# PyTorch differentiates ``square`` and ``relu`` one after the other and we run one dZ kernel.
# GELU is the exact form, an ``erf`` per element in fp32, and it adds 26 µs to our kernel, as
# much as PyTorch's separate GELU kernel adds (200 to 226 µs). Our persistent kernel issues the
# loads of a program's next tile only after the current tile's epilogue, so the epilogue is
# not overlapped with the next main loop, and its cost adds to the product's. (Chapter 04's
# ``FLATTEN`` switch, which lets the compiler pipeline across tiles, did not settle this in a
# separate measurement: with GELU it was 4% slower at 4,096³ and 4% faster at 8,192³.)
#
# The same case measured twice differs by more than some of these gaps: fp16 GELU forward and
# backward at K = 4,096 is 602 here and 564 in the sweep above (torch 600 and 596,
# torch.compile 656 and 604). Read a few percent either way as noise.
#
# Against our floors: the forward and backward at 90% of PyTorch's or better is met in fp16
# (95% to 97% from K = 1,024 to 8,192) and missed in fp32 (66% to 75%). The fused forward at
# 1.1x ``nn.Linear`` plus the activation in eager mode, for K >= 2,048, is missed with GELU,
# the activation of the sweep (0.95x to 0.98x in fp16, 0.74x to 0.79x in fp32); at K = 4,096
# in fp16 only squared ReLU reaches it (1.13x; relu 1.05x, leaky_relu 1.01x).

# %%
# What we learned
# ---------------
# * The backward of a matrix product is two matrix products, dA = dC B^T and dB = A^T dC.
#   With a kernel that takes any strides, the transposes are views: one kernel serves the
#   forward and the whole backward. fp32 on Hopper is the exception: its tf32 instruction
#   needs K-major operands, ``matmul`` copies those of dX and dW, and our fp32 forward and
#   backward reaches 66% to 75% of PyTorch's.
# * Fusing bias and activation into the product's epilogue saves a round trip of Z through
#   memory in the forward. The backward needs act'(Z): keeping Z costs one activation of
#   memory per layer, recomputing it costs a third more arithmetic in the backward. We keep
#   it by default, as PyTorch does: on the H100, four fp16 layers took 736 MiB and 5.84 ms
#   keeping Z, 576 MiB and 7.50 ms recomputing it.
# * Fusion pays when the activation is cheap and eager PyTorch runs extra element-wise
#   kernels for it: squared ReLU at 1.13x in the forward and 1.34x in the forward and
#   backward. The exact GELU costs our epilogue as much as PyTorch's separate kernel
#   (0.95x to 0.98x in the fp16 forward), and in fp32 our tf32 kernel trails cuBLAS's.
# * The bias gradient falls out of the element-wise dZ kernel as column sums, without
#   atomics and so deterministic.
# * ``torch.library.custom_op`` with a fake implementation and a registered autograd formula
#   makes a Triton kernel an operator that ``torch.compile(fullgraph=True)`` captures, and
#   ``torch.library.opcheck`` (in the tests) checks that the registrations agree.
# * A network built from ``FusedLinear`` trains like the same network built from
#   ``nn.Linear``: the loss curves agree to rounding (9.07e-03 at most over 300 steps on the
#   H100).
#
# Exercises
# ---------
# 1. For relu and leaky_relu, act'(Z) can be read off the output: it is 1 where Y > 0.
#    Change the backward to save Y instead of Z for those two. Why does that save memory in
#    a network, where Y is the next layer's input and is saved there anyway?
# 2. Fuse dZ into the dX product: load tiles of dY and Z in the matmul's K loop and
#    multiply them there, so dZ is never written. Why is that harder for dW, whose K loop
#    runs over the rows of dZ?
# 3. Train the MLP in bf16 with fp32 master weights (keep an fp32 copy of the parameters
#    for the optimizer). How far apart do the two loss curves drift now?
