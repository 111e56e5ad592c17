r"""
Matrix multiplication at cuBLAS speed
=====================================

We write ``C = activation(A @ B + bias)`` in Triton, in fp16, bf16 and fp32, with the bias
and activation fused into the kernel, and measure it against cuBLAS (``torch.matmul``).

What you will learn:

* why a large matmul is compute bound, and why only a tiled kernel gets there;
* tiles and 2-D blocks of pointers that follow any strides (``x.t()`` costs no copy);
* the order in which programs take their tiles, and why a *grouped* order helps the L2;
* the epilogue (bias, activation, a second output), and autotuning with its cost.

Chapter 07 adds the Hopper kernel that ``matmul`` uses on an H100. Prerequisites: chapter
01. Without a GPU, every kernel runs under Triton's interpreter at a small size.
"""

# %%
# Setup
# -----

from stepkernels.lessons import bench, check_matmul, figures_matmul, tutorial
import torch
import triton
import triton.language as tl

tutorial.announce()
DEVICE = tutorial.DEVICE
# sphinx_gallery_thumbnail_number = 2

# %%
# Why a matmul can be fast: the arithmetic
# ----------------------------------------
# An M×K by K×N product costs 2·M·N·K FLOPs for only M·K + K·N + M·N elements of traffic:


def flops_per_byte(M: int, N: int, K: int, itemsize: int) -> float:
    return 2 * M * N * K / ((M * K + K * N + M * N) * itemsize)


for size in (256, 1024, 4096):
    print(f"{size}³ in fp16: {flops_per_byte(size, size, size, 2):,.0f} FLOPs per byte")

# %%
# An H100 moves about 3 TB/s and does about 1,000 dense fp16 TFLOP/s (data sheet): above a
# few hundred FLOPs per byte a matmul is *compute bound*, reported in TFLOP/s. But a thread
# computing one output from memory reads a row of A and a column of B for it: one FLOP per
# byte. Tiling is the fix: a program computes a BLOCK_M × BLOCK_N tile of C, walking K in
# steps of BLOCK_K, each loading a tile of A and one of B on chip for the tensor cores:
# ``flops_per_byte(BLOCK_M, BLOCK_N, BLOCK_K)`` per byte loaded, 85 for 128 × 256 × 64 in
# fp16. The L2 cache serves many of those loads, depending on which tiles run together.
#
# Tiles and pointers
# ------------------
# Tile (``pid_m``, ``pid_n``) has rows ``offs_m = pid_m * BLOCK_M + arange(BLOCK_M)``, columns
# ``offs_n``, and at each K-step ``offs_k``. Element (i, k) of A is at ``a_ptr + i * stride_am
# + k * stride_ak``, so a tile of addresses is one broadcast, ``a_ptr + offs_m[:, None] *
# stride_am + offs_k[None, :] * stride_ak``, and a K-step adds ``BLOCK_K * stride_ak``. A view
# like ``w.t()`` swaps the strides: it is read where it lies, in wide loads.
#
# Program order: row-major against grouped
# ----------------------------------------
# 132 SMs run one or two of our programs each, and programs start roughly in order of id: the
# window in flight decides what L2 holds. Row-major, it covers a tile row or two of C: a panel
# or two of A but *every* column-panel of B, which for large N does not fit in L2. Grouped,
# tiles go column by column inside groups of ``GROUP_SIZE_M`` rows: a square-ish patch.

figures_matmul.draw_program_order(tiles=9, programs_in_flight=9, group=3)
# A real launch: 8,192² in 128 × 256 tiles (64 × 32 tiles), 132 programs in flight.
for group_size_m in (1, 8):
    rows, columns = figures_matmul.panels_read(64, 32, group_size_m, programs=132)
    print(f"GROUP_SIZE_M = {group_size_m}: {rows} panels of A + {columns} of B")

# %%
# The kernel computes its tile the same way. Chapter 07's kernel numbers its tiles so too, so
# this cell and the other pieces both kernels use go to the package's runtime layer
# (``# @save runtime/tiles``), where the operations share their device code.

