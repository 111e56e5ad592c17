"""ops.layer_norm: the code of chapter 03, Layer normalization: forward, backward, and a lock done
right."""

# Generated from tutorials/03-layer-norm.py by tools/export.py: edit the chapter, then `make
# export`.

import functools
import math

from stepkernels.ops import (
    long_rows,  # chapter 13's kernels, for rows past these limits
)
from stepkernels.runtime.arguments import (  # checks
    layer_norm_arguments,
    reduction_argument,
)
from stepkernels.runtime.core import INTERPRET, refuse_double_backward, sm_count
from stepkernels.runtime.device import profile
from stepkernels.runtime.launch import (  # cheap repeated launches: chapter 08
    bound_launches,
    cdiv,
    layout,
    lean,
    lean_now,
    next_power_of_2,
    plan_cache,
    recorded_launches,
)
from stepkernels.runtime.partials import flush_partials, sum_partials
import torch
import triton
import triton.language as tl


@lean
@triton.jit
def layer_norm_forward_kernel(
    x_ptr,
    y_ptr,
    weight_ptr,
    bias_ptr,
    mean_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Row blocks p, p + grid size, ...: with NUM_STAGES > 1 the next block's loads are
    # issued before this one's arithmetic.
    program_id, grid_size = tl.program_id(axis=0), tl.num_programs(axis=0)
    n_blocks = tl.cdiv(M, ROWS_PER_PROGRAM)
    for block in tl.range(program_id, n_blocks, grid_size, num_stages=NUM_STAGES):
        rows = block * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        cols = tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < M, cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)  # row * stride can pass 2**31
        x_ptrs = x_ptr + rows64[:, None] * x_row_stride + cols[None, :]
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        centered = tl.where(mask, x - mean[:, None], 0.0)  # 0 on masked-off lanes
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
        y = centered * rstd[:, None]
        if HAS_WEIGHT:
            y *= tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y_ptrs = y_ptr + rows64[:, None] * y_row_stride + cols[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORWARD_MAX_BLOCK, SPLIT_CHUNK = 32768, 8192  # longer rows: split in chunks
FORWARD_TILE, FORWARD_SHORT_TILE, FORWARD_SHORT_ROW = 8192, 4096, 2048
FORWARD_PROGRAMS_PER_SM = 8
FORWARD_STAGES = 2  # loads in flight: Triton keeps NUM_STAGES - 1 blocks of them


def stage_bytes() -> int:
    """Shared memory for loads in flight: the device's (runtime/device.py), less 1 KB for
    the reductions' scratch (tools/check_targets.py checks the launches against it)."""
    return profile().shared_memory - 1024


@functools.cache  # once per shape: off the call's path
def forward_config(n_cols, n_rows, block_size=None, itemsize=4, param_bytes=0) -> dict:
    max_block = block_size or FORWARD_MAX_BLOCK  # block_size: a cap, for tests
    block = triton.next_power_of_2(n_cols)
    if block > max_block:  # too long for a program: split over several, chapter 13
        return dict(BLOCK_N=min(max_block, SPLIT_CHUNK), num_warps=4)
    row_bytes = block * itemsize
    if block > FORWARD_SHORT_ROW and row_bytes != 32 * 1024:  # a row a program, no cap
        return dict(
            BLOCK_N=block,
            ROWS_PER_PROGRAM=1,
            NUM_STAGES=1,
            num_warps=8 if row_bytes < 32 * 1024 else 32,
        )
    tile = FORWARD_SHORT_TILE if block <= FORWARD_SHORT_ROW else FORWARD_TILE
    rows = max(1, min(tile // block, triton.next_power_of_2(n_rows)))
    per_stage = rows * block * itemsize + block * param_bytes  # x, weight and bias
    stages = max(1, min(FORWARD_STAGES, 1 + stage_bytes() // per_stage))
    return dict(
        BLOCK_N=block,
        ROWS_PER_PROGRAM=rows,
        NUM_STAGES=stages,
        num_warps=max(1, min(16, rows * block // 1024)),
        programs=FORWARD_PROGRAMS_PER_SM * sm_count(),
    )


def layer_norm_forward(x2d, weight, bias, eps, block_size=None, config=None):
    """y, mean, rstd of a 2-D ``x2d`` with contiguous rows; ``config`` replaces the
    launch rule's choice."""
    (n_rows, n_cols), device = x2d.shape, x2d.device
    y = torch.empty((n_rows, n_cols), device=device, dtype=x2d.dtype)
    mean, rstd = (torch.empty(n_rows, device=device, dtype=torch.float32) for _ in "mr")
    if n_rows == 0:
        return y, mean, rstd
    size = x2d.element_size()
    params = sum(p.element_size() for p in (weight, bias) if p is not None)
    config = dict(config or forward_config(n_cols, n_rows, block_size, size, params))
    tensors = (
        x2d,
        y,
        x2d if weight is None else weight,
        x2d if bias is None else bias,
        mean,
        rstd,
    )
    affine = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    strides = (x2d.stride(0), y.stride(0))
    if config["BLOCK_N"] < next_power_of_2(n_cols):  # a row in chunks: split
        long_rows.split_forward(tensors, strides, affine, n_rows, n_cols, eps, config)
        return y, mean, rstd
    grid = cdiv(n_rows, config["ROWS_PER_PROGRAM"])
    grid = min(grid, config.pop("programs", None) or grid)  # a cap on the grid
    layer_norm_forward_kernel[(grid,)](
        *tensors, *strides, n_rows, n_cols, eps, **affine, **config
    )
    return y, mean, rstd


@lean
@triton.jit
def layer_norm_backward_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    partial_ptr,
    lock_ptr,
    x_row_stride,
    dy_row_stride,
    dx_row_stride,
    M,
    N,
    num_locks,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    REDUCTION: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    program_id = tl.program_id(axis=0)
    first_row = program_id * ROWS_PER_PROGRAM
    slot = program_id % GROUP_SIZE_M if REDUCTION == "lock" else program_id
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    # NUM_STAGES > 1: the next rows' loads are issued before this row's arithmetic
    for i in tl.range(ROWS_PER_PROGRAM, num_stages=NUM_STAGES):
        row = first_row + i
        mask, row64 = cols < tl.where(row < M, N, 0), row.to(tl.int64)
        x = tl.load(x_ptr + row64 * x_row_stride + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        safe_row = tl.minimum(row, M - 1)  # rows past M read row M - 1, add nothing
        mean, rstd = tl.load(mean_ptr + safe_row), tl.load(rstd_ptr + safe_row)
        x_hat, wdy = (x - mean) * rstd, w * dy if HAS_WEIGHT else dy
        c1, c2 = tl.sum(x_hat * wdy, axis=0) / N, tl.sum(wdy, axis=0) / N
        dx = (wdy - (x_hat * c1 + c2)) * rstd
        dx_ptrs = dx_ptr + row64 * dx_row_stride + cols
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw, db = dw + dy * x_hat, db + dy  # masked lanes: dy = 0
    if REDUCTION != "none":
        buffers, slots = (partial_ptr, lock_ptr), (slot, slot, num_locks)
        flush_partials(buffers, (dw, db), (cols, col_mask), N, slots, REDUCTION)


REDUCTIONS = ("two-stage", "lock")
BACKWARD_MAX_BLOCK = 8192  # longer rows are split over programs
BACKWARD_STAGES, BACKWARD_STAGE_BYTES = 4, 96 * 1024  # pipelined loads of x and dy
GROUP_SIZE_M = 64


@functools.cache
def backward_config(n_cols, n_rows, block_size=None, rows_per_program=None, itemsize=4):
    max_block = block_size or BACKWARD_MAX_BLOCK
    block = triton.next_power_of_2(n_cols)
    if block > max_block:  # split (chapter 13): 8 (16-bit) or 4 rows of 1,024 columns
        chunk = min(
            max_block, max(1024, triton.next_power_of_2(triton.cdiv(n_cols, 64)))
        )
        # values a batch: fp32 spills at 8,192, and so does 16-bit in chunks of 4,096
        values = 8192 if itemsize < 4 and chunk <= 2048 else 4096
        batch = max(1, min(values // chunk, triton.next_power_of_2(n_rows)))
        groups = 4 if INTERPRET else 32  # of up to 128 rows; CPU: few
        rows = rows_per_program or triton.next_power_of_2(triton.cdiv(n_rows, groups))
        rows = min(128, max(batch, rows))
        return dict(
            BLOCK_N=chunk,
            ROWS_PER_PROGRAM=rows,
            BATCH=batch if rows % batch == 0 else 1,
            num_warps=4,
        )
    if rows_per_program is None:
        programs = 4 if INTERPRET else max(1, 4096 // block) * sm_count()  # CPU: few
        wanted = triton.cdiv(n_rows, programs)
        rows_per_program = min(64, triton.next_power_of_2(wanted))
    per_stage = 2 * block * itemsize  # a row of x and one of dy
    budget = min(BACKWARD_STAGE_BYTES, stage_bytes())
    stages = max(1, min(BACKWARD_STAGES, budget // per_stage))
    return dict(
        BLOCK_N=block,
        ROWS_PER_PROGRAM=rows_per_program,
        NUM_STAGES=stages,
        num_warps=max(4, min(16, block // 1024)),
    )


def layer_norm_backward(
    dy2d,
    x2d,
    weight,
    mean,
    rstd,
    want_dw=True,
    want_db=True,
    reduction="two-stage",
    group_size_m=None,
    rows_per_program=None,
    block_size=None,
    config=None,
):
    """dx, dW, dB (None unless wanted); ``config`` replaces the launch rule's choice."""
    (n_rows, n_cols), device = x2d.shape, x2d.device
    grad_dtype = x2d.dtype if weight is None else weight.dtype
    dx = torch.empty((n_rows, n_cols), device=device, dtype=x2d.dtype)
    dw, db = (
        torch.empty(n_cols, device=device, dtype=grad_dtype) if wanted else None
        for wanted in (want_dw, want_db)
    )
    if n_rows == 0:  # sums over no rows
        return dx, *(None if grad is None else grad.zero_() for grad in (dw, db))
    size, per_program = x2d.element_size(), rows_per_program
    config = config or backward_config(n_cols, n_rows, block_size, per_program, size)
    n_programs = cdiv(n_rows, config["ROWS_PER_PROGRAM"])  # or groups of rows
    mode = reduction if (want_dw or want_db) else "none"
    group = group_size_m or GROUP_SIZE_M
    num_locks, locks, partials = 0, dx, dx  # "none": never touched
    if mode == "lock":
        partials = torch.empty((group, 2, n_cols), device=device, dtype=torch.float32)
        num_locks = group * cdiv(n_cols, config["BLOCK_N"])
        # locks, then visit counters: the only memory that needs zeroing
        locks = torch.zeros(2 * num_locks, device=device, dtype=torch.int32)
    elif mode == "two-stage":
        shape = (n_programs, 2, n_cols)
        partials = locks = torch.empty(shape, device=device, dtype=torch.float32)
    tensors = (
        x2d,
        dy2d,
        dx,
        x2d if weight is None else weight,
        mean,
        rstd,
        partials,
        locks,
    )
    strides = (x2d.stride(0), dy2d.stride(0), dx.stride(0))
    options = dict(HAS_WEIGHT=weight is not None, REDUCTION=mode, GROUP_SIZE_M=group)
    if config["BLOCK_N"] < next_power_of_2(n_cols):  # a row in chunks: split
        long_rows.split_backward(
            tensors, strides, options, n_rows, n_cols, num_locks, config
        )
    else:
        layer_norm_backward_kernel[(n_programs,)](
            *tensors, *strides, n_rows, n_cols, num_locks, **options, **config
        )
    if mode != "none":  # the second stage (runtime/partials, below)
        sum_partials(
            partials,
            locks[num_locks:],
            dx if dw is None else dw,
            dx if db is None else db,
            n_cols,
            HAS_COUNTS=mode == "lock",
            HAS_DW=want_dw,
            HAS_DB=want_db,
        )
    return dx, dw, db


def is_vector(tensor) -> bool:
    return tensor.dim() == 1 and tensor.stride(0) == 1


def rows_of(tensor, n_cols):
    """A 2-D view of ``tensor`` with contiguous rows; copies only when there is none."""
    if tensor.dim() == 2 and tensor.shape[1] == n_cols and tensor.stride(1) == 1:
        return tensor  # the common case, without a view (a microsecond a call)
    rows = tensor.reshape(-1, n_cols)
    return rows.contiguous() if rows.stride(1) != 1 and n_cols > 1 else rows


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, normalized_shape, eps, reduction, block_size, key, planned
    ):
        if planned is not None:  # a repeated call's bound launch (chapter 08)
            y, x2d, weight, mean, rstd = planned(x, weight, bias)
        else:
            x2d = rows_of(x, math.prod(normalized_shape))
            flat = lambda p: (
                p if p is None or is_vector(p) else p.reshape(-1).contiguous()
            )
            flat_weight, flat_bias = flat(weight), flat(bias)
            with recorded_launches(key is not None) as launches:
                y, mean, rstd = layer_norm_forward(
                    x2d, flat_weight, flat_bias, eps, block_size
                )
            unchanged = x2d is x and flat_weight is weight and flat_bias is bias
            if key is not None and unchanged:
                params = (x if weight is None else weight, x if bias is None else bias)
                bound = bound_launches(launches, (x, y, *params, mean, rstd))
                if bound:
                    FORWARD_PLANS[key] = planned_forward(*bound, len(mean))
            weight, y = flat_weight, y if y.shape == x.shape else y.view(x.shape)
        if ctx is not None:  # None: called without autograd, nothing to save
            ctx.save_for_backward(x2d, weight, mean, rstd)
            ctx.normalized_shape, ctx.has_bias = normalized_shape, bias is not None
            ctx.reduction, ctx.block_size, ctx.key = reduction, block_size, key
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("layer_norm", "torch.nn.functional.layer_norm")
        x2d, weight, mean, rstd = ctx.saved_tensors
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = ctx.has_bias and ctx.needs_input_grad[2]
        key = ctx.key if ctx.key is None or type(dy) is torch.Tensor else None
        if key is not None:  # a repeated call: dy's layout too
            key = (key, layout(dy), want_dw, want_db)
            planned = BACKWARD_PLANS.get(key)
            if planned is not None and lean_now():
                dx, dw, db = planned(x2d, dy, weight, mean, rstd)
                return dx, dw, db, None, None, None, None, None, None
        saved = (x2d, weight, mean, rstd)
        options = dict(reduction=ctx.reduction, block_size=ctx.block_size)
        with recorded_launches(key is not None) as launches:
            dy2d = rows_of(dy, x2d.shape[1])
            dx, dw, db = layer_norm_backward(dy2d, *saved, want_dw, want_db, **options)
        if key is not None and dy2d is dy and ctx.reduction == "two-stage":
            plan_backward(key, launches, saved, dy, dx, dw, db)
        if len(ctx.normalized_shape) > 1:
            dw, db = (
                g if g is None else g.view(ctx.normalized_shape) for g in (dw, db)
            )
        dx = dx if dx.shape == dy.shape else dx.view(dy.shape)
        return dx, dw, db, None, None, None, None, None, None


# A repeated call launches its kernels bound (chapter 08), under a key of all that they
# read from the call: each tensor's layout, and the other arguments as given.
FORWARD_PLANS, BACKWARD_PLANS = plan_cache(), plan_cache()
TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def call_key(x, shape, weight, bias, eps, reduction, block_size) -> tuple | None:
    """What the launches of a ``layer_norm`` call read from it, or None: the call is not
    keyed (traced, or arguments whose value alone does not say they pass the checks)."""
    keyed = type(x) in TENSOR_TYPES and type(eps) is float and block_size is None
    keyed = keyed and (weight is None or type(weight) in TENSOR_TYPES)
    keyed = keyed and (bias is None or type(bias) in TENSOR_TYPES)
    if keyed and type(shape) is not torch.Size and type(shape) is not int:
        keyed = type(shape) is tuple and len(shape) == 1 and type(shape[0]) is int
    if not keyed or torch.compiler.is_compiling() or not lean_now():
        return None
    return layout(x), shape, layout(weight), layout(bias), eps, reduction


def planned_forward(launch, n_rows):
    def forward(x, weight, bias):
        device = x.device
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        mean = torch.empty(n_rows, device=device, dtype=torch.float32)
        rstd = torch.empty(n_rows, device=device, dtype=torch.float32)
        params = (x if weight is None else weight, x if bias is None else bias)
        launch(x, y, *params, mean, rstd)
        return y, x, weight, mean, rstd

    return forward


def plan_backward(key, launches, saved, dy, dx, dw, db):
    """Bind the backward's launches (two-stage: the rows, then the partial sums; without
    dW and dB, the rows alone) for the calls with ``key``."""
    x2d, weight, mean, rstd = saved
    rows = (x2d, dy, dx, x2d if weight is None else weight, mean, rstd)
    if dw is None and db is None:
        bound = bound_launches(launches, (*rows, dx, dx))
    elif len(launches) == 2:
        partials = launches[0][2][6]
        sums = (partials, partials, dx if dw is None else dw, dx if db is None else db)
        bound = bound_launches(launches, (*rows, partials, partials), sums)
    else:
        return
    if not bound:
        return
    shapes = (
        partials.shape if len(bound) == 2 else None,
        dw is not None,
        db is not None,
    )
    BACKWARD_PLANS[key] = planned_backward(
        bound, *shapes, (dw if dw is not None else db)
    )


def planned_backward(bound, partials_shape, want_dw, want_db, like):
    def backward(x2d, dy, weight, mean, rstd):
        device = x2d.device
        dx = torch.empty_like(x2d, memory_format=torch.contiguous_format)
        dw = torch.empty_like(like) if want_dw else None
        db = torch.empty_like(like) if want_db else None
        rows = (x2d, dy, dx, x2d if weight is None else weight, mean, rstd)
        if partials_shape is None:
            bound[0](*rows, dx, dx)
            return dx, dw, db
        partials = torch.empty(partials_shape, device=device, dtype=torch.float32)
        bound[0](*rows, partials, partials)
        bound[1](partials, partials, dx if dw is None else dw, dx if db is None else db)
        return dx, dw, db

    return backward


def layer_norm(
    x,
    normalized_shape,
    weight=None,
    bias=None,
    eps=1e-5,
    *,
    reduction="two-stage",
    block_size=None,
):
    """``torch.nn.functional.layer_norm`` in Triton. ``reduction``: "two-stage" (the
    same bits every run) or "lock"; ``block_size``: a power of two, the most of a row
    loaded at once."""
    given = (x, normalized_shape, weight, bias, eps, reduction, block_size)
    key = call_key(*given)
    planned = None if key is None else FORWARD_PLANS.get(key)
    if planned is not None:  # seen before: checked then
        shape = (
            (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        )
    else:
        shape = layer_norm_arguments(*given, SUPPORTED_DTYPES, REDUCTIONS)  # or raises
    args = (x, weight, bias, shape, float(eps), reduction, block_size)
    # Operators the compiler traces (below); a call is keyed only when not compiling.
    if key is None and torch.compiler.is_compiling():
        return traced_layer_norm(*args)
    args = (*args, key, planned)
    grads = x.requires_grad or (weight is not None and weight.requires_grad)
    grads = grads or (bias is not None and bias.requires_grad)
    if grads and torch.is_grad_enabled():
        return LayerNormFunction.apply(*args)
    return LayerNormFunction.forward(None, *args)  # no autograd: ~15 µs less CPU


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` on these kernels: same arguments, parameters and state
    dict."""

    def __init__(self, *args, reduction="two-stage", **kwargs):
        super().__init__(*args, **kwargs)
        reduction_argument(reduction, REDUCTIONS)  # refused now, not at the first call
        self.reduction = reduction

    def forward(self, x):
        args = (x, self.normalized_shape, self.weight, self.bias, self.eps)
        return layer_norm(*args, reduction=self.reduction)

    def extra_repr(self):
        return f"{super().extra_repr()}, reduction={self.reduction!r}"


from stepkernels.runtime.launch import concrete  # a kernel per shape, as in eager calls
from torch import Tensor
from torch.library import triton_op


@triton_op("stepkernels::layer_norm_forward", mutates_args={})
def layer_norm_forward_op(
    x2d: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return layer_norm_forward(concrete(x2d), weight, bias, eps)  # y, mean, rstd


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
    rows = (concrete(dy2d), concrete(x2d))
    dx, dw, db = layer_norm_backward(*rows, weight, mean, rstd, want_dw, want_db)
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


def traced_layer_norm(x, weight, bias, shape, eps, reduction=None, block_size=None):
    """``layer_norm``, its arguments checked, through the operators above: the launch
    rule's block size, and dW, dB added in two stages (the same bits every run)."""
    x2d = rows_of(x, math.prod(shape))
    flat = lambda p: None if p is None else p.reshape(-1).contiguous()
    y, _, _ = layer_norm_forward_op(x2d, flat(weight), flat(bias), eps)
    return y.view(x.shape)
