"""ops.matmul: the code of chapter 04, Matrix multiplication at cuBLAS speed."""

# Generated from tutorials/04-matrix-multiplication.py by tools/export.py: edit the chapter, then
# `make export`.

from stepkernels.ops.matmul_hopper import launch_tma, tma_operands
from stepkernels.ops.matmul_tuning import splits_k
from stepkernels.runtime.activations import apply_activation
from stepkernels.runtime.arguments import OPTIONAL_TENSOR_TYPES, accumulate_arguments
from stepkernels.runtime.core import (
    INTERPRET,
    autotune_configs,
    sm_count,
)
from stepkernels.runtime.device import profile
from stepkernels.runtime.launch import (  # cheap repeated launches: chapter 08
    bound_launches,
    cdiv,
    layout,
    lean,
    lean_now,
    plan_cache,
    recorded_launches,
)
from stepkernels.runtime.tiles import (
    add_bias,
    allocate_outputs,
    check_inputs,
    dot_precision,
    keep_configs_for_dtype,
    output_dtype,
    tile_config,
    tile_of_program,
)
import torch
import triton
import triton.language as tl


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    pre_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_bias,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PREACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    ACCUMULATE: tl.constexpr = False,
):
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_of_program(tl.program_id(0), tiles_m, tiles_n, GROUP_SIZE_M)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrap, do not mask: rows past M (columns past N) re-read valid data that we never
    # store.
    rows, columns = offs_m % M, offs_n % N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + columns[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:  # the last K-step hangs over the end: load zeros there
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    acc = add_bias(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS)
    c_offsets = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptr + c_offsets, mask=c_mask, other=0.0).to(tl.float32)
    if STORE_PREACTIVATION:
        tl.store(pre_ptr + c_offsets, acc.to(pre_ptr.dtype.element_ty), mask=c_mask)
    out = apply_activation(acc, ACTIVATION, c_ptr.dtype.element_ty)
    tl.store(c_ptr + c_offsets, out.to(c_ptr.dtype.element_ty), mask=c_mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) by itemsize; the interpreter takes
# the first tile of itemsize 2 for every dtype
PORTABLE_TILES = {
    2: [
        (128, 128, 64, 4, 8),
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 5, 4),
    ],
    1: [
        (128, 256, 128, 3, 8),
        (256, 128, 128, 3, 8),
        (128, 128, 128, 4, 8),
        (64, 128, 128, 4, 4),
    ],
    4: [(128, 128, 32, 3, 8), (128, 64, 32, 4, 4), (64, 64, 32, 4, 4)],
}
PORTABLE_CONFIGS = [
    tile_config(*tile, itemsize=size)
    for size, tiles in PORTABLE_TILES.items()
    for tile in tiles
]


# Tuning launches the kernel again and again: restore_value keeps C for ACCUMULATE.
# lean: cheap repeated launches (chapter 08).
matmul_portable_tuned = lean(
    triton.autotune(
        configs=autotune_configs(PORTABLE_CONFIGS),
        key=["M", "N", "K", "INPUT_PRECISION"],
        restore_value=["c_ptr"],
        prune_configs_by={"early_config_prune": keep_configs_for_dtype},
    )(matmul_kernel)
)


def matmul_portable(
    a, b, activation=None, *, bias=None, return_preactivation=False, config=None
):
    """``activation(a @ b + bias)`` with the portable kernel, autotuned unless
    ``config`` (a dict of BLOCK_M, BLOCK_N, BLOCK_K, GROUP_SIZE_M, num_warps and
    num_stages) is given."""
    check_inputs(a, b, activation, bias)
    return launch_portable(a, b, activation, bias, return_preactivation, config)