# @save runtime/tiles
from stepkernels.runtime.arguments import matmul_arguments
from stepkernels.runtime.core import FLOAT_DTYPES
from stepkernels.runtime.device import profile
import torch
import triton
import triton.language as tl


@triton.jit
def tile_of_program(tile_id, tiles_m, tiles_n, GROUP_SIZE_M: tl.constexpr):
    # Groups of GROUP_SIZE_M tile rows, whose tiles are numbered column by column.
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


# %%
# The activations
# ---------------
# The epilogue can apply an activation to the fp32 accumulator before the one store. Chapters
# 05 and 06 fuse them too, so they go into the package's ``activations`` module, with their
# derivatives for the backward passes. ``ACTIVATION`` is a compile-time string: each choice
# compiles to its own kernel, and the branches cost nothing at run time. GELU, z Phi(z), takes
# an erfc of one ``rsqrt`` and one ``exp2`` instead of libdevice's slow ``erf``: chapter 06
# derives it; ``OUT``, the output's dtype, picks its accuracy (about 1e-7 for fp32, else 1e-4).

# @save runtime/activations
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


# %%
# The portable kernel
# -------------------
# Each program computes its tile in three parts:
#
# 1. **Where am I.** ``tile_of_program`` gives the tile; offsets (int64: no wrap-around past
#    2^31 elements) and pointer blocks follow.
# 2. **The K loop.** ``tl.dot`` tiles of A and B into an fp32 accumulator, with ``num_stages``
#    K-steps of loads in flight. Rows of A past M (columns of B past N) are *wrapped*
#    (``offs % M``), not masked: they load valid data feeding outputs we never store. Only a
#    partial last K-step needs a mask; ``EVEN_K`` compiles it away when BLOCK_K divides K.
# 3. **The epilogue.** Add the bias, optionally store this *pre-activation* (chapter 05 keeps
#    it for the backward pass), apply the activation in fp32, round once and store, masked;
#    or, with ``ACCUMULATE``, add C's old values first (BLAS's beta = 1; chapter 10 uses it).
#
# fp32 follows ``torch.get_float32_matmul_precision()`` as ``torch.matmul`` does: under
# ``"highest"`` (the default) ``INPUT_PRECISION = "ieee"`` is true fp32, without tensor cores;
# under ``"high"`` or ``"medium"`` the tensor cores take it as tf32 (10 bits of mantissa),
# several times faster. ``UPCAST``: bf16 under the interpreter, whose bf16 dot is garbage.


# @save ops/matmul
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


# %%
# Autotuning
# ----------
# The best tile depends on the GPU, the dtype and the problem. Big tiles (128 × 256) reuse
# loads most; 64-wide ones keep more SMs busy on a small or skinny C. ``num_warps`` share a
# tile; ``num_stages`` K-steps sit in shared memory (3 stages of 128 × 64 + 64 × 256 fp16 take
# 144 KB of the H100's 228). ``BLOCK_K`` makes a K-slice row 128 bytes, the swizzle width the
# tensor cores read best; a prune drops configs of other element sizes. The first call for
# each ``key`` compiles and times every config left, seconds that chapter 08 measures, so the
# lists are short and a product under ``TUNED_FROM`` multiply-adds takes the smallest tile
# untimed. A model whose shapes change at every call should bucket them, or give
# ``matmul_portable`` a fixed ``config``. The interpreter keeps the first config only.


# @save runtime/tiles
def tile_config(block_m, block_n, block_k, stages, warps, itemsize, group_size_m=8):
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    made = triton.Config(
        blocks | {"GROUP_SIZE_M": group_size_m}, num_stages=stages, num_warps=warps
    )
    made.itemsize = itemsize  # read by keep_configs_for_dtype
    return made


TUNED_FROM = 2**23  # M * N * K; the benchmarks start at 256³ = 2**24


