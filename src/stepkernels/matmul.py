"""matmul: the code of chapter 04, Matrix multiplication at cuBLAS speed."""

# Generated from tutorials/04-matrix-multiplication.py by tools/export.py: edit the chapter, then
# `make export`.

from stepkernels._core import (
    FLOAT_DTYPES,
    INTERPRET,
    ON_GPU,
    autotune_configs,
    capability,
    sm_count,
)
from stepkernels.activations import apply_activation
from stepkernels.arguments import accumulate_arguments, matmul_arguments
from stepkernels.launch import lean
import torch
import triton
import triton.language as tl


@triton.jit
def tile_of_program(tile_id, tiles_m, tiles_n, GROUP_SIZE_M: tl.constexpr):
    # Groups of GROUP_SIZE_M tile rows; inside a group, tiles are numbered column by column.
    tiles_per_group = GROUP_SIZE_M * tiles_n
    first_row = (tile_id // tiles_per_group) * GROUP_SIZE_M
    rows_in_group = min(tiles_m - first_row, GROUP_SIZE_M)  # the last may be short
    pid_m = first_row + (tile_id % tiles_per_group) % rows_in_group
    pid_n = (tile_id % tiles_per_group) // rows_in_group
    return pid_m, pid_n


@triton.jit
def add_bias(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS: tl.constexpr):
    # The bias is one value per column of C, loaded once per tile and added in fp32.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    return acc


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PREACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, ACCUMULATE: tl.constexpr = False,
):  # fmt: skip
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_of_program(tl.program_id(0), tiles_m, tiles_n, GROUP_SIZE_M)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrap, do not mask: rows past M (columns past N) re-read valid data that we never store.
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


def tile_config(block_m, block_n, block_k, stages, warps, itemsize, group_size_m=8):
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    made = triton.Config(
        blocks | {"GROUP_SIZE_M": group_size_m}, num_stages=stages, num_warps=warps
    )
    made.itemsize = itemsize  # read by keep_configs_for_dtype
    return made


# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) by itemsize; the interpreter takes 2's first
PORTABLE_TILES = {
    2: [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 5, 4)],
    1: [(128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 128, 4, 8),
        (64, 128, 128, 4, 4)],
    4: [(128, 128, 32, 3, 8), (128, 64, 32, 4, 4), (64, 64, 32, 4, 4)],
}  # fmt: skip
PORTABLE_CONFIGS = [tile_config(*tile, itemsize=size)
                    for size, tiles in PORTABLE_TILES.items() for tile in tiles]  # fmt: skip


TUNED_FROM = 2**23  # M * N * K; the benchmarks start at 256³ = 2**24


def keep_configs_for_dtype(configs, named_args, **kwargs):
    itemsize = named_args["a_ptr"].element_size()
    kept = [c for c in configs if getattr(c, "itemsize", itemsize) == itemsize]
    if named_args["M"] * named_args["N"] * named_args["K"] >= TUNED_FROM:
        return kept
    return [min(kept, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


matmul_portable_tuned = lean(triton.autotune(  # lean: cheap repeated launches (chapter 08)
    configs=autotune_configs(PORTABLE_CONFIGS),
    key=["M", "N", "K", "INPUT_PRECISION"],
    restore_value=["c_ptr"],  # tuning launches it again and again: keep C for ACCUMULATE
    prune_configs_by={"early_config_prune": keep_configs_for_dtype},
)(matmul_kernel))  # fmt: skip


FP8_DTYPES = (torch.float8_e4m3fn,) if INTERPRET or capability() >= (8, 9) else ()
SUPPORTED_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_inputs(a, b, activation, bias):
    matmul_arguments(a, b, activation, bias, SUPPORTED_DTYPES)  # raising what to do


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype.itemsize == 1 else dtype  # fp8 -> bf16


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 follows torch's setting, as torch.matmul does."""
    exact = dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    return "ieee" if exact else "tf32"  # "tf32", the default, means nothing for 16 bits


def allocate_outputs(a, b, return_preactivation, accumulate=None):
    if accumulate is not None:
        return accumulate, None
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=output_dtype(a.dtype))
    return out, torch.empty_like(out) if return_preactivation else None


def matmul_portable(
    a, b, activation=None, *, bias=None, return_preactivation=False, config=None
):
    """``activation(a @ b + bias)`` with the portable kernel, autotuned unless ``config``
    (a dict of BLOCK_M, BLOCK_N, BLOCK_K, GROUP_SIZE_M, num_warps, num_stages) is given."""
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
        kernel[grid](
            a, b, out, bias, pre, M, N, K,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), out.stride(1), bias.stride(0) if bias is not None else 0,
            ACTIVATION=activation, HAS_BIAS=bias is not None,
            STORE_PREACTIVATION=pre is not None, INPUT_PRECISION=dot_precision(a.dtype),
            UPCAST=INTERPRET and a.dtype == torch.bfloat16,
            ACCUMULATE=accumulate is not None, **(config or {}),
        )  # fmt: skip
    return (out, pre) if return_preactivation else out


ON_HOPPER = ON_GPU and capability()[0] == 9


def fills_the_gpu(M: int, N: int) -> bool:
    """At least one 128 × 128 tile of the M × N output per SM?"""
    return triton.cdiv(M, 128) * triton.cdiv(N, 128) >= sm_count()


def on_descriptors(dtype, M: int, N: int) -> bool:
    """Does ``matmul`` give an M × N product in ``dtype`` to chapter 07's kernel?"""
    return ON_HOPPER and (dtype.itemsize == 1 or fills_the_gpu(M, N))


def copies_for_tf32(dtype, M: int, N: int) -> bool:
    """tf32 on chapter 07's kernel, which copies operands that are not K-major?"""
    tf32 = dtype == torch.float32 and dot_precision(dtype) == "tf32"
    return tf32 and on_descriptors(dtype, M, N)


def matmul(
    a, b, activation=None, *, bias=None, return_preactivation=False, accumulate=None
):
    """``activation(a @ b + bias)`` for 2-D ``a`` (M, K), ``b`` (K, N) of any strides:
    fp16, bf16, fp32 (exact or tf32 as ``torch.get_float32_matmul_precision()`` says) and
    fp8 e4m3 (bf16 output), accumulated in fp32, bias (N,) and activation applied in fp32
    before one rounding. ``return_preactivation``: ``(out, a @ b + bias)``, one kernel.
    ``accumulate``: a contiguous (M, N) tensor that gets ``a @ b (+ bias)`` added in place."""
    check_inputs(a, b, activation, bias)
    if accumulate is not None:
        accumulate_arguments(
            accumulate, a, b, activation, return_preactivation, output_dtype(a.dtype)
        )
    if on_descriptors(a.dtype, a.shape[0], b.shape[1]):
        from stepkernels.matmul_hopper import launch_tma, tma_operands

        operands = tma_operands(a, b)
        if operands is not None:
            return launch_tma(
                *operands, activation, bias, return_preactivation, None, accumulate
            )
    return launch_portable(
        a, b, activation, bias, return_preactivation, None, accumulate
    )