def launch_portable(
    a, b, activation, bias, return_preactivation, config=None, accumulate=None
):
    """The portable kernel's launch, for inputs that ``check_inputs`` accepted."""
    out, pre = allocate_outputs(a, b, return_preactivation, accumulate)
    (M, K), N = a.shape, b.shape[1]
    if out.numel() > 0:
        grid = lambda meta: (
            triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),
        )
        kernel = matmul_portable_tuned if config is None else matmul_kernel
        bias_stride = 0 if bias is None else bias.stride(0)
        strides = (*a.stride(), *b.stride(), *out.stride(), bias_stride)
        flags = dict(
            ACTIVATION=activation,
            HAS_BIAS=bias is not None,
            STORE_PREACTIVATION=pre is not None,
            INPUT_PRECISION=dot_precision(a.dtype),
            UPCAST=INTERPRET and a.dtype == torch.bfloat16,
            ACCUMULATE=accumulate is not None,
        )
        kernel[grid](a, b, out, bias, pre, M, N, K, *strides, **flags, **(config or {}))
    return (out, pre) if return_preactivation else out


ON_HOPPER = profile().tma  # NVIDIA's sm_90: runtime/device.py


def fills_the_gpu(M: int, N: int) -> bool:
    """At least one 128 × 128 tile of the M × N output per SM?"""
    return cdiv(M, 128) * cdiv(N, 128) >= sm_count()  # at every call: no triton.cdiv


def on_descriptors(dtype, M: int, N: int, K: int) -> bool:
    """Does ``matmul`` give an M × N × K product in ``dtype`` to chapter 07's kernel?"""
    wide = fills_the_gpu(M, N) or splits_k(M, N, K)
    return ON_HOPPER and (dtype.itemsize == 1 or wide)


def copies_for_tf32(dtype, M: int, N: int, K: int) -> bool:
    """tf32 on chapter 07's kernel, which copies operands that are not K-major?"""
    tf32 = dtype == torch.float32 and dot_precision(dtype) == "tf32"
    return tf32 and on_descriptors(dtype, M, N, K)


def matmul(
    a, b, activation=None, *, bias=None, return_preactivation=False, accumulate=None
):
    """``activation(a @ b + bias)`` for 2-D ``a`` (M, K), ``b`` (K, N) of any strides:
    fp16, bf16, fp32 (exact or tf32 as ``torch.get_float32_matmul_precision()`` says)
    and fp8 e4m3 (bf16 output), accumulated in fp32, bias (N,) and activation applied in
    fp32 before one rounding. ``return_preactivation``: ``(out, a @ b + bias)``, one
    kernel. ``accumulate``: a contiguous (M, N) tensor, in the output's dtype or fp32
    (a parameter's fp32 gradient), that gets ``a @ b (+ bias)`` added in place."""
    fast = accumulate is None and type(a) is torch.Tensor and type(b) is torch.Tensor
    fast = fast and type(bias) in OPTIONAL_TENSOR_TYPES
    fast = fast and type(activation) in (str, NONE)
    fast = fast and type(return_preactivation) is bool
    fast = fast and not torch.compiler.is_compiling() and lean_now()
    if fast:  # a call seen before: checked then, its launch bound
        key = product_key(a, b, activation, bias, return_preactivation, None)
        planned = CHECKED_PRODUCTS.get(key)
        if planned is not None:
            return planned(a, b, bias, None)
    check_inputs(a, b, activation, bias, return_preactivation)
    if torch.compiler.is_compiling():  # an operator the compiler calls (below)
        out, pre = matmul_op(a, b, activation, bias, return_preactivation, accumulate)
        out = out if accumulate is None else accumulate
        return (out, pre) if return_preactivation else out
    result = launch_matmul(a, b, activation, bias, return_preactivation, accumulate)
    if fast and (planned := PRODUCT_PLANS.get(key)) is not None:
        CHECKED_PRODUCTS[key] = planned  # matmul's checks passed for this key
    return result


def launch_matmul(a, b, activation, bias, return_preactivation, accumulate):
    if accumulate is not None:  # its checks read addresses: here, not while traced
        dtypes = (output_dtype(a.dtype), torch.float32)  # fp32: one rounding, not two
        accumulate_arguments(accumulate, a, b, activation, return_preactivation, dtypes)
    return product(a, b, activation, bias, return_preactivation, accumulate)


# A repeated product launches its kernel bound (chapter 08), under a key of all that its
# launch read: the operands', the bias' and the accumulator's layouts, the activation,
# whether the pre-activation is kept, and fp32's precision. Chapter 07's descriptor kernel
# is launched by key as before.
NONE = type(None)
PRODUCT_PLANS, CHECKED_PRODUCTS = plan_cache(), plan_cache()


