"""ops.linear: the code of chapter 05, Autograd: a fused linear layer that trains."""

# Generated from tutorials/05-autograd-fused-linear.py by tools/export.py: edit the chapter, then
# `make export`.

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