def keep_configs_for_dtype(configs, named_args, **kwargs):
    itemsize = named_args["a_ptr"].element_size()
    kept = [c for c in configs if getattr(c, "itemsize", itemsize) == itemsize]
    if named_args["M"] * named_args["N"] * named_args["K"] >= TUNED_FROM:
        return kept
    return [min(kept, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


# %%
# The portable kernel's tiles, and its autotuner:

# @save ops/matmul
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

# %%
# The wrapper
# -----------
# ``matmul_portable`` checks its inputs (``stepkernels.runtime.arguments``: an error says what to
# fix), allocates C (in the input dtype; bf16 for fp8) and launches one program per tile with
# the strides as they are: a ``.t()`` view is never copied. An empty C launches nothing; K = 0
# gives activation(bias), as in PyTorch. ``config`` fixes the tile shape instead of autotuning.
#
# ``matmul``, which the rest of the collection calls, is the portable kernel except on
# Hopper, where chapter 07's descriptor kernel takes the product when the layout allows and
# the output has a 128 × 128 tile per SM (fp8 always): below that, the portable kernel
# measured faster. One exception: a weight gradient's shape (few tiles, K many times longer,
# ``splits_k``), which chapter 07's kernel splits along K over the idle SMs. The checks,
# dtypes and outputs are chapter 07's too (``runtime/tiles``).

# @save runtime/tiles
# fp8 tensor cores: sm_89 on (the interpreter emulates them)
FP8_DTYPES = (torch.float8_e4m3fn,) if profile().fp8 else ()
SUPPORTED_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_inputs(a, b, activation, bias, return_preactivation=False):
    matmul_arguments(a, b, activation, bias, SUPPORTED_DTYPES, return_preactivation)


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype.itemsize == 1 else dtype  # fp8 -> bf16


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 follows torch's setting, as torch.matmul."""
    exact = dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    return "ieee" if exact else "tf32"  # "tf32", the default, means nothing for 16 bits


def allocate_outputs(a, b, return_preactivation, accumulate=None):
    if accumulate is not None:
        return accumulate, None
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=output_dtype(a.dtype))
    return out, torch.empty_like(out) if return_preactivation else None


# %%
# The portable kernel's wrapper, and ``matmul``, which chooses between the two kernels:


# @save ops/matmul
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


# %%
# ``torch.compile`` sees ``matmul`` as an operator of ``torch.library`` (chapter 08). Chapter
# 07's Hopper kernel builds host-side TMA descriptors and an ``Epilogue`` class, which the
# compiler cannot copy into its own code, so this one is a ``custom_op``: opaque, called by the
# compiled graph as it is, with a fake implementation for the outputs' shapes. It has no
# derivative (chapter 05's linear layer has one). An operator returns new tensors only: with
# ``accumulate`` it writes there and returns an empty one.

# @save ops/matmul
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


# %%
# Correctness
# -----------
# ``check_matmul.check`` compares with the fp64 product of the same inputs. The kernel
# accumulates in fp32 and rounds once; products of ``randn`` inputs grow like sqrt(K): the
# tolerance is two units in the last place (2^-10 fp16, 2^-7 bf16; fp32 1e-4 exact, 2^-8
# tf32), times sqrt(K) absolute. Shapes: 1 × 1 × 1, M, N or K = 1, odd sizes, several blocks
# and K-steps; A and B as given, transposed, A row-strided; each call with a bias, the next
# activation and the pre-activation. Each shape compiles kernels, seconds each on a GPU: a
# quick GPU run checks four shapes (a single row, odd sizes, a ragged tile, several tiles),
# ``STEPKERNELS_FULL=1`` all seven. ``tests/test_matmul.py`` has shapes of each kind and
# more: bf16, fp8, sizes the autotuner takes.

shapes = [  # (M, N, K)
    (1, 1, 1),
    (1, 136, 48),  # a single row
    (96, 1, 64),  # a single column
    (33, 40, 1),  # K = 1
    (50, 24, 13),  # odd sizes
    (77, 136, 48),  # two tiles along N, the second ragged
]
shapes += bench.choose(gpu=[(130, 264, 200)], cpu=[])  # several tiles and K steps
QUICK_SHAPES = [(1, 136, 48), (50, 24, 13), (77, 136, 48), (130, 264, 200)]
dtypes = [
    torch.float16,
    torch.float32,
]  # bf16, fp8 and autotuned sizes: tests/test_matmul.py
CHECK_SHAPES = tutorial.choose(gpu=QUICK_SHAPES, cpu=shapes, full=shapes)
check_matmul.check(matmul_portable, dtypes=dtypes, shapes=CHECK_SHAPES)

# %%
# And the inputs the wrapper cannot take are refused with a message, not answered wrongly:

a, b = torch.randn(8, 16, device=DEVICE), torch.randn(16, 4, device=DEVICE)
bad_calls = {
    "inner dims differ": lambda: matmul(a, b[:-1]),
    "dtypes differ": lambda: matmul(a, b.half()),
    "integer dtype": lambda: matmul(a.int(), b.int()),
    "not 2-D": lambda: matmul(a[None], b),
    "wrong device": lambda: matmul(a.to("meta"), b.to("meta")),
    "bias length": lambda: matmul(a, b, bias=torch.zeros(5, device=DEVICE)),
    "activation": lambda: matmul(a, b, activation="tanh"),
}
tutorial.show_refusals("matmul()", bad_calls)

# %%
# Benchmark: square matrices
# --------------------------
# ``matmul`` (``triton``; on an H100 chapter 07's kernel once the output fills the GPU), the
# portable kernel alone, ``torch.matmul`` (cuBLAS) and ``torch.compile(torch.mm)``, which hands a
# lone matmul to cuBLAS: a second measurement of it. GPU time (How we measure); dashed: cuBLAS.


def calls(x, y) -> dict:
    return {
        "triton": lambda: matmul(x, y),
        "triton (portable)": lambda: matmul_portable(x, y),
        "torch": lambda: torch.matmul(x, y),
    }


def make_square(provider: str, size: int, dtype: torch.dtype):
    x, y = (torch.randn(size, size, device=DEVICE, dtype=dtype) for _ in "xy")
    if provider == "torch.compile":
        compiled_mm = bench.compile_static(torch.mm)
        compiled_mm(x, y)  # compile before the timing
        return lambda: compiled_mm(x, y)
    return calls(x, y)[provider]


def matmul_flops(size: int, dtype: torch.dtype) -> int:
    return 2 * size**3


square = bench.Benchmark(
    name="matmul-square",
    x_name="M = N = K",
    x_values=[256, 512, 1024, 2048, 3072, 4096, 6144, 8192],
    providers=["triton", "triton (portable)", "torch", "torch.compile"],
    make=make_square,
    work=matmul_flops,
    unit="TFLOP/s",
    dtypes=(torch.float16, torch.bfloat16),
    quick_dtypes=(torch.float16,),  # bf16 autotunes kernels of its own: recorded
    smoke_x=64,
    headline_x=4096,
)
square_results = bench.run(square)


def print_ratios(results, x_values, ours="triton", theirs="torch"):
    """A table of ``ours``'s TFLOP/s over ``theirs``'s, a row per dtype."""
    print(f"{ours} / {theirs}, by {results.bench.x_name}:")
    print(f"  {'':9}" + "".join(f"{x:>7,}" for x in x_values))
    for dtype in results.bench.dtypes:
        ratios = [results.ratio(ours, theirs, x, dtype) for x in x_values]
        print(f"  {str(dtype)[6:]:9}" + "".join(f"{r:>7.0%}" for r in ratios))


if square_results is not None:  # our share of cuBLAS; the descriptor kernel's gain
    print_ratios(square_results, square.x_values)
    print_ratios(square_results, [2048, 4096, 8192], theirs="triton (portable)")

# %%
# On large squares we run within a few percent of cuBLAS (torch and torch.compile make the same
# cuBLAS call: their lines agree). We trail on small products, where fixed costs weigh, and where
# tiles fill the last wave poorly (3,072³: 288 tiles of 128 × 256 for 132 SMs; chapter 07 splits
# that wave). Under the H100's power cap the time of one launch moves by 5 to 15% between
# timings seconds apart, so the providers are timed in turns.
#
# Benchmark: what the program order is worth
# ------------------------------------------
# The portable kernel with one fixed config (128 × 256 × 64 tiles, 3 stages, 8 warps), once
# with ``GROUP_SIZE_M = 1`` (row-major order) and once with 8, in fp16.

ORDER_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, num_warps=8)