def product_key(a, b, activation, bias, return_preactivation, accumulate) -> tuple:
    fp32 = a.dtype == torch.float32
    precision = torch.get_float32_matmul_precision() if fp32 else None
    key = (layout(a), layout(b), activation, layout(bias), return_preactivation)
    return (*key, layout(accumulate), precision)


def bound_product(a, b, activation, bias, return_preactivation, accumulate=None):
    """The bound ``product`` of a call like this one made before, or None."""
    key = product_key(a, b, activation, bias, return_preactivation, accumulate)
    return PRODUCT_PLANS.get(key)


def planned_product(launch, return_preactivation, out_dtype):
    """``product`` for one key, its launch bound: the outputs allocated, then it."""

    def product_bound(a, b, bias, accumulate):
        if accumulate is not None:
            out, pre = accumulate, None
        else:
            out = a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
            pre = torch.empty_like(out) if return_preactivation else None
        if bias is None:
            launch(a, b, out)
        elif pre is None:
            launch(a, b, out, bias)
        else:
            launch(a, b, out, bias, pre)
        return (out, pre) if return_preactivation else out

    return product_bound


def product(
    a, b, activation=None, bias=None, return_preactivation=False, accumulate=None
):
    """``matmul`` for arguments already checked (chapter 05's layer calls it three
    times a step: the checks once, in ``linear``)."""
    fast = type(a) is torch.Tensor and type(b) is torch.Tensor
    optional = OPTIONAL_TENSOR_TYPES
    fast = fast and type(bias) in optional and type(accumulate) in optional
    fast = fast and lean_now()
    if fast:
        key = product_key(a, b, activation, bias, return_preactivation, accumulate)
        planned = PRODUCT_PLANS.get(key)
        if planned is not None:
            return planned(a, b, bias, accumulate)
    with recorded_launches(fast) as launches:
        result = chosen_product(
            a, b, activation, bias, return_preactivation, accumulate
        )
    portable = [k for k, *_ in launches] == [matmul_portable_tuned]
    if fast and portable and (bias is not None or not return_preactivation):
        out, pre = result if return_preactivation else (result, None)
        leading = [t for t in (a, b, out, bias, pre) if t is not None]
        if bound := bound_launches(launches, tuple(leading)):
            out_dtype = output_dtype(a.dtype)
            PRODUCT_PLANS[key] = planned_product(
                bound[0], return_preactivation, out_dtype
            )
    return result


def chosen_product(a, b, activation, bias, return_preactivation, accumulate):
    """The launch ``product`` chooses: chapter 07's kernel or the portable one."""
    M, N, K = a.shape[0], b.shape[1], a.shape[1]
    if on_descriptors(a.dtype, M, N, K):
        # A long reduction pays for copying an operand whose rows a descriptor cannot
        # describe: one pass over M x K values, where the portable kernel cannot split K.
        operands = tma_operands(a, b, realign=splits_k(M, N, K))
        if operands is not None:
            return launch_tma(
                *operands, activation, bias, return_preactivation, None, accumulate
            )
    return launch_portable(
        a, b, activation, bias, return_preactivation, None, accumulate
    )


from torch import Tensor
from torch.library import custom_op


@custom_op("stepkernels::matmul", mutates_args=("accumulate",))
def matmul_op(
    a: Tensor,
    b: Tensor,
    activation: str | None,
    bias: Tensor | None,
    return_preactivation: bool,
    accumulate: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(out, preactivation), each empty where not asked for (out: with accumulate)."""
    result = launch_matmul(a, b, activation, bias, return_preactivation, accumulate)
    out, pre = result if return_preactivation else (result, a.new_empty(0))
    return (out if accumulate is None else a.new_empty(0)), pre


@matmul_op.register_fake
def _(a, b, activation, bias, return_preactivation, accumulate):
    out, pre = allocate_outputs(a, b, return_preactivation)
    out = out if accumulate is None else a.new_empty(0)
    return out, pre if return_preactivation else a.new_empty(0)