def make_order(provider: str, size: int, dtype: torch.dtype):
    x, y = (torch.randn(size, size, device=DEVICE, dtype=dtype) for _ in "xy")
    settings = ORDER_CONFIG | {"GROUP_SIZE_M": int(provider.split("=")[1].rstrip(")"))}
    if tutorial.INTERPRET:  # small blocks for the smoke run
        settings |= {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    return lambda: matmul_portable(x, y, config=settings)


program_order = bench.Benchmark(
    name="matmul-program-order",
    x_name="M = N = K",
    x_values=[2048, 4096, 8192, 16384],
    providers=["triton (GROUP_SIZE_M=1)", "triton (GROUP_SIZE_M=8)"],
    make=make_order,
    work=matmul_flops,
    unit="TFLOP/s",
    dtypes=(torch.float16,),
    smoke_x=48,
    headline_x=8192,
)
order_results = bench.run(program_order)
if order_results is not None:
    print_ratios(order_results, program_order.x_values, *program_order.providers[::-1])

# %%
# Grouping gains little while A and B (16 and 64 MB at 2,048³ and 4,096³) nearly fit in the
# 50 MB L2, more beyond: at 16,384³ programs in flight read all 64 column-panels of B.
#
# Benchmark: skinny matrices
# --------------------------
# M tokens through an 8,192 × 8,192 weight, M = 16 to 256: the 134 MB weight (fp16) is read
# whatever M is, while FLOPs grow with M; at M = 16, 16 FLOPs per byte, about 50 TFLOP/s at
# 3 TB/s. Memory bound: read B once, with enough programs to keep every SM loading.

SKINNY_SIZE = bench.choose(gpu=8192, cpu=64)  # N = K


def make_skinny(provider: str, m: int, dtype: torch.dtype):
    x = torch.randn(m, SKINNY_SIZE, device=DEVICE, dtype=dtype)
    y = torch.randn(SKINNY_SIZE, SKINNY_SIZE, device=DEVICE, dtype=dtype)
    return calls(x, y)[provider]


skinny = bench.Benchmark(
    name="matmul-skinny",
    x_name="M (N = K = 8192)",
    x_values=[16, 32, 64, 128, 256],
    providers=["triton", "triton (portable)", "torch"],
    make=make_skinny,
    work=lambda m, dtype: 2 * m * SKINNY_SIZE * SKINNY_SIZE,
    unit="TFLOP/s",
    dtypes=(torch.float16,),
    smoke_x=16,
    headline_x=64,
)
skinny_results = bench.run(skinny)
if skinny_results is not None:
    print_ratios(skinny_results, skinny.x_values)

# %%
# No output here has a 128 × 128 tile per SM: ``matmul`` runs the portable kernel, whose
# 64 × 64 tile makes 128 programs for M up to 64.
#
# What we learned
# ---------------
# * A matmul is compute bound only with large, reused tiles: a program computes a tile of C
#   from panels of A and B, read through 2-D blocks of pointers that follow any strides.
# * The order of the programs decides what the L2 cache holds; grouped reads fewer panels.
# * Autotuning picks tiles, warps and stages per shape and dtype, paid on the first call.
# * The epilogue is nearly free: bias, activation and a second output save passes over C.
# * fp32 means exact fp32 or tf32 on a GPU; ``matmul`` follows PyTorch's setting.
# * The tiles, stages and the power cap's effect on timings were measured on an H100:
#   ``lab/NOTES.md`` keeps those measurements.
#
# Exercises
# ---------
# 1. Split-K: for the skinny shapes, give each program a slice of K as well as a tile of C
#    and add partial tiles with ``tl.atomic_add`` into an fp32 buffer. How many programs
#    does M = 16 launch then, and what happens to the bandwidth?
# 2. Time fp32 ``matmul`` at 4,096³ under ``torch.set_float32_matmul_precision("highest")``
#    and ``"high"``. How far apart are exact fp32 and tf32, and each from ``torch.matmul``?
