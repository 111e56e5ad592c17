r"""
Matrix multiplication at cuBLAS speed
=====================================

We write a matrix multiplication ``C = activation(A @ B + bias)`` in Triton, in fp16, bf16,
fp32 and (on Hopper) fp8, with the bias and the activation fused into the kernel, and measure
it against cuBLAS, the vendor library behind ``torch.matmul``: on an H100 it is level with
cuBLAS on most large square products and in fp8, and trails it on small, odd-sized and skinny
ones, by amounts the benchmarks at the end give.

What you will learn:

* block tiling: why a program computes a whole tile of C, and the 2-D pointer arithmetic
  that walks tiles of A and B with any strides (so ``x.t()`` costs no copy);
* the order in which programs take their tiles, why a *grouped* order makes better use of
  the L2 cache, a picture of it, and what it is worth in TFLOP/s;
* autotuning: letting Triton time a few block shapes per problem size, and what that costs;
* the epilogue: bias, activation and a second output fused after the last multiply-add;
* low precision: fp16 and bf16 inputs with fp32 accumulation, and fp8 on Hopper;
* a Hopper-only path (tensor descriptors, the TMA copy engine, persistent programs), kept
  apart from the portable kernel, and why it is there.

Prerequisites: chapter 01 (programs, blocks, masks, the wrapper). No GPU is needed to follow
along: without one, every kernel runs under Triton's interpreter at a small size.
"""

# %%
# Setup
# -----

import time

import kit
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

kit.announce()
DEVICE = kit.DEVICE
CAPABILITY = torch.cuda.get_device_capability() if kit.ON_GPU else (0, 0)
# The Hopper path needs the TMA copy engine (compute capability 9.x); fp8 tensor cores need
# 8.9 (Ada) or newer. The interpreter emulates fp8 (in fp16), so it can check that path too.
ON_HOPPER = kit.ON_GPU and CAPABILITY[0] == 9
HAS_FP8 = kit.INTERPRET or CAPABILITY >= (8, 9)
# sphinx_gallery_thumbnail_number = 2

# %%
# Why a matmul can be fast: the arithmetic
# ----------------------------------------
# Multiplying an M×K matrix by a K×N one costs 2·M·N·K floating-point operations (a multiply
# and an add per term) but needs only (M·K + K·N + M·N) elements of memory traffic. For
# 4,096³ in fp16 that is 137 GFLOP against 101 MB: 1,365 FLOPs per byte. An H100 moves about
# 3.0 TB/s and its tensor cores do about 990 dense fp16 TFLOP/s (the data-sheet figure;
# cuBLAS reaches 666 to 697 at 4,096³ on our card), so it can afford 330 FLOPs per byte
# before memory becomes the limit. A large matmul is *compute bound*: the speed is set by
# how busy the tensor cores are, and we report it in TFLOP/s, counting 2·M·N·K per call.
#
# The catch is that the 1,365 FLOPs per byte are only available to a kernel that reads each
# input element once, and no kernel can. Computing one element of C needs a whole row of A
# and a whole column of B. A kernel that computes one output per thread, reading its row and
# column from memory, reads 2·K elements for 2·K FLOPs: one FLOP per byte in fp16. It would
# run at memory speed, about 3 TFLOP/s.
#
# Tiling is the fix. A program that computes a BLOCK_M × BLOCK_N tile of C walks along K in
# steps of BLOCK_K. At each step it loads a BLOCK_M × BLOCK_K tile of A and a BLOCK_K ×
# BLOCK_N tile of B into on-chip memory and multiplies them on the tensor cores: 2·BLOCK_M·
# BLOCK_N·BLOCK_K FLOPs for (BLOCK_M + BLOCK_N)·BLOCK_K elements loaded. With 128 × 256
# tiles in fp16 that is 85 FLOPs per byte loaded, and the L2 cache (50 MB on the H100),
# shared by all programs, serves most of those loads, so the traffic to DRAM is far less.
# How much less depends on which tiles run at the same time: that is the program order.
#
# Tiles and pointers
# ------------------
# A program owns one tile of C, at tile row ``pid_m`` and tile column ``pid_n``. Its rows
# are ``offs_m = pid_m * BLOCK_M + arange(BLOCK_M)`` and its columns ``offs_n``; for the
# current K-step the columns of A (rows of B) are ``offs_k``. Element (i, k) of A lives at
# ``a_ptr + i * stride_am + k * stride_ak``, so a whole tile of addresses is one broadcast:
#
# ``a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak``
#
# a BLOCK_M × BLOCK_K block of pointers. Stepping along K adds ``BLOCK_K * stride_ak`` to
# every one of them. Nothing assumes that a row is contiguous: a transposed view such as
# ``w.t()`` just swaps the two strides, and the kernel reads it where it lies. (Fast it is
# too: the tensor cores take either layout, and Triton arranges the loads so that the
# contiguous direction is read in wide, coalesced accesses.)
#
# Program order: row-major against grouped
# ----------------------------------------
# The programs of a launch do not all run at once: an H100 has 132 SMs, each holds one or two
# of our programs, and a 4,096² output in 128 × 256 tiles has 512 of them. Programs start
# roughly in order of their id, so the programs in flight at any moment are a window of
# consecutive ids, and the inputs those programs read are what the L2 cache holds.
#
# The obvious numbering is row-major: program ``pid`` takes tile row ``pid // tiles_n`` and
# column ``pid % tiles_n``. A window of consecutive programs then covers one or two tile rows
# of C in full: it reads one or two row-panels of A (fine) and *every* column-panel of B, all
# of B, which no longer fits in L2 for large N and is read again from DRAM for each row.
#
# The grouped order numbers tiles column by column inside groups of ``GROUP_SIZE_M`` tile
# rows. The same window of programs then covers a roughly square patch of C and reads
# ``GROUP_SIZE_M`` row-panels of A and a few column-panels of B: fewer distinct bytes for the
# same FLOPs, so more of its loads hit in L2. The picture shows the first nine programs of a
# 9 × 9 grid of tiles in each order, and the panels of A and B that they read.


def grouped_tile(tile_id, tiles_m, tiles_n, group_size_m):
    """Tile (row, column) of C that program ``tile_id`` computes in the grouped order.

    Plain Python, to draw the picture; the kernels call the same arithmetic in Triton.
    """
    tiles_per_group = group_size_m * tiles_n
    first_row = (tile_id // tiles_per_group) * group_size_m
    rows_in_group = min(tiles_m - first_row, group_size_m)
    row = first_row + (tile_id % tiles_per_group) % rows_in_group
    column = (tile_id % tiles_per_group) // rows_in_group
    return row, column


def draw_program_order(tiles: int = 9, programs_in_flight: int = 9, group: int = 3):
    orders = {
        "row-major (GROUP_SIZE_M = 1)": 1,
        f"grouped (GROUP_SIZE_M = {group})": group,
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    colors = plt.get_cmap("viridis")
    for ax, (title, group_size) in zip(axes, orders.items(), strict=True):
        owners = {}
        for pid in range(tiles * tiles):
            owners[grouped_tile(pid, tiles, tiles, group_size)] = pid
        rows_read, columns_read = set(), set()
        # C, with every tile labelled by the program that computes it
        for (row, column), pid in owners.items():
            in_flight = pid < programs_in_flight
            if in_flight:
                rows_read.add(row)
                columns_read.add(column)
            face = colors(pid / programs_in_flight * 0.85) if in_flight else "white"
            ax.add_patch(
                plt.Rectangle(
                    (column, -row - 1), 1, 1, facecolor=face, edgecolor="0.6", lw=0.8
                )
            )
            ax.text(
                column + 0.5,
                -row - 0.5,
                str(pid),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if in_flight else "0.45",
            )
        # A to the left of C (row-panels), B above it (column-panels)
        for row in range(tiles):
            face = "tab:red" if row in rows_read else "0.93"
            ax.add_patch(
                plt.Rectangle((-1.6, -row - 1), 1, 1, facecolor=face, edgecolor="white")
            )
        for column in range(tiles):
            face = "tab:red" if column in columns_read else "0.93"
            ax.add_patch(
                plt.Rectangle((column, 0.6), 1, 1, facecolor=face, edgecolor="white")
            )
        ax.text(-1.1, 0.9, "A", ha="center", va="center", fontsize=11)
        ax.text(-0.35, 1.1, "B", ha="right", va="center", fontsize=11)
        loaded = len(rows_read) + len(columns_read)
        ax.set_title(
            f"{title}\nprograms 0..{programs_in_flight - 1} read {len(rows_read)} panels of "
            f"A + {len(columns_read)} of B = {loaded}",
            fontsize=9,
        )
        ax.set(xlim=(-1.8, tiles + 0.2), ylim=(-tiles - 0.2, 1.8), aspect="equal")
        ax.axis("off")
    fig.suptitle(
        "Which tiles of C the first programs compute (numbers: program id), and the panels "
        "of A and B (red) they read",
        fontsize=9,
    )
    fig.tight_layout()


draw_program_order()

# %%
# Nine programs, nine tiles of C each way, but the row-major order reads 1 + 9 = 10 panels
# while the grouped order reads 3 + 3 = 6. For a real launch with 132 SMs the window is a
# hundred-odd tiles and the difference is larger: on a 64 × 32 grid of tiles (8,192² in 128 ×
# 256 tiles), the first 132 programs in row-major order read 3 row-panels of A and all 32
# column-panels of B; in groups of 8 rows they read 8 + 17. Whether that matters depends on
# whether the row-major footprint still fits in L2; we measure it below.
#
# Both kernels of this chapter get their tile from the same three lines of Triton:


@triton.jit
def tile_of_program(tile_id, tiles_m, tiles_n, GROUP_SIZE_M: tl.constexpr):
    # Groups of GROUP_SIZE_M tile rows; inside a group, tiles are numbered column by column.
    tiles_per_group = GROUP_SIZE_M * tiles_n
    first_row = (tile_id // tiles_per_group) * GROUP_SIZE_M
    rows_in_group = min(
        tiles_m - first_row, GROUP_SIZE_M
    )  # the last group may be short
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
# The epilogue can apply an activation to the fp32 accumulator before the one store. These
# device functions are shared by every chapter that fuses one (this one, chapter 05's
# backward, chapter 06's dropout layer), so they go into the package's ``activations``
# module. ``ACTIVATION`` is a compile-time string: each choice compiles to its own kernel,
# so the branches cost nothing at run time. The derivatives serve the backward passes.

#@save activations
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
        raise ValueError(f"activation {activation!r} unknown; choose one of {ACTIVATIONS}")


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
# 1. **Where am I.** ``tile_of_program`` turns the program id into a tile; offsets and 2-D
#    pointer blocks follow. Offsets are int64 so that a tensor past 2^31 elements does not
#    wrap around.
# 2. **The K loop.** Load a tile of A and one of B, ``tl.dot`` them into an fp32 accumulator,
#    advance the pointers. ``tl.dot`` maps to the tensor cores (``mma`` on Ampere, ``wgmma``
#    on Hopper), and Triton pipelines the loop: with ``num_stages = 3`` the loads for steps
#    k+1 and k+2 are in flight while step k multiplies. Rows of A past M and columns of B
#    past N are not masked but *wrapped* (``offs % M``): they load real, in-bounds data that
#    only feeds rows of C we never store, and the loads stay unmasked and wide. Only the
#    last, partial K-step needs a mask, since its zeros must not add garbage to valid outputs;
#    when BLOCK_K divides K (the usual case) ``EVEN_K`` compiles the mask away.
# 3. **The epilogue.** Add the bias, optionally store this *pre-activation* (chapter 05 keeps
#    it for the backward pass), apply the activation in fp32, round once to the output dtype
#    and store, masked to the bounds of C.
#
# fp16 and bf16 inputs go to the tensor cores as they are, with products accumulated in fp32;
# fp32 inputs go through them as tf32 (10 bits of mantissa, like ``torch`` with
# ``allow_tf32=True``). ``UPCAST`` converts the tiles to fp32 before the dot: we set it only
# under the interpreter for bf16, whose ``tl.dot`` there returns garbage.


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PREACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):  # fmt: skip
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_of_program(
        tl.program_id(axis=0), tiles_m, tiles_n, GROUP_SIZE_M
    )

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrap, do not mask: rows past M (columns past N) re-read valid data that we never store.
    rows = offs_m % M
    columns = offs_n % N
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
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    acc = add_bias(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS)
    c_offsets = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if STORE_PREACTIVATION:
        tl.store(pre_ptr + c_offsets, acc.to(pre_ptr.dtype.element_ty), mask=c_mask)
    out = kit.apply_activation(acc, ACTIVATION)
    tl.store(c_ptr + c_offsets, out.to(c_ptr.dtype.element_ty), mask=c_mask)


# %%
# Autotuning
# ----------
# The best tile shape depends on the GPU, the dtype and the problem. Big tiles (128 × 256)
# reuse each loaded element most and win on large matrices; they also leave few programs
# for a small or skinny C, where 64-wide tiles keep more SMs busy. ``num_warps`` sets how
# many warps share a tile (8 warps, two Hopper *warpgroups*, for the 128 × 256 tiles) and
# ``num_stages`` how many K-steps of A and B tiles are in flight in shared memory: 3 stages
# of 128 × 64 + 64 × 256 fp16 tiles take 144 KB of the H100's 228 KB.
#
# ``triton.autotune`` compiles every config in a list, times each on the first call for each
# value of ``key`` (here M, N, K and the dtypes), and remembers the fastest. We keep the
# lists short (five to eight configs per dtype) because that first call pays for all of them;
# the cost is measured below. Each config says for which element size it is meant:
# ``BLOCK_K`` is chosen so that one row of a K-slice is 128 bytes (64 fp16, 128 fp8, 32
# fp32), the width of the shared-memory swizzle pattern the tensor cores read best, and a
# prune step drops the configs of other element sizes before timing. Under the interpreter
# ``kit.autotune_configs`` keeps only the first config, since nothing can be timed there.


def config(block_m, block_n, block_k, stages, warps, itemsize, group_size_m=8):
    made = triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
        | {"GROUP_SIZE_M": group_size_m},
        num_stages=stages,
        num_warps=warps,
    )
    made.itemsize = itemsize  # read by keep_configs_for_dtype
    return made


PORTABLE_CONFIGS = [
    # 2-byte inputs (fp16, bf16). The first config is the interpreter's.
    config(128, 128, 64, 4, 8, itemsize=2),
    config(128, 256, 64, 3, 8, itemsize=2),
    config(256, 128, 64, 3, 8, itemsize=2),
    config(128, 128, 64, 4, 4, itemsize=2),
    config(64, 128, 64, 4, 4, itemsize=2),
    config(64, 64, 64, 5, 4, itemsize=2),
    # 1-byte inputs (fp8)
    config(128, 256, 128, 3, 8, itemsize=1),
    config(256, 128, 128, 3, 8, itemsize=1),
    config(128, 128, 128, 4, 8, itemsize=1),
    config(64, 128, 128, 4, 4, itemsize=1),
    # 4-byte inputs (fp32, as tf32)
    config(128, 128, 32, 3, 8, itemsize=4),
    config(128, 64, 32, 4, 4, itemsize=4),
    config(64, 64, 32, 4, 4, itemsize=4),
]


def keep_configs_for_dtype(configs, named_args, **kwargs):
    itemsize = named_args["a_ptr"].element_size()
    return [c for c in configs if getattr(c, "itemsize", itemsize) == itemsize]


matmul_portable_tuned = triton.autotune(
    configs=kit.autotune_configs(PORTABLE_CONFIGS),
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": keep_configs_for_dtype},
)(matmul_kernel)


# %%
# The wrapper
# -----------
# ``matmul(a, b, activation=None, *, bias=None, return_preactivation=False)`` checks its
# inputs, allocates C (contiguous, in the input dtype; bf16 for fp8 inputs, whose range is too
# small for a product), and launches one program per tile. The strides of A and B are passed
# as they are: any layout works, and a ``.t()`` view is never copied.
#
# The checks reject, with a message that says what to do: something that is not a 2-D
# tensor, a wrong device, an unsupported or mismatched dtype, inner dimensions that differ, a
# bias of the wrong length, an unknown activation. fp8 is accepted only on a GPU that has fp8
# tensor cores.

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,) if HAS_FP8 else ()
SUPPORTED_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_inputs(a, b, activation, bias):
    kit.check_tensor(a, "a", contiguous=False)
    kit.check_tensor(b, "b", contiguous=False)
    for name, tensor in (("a", a), ("b", b)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            hint = (
                " (fp8 needs a GPU of compute capability 8.9 or newer)"
                if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                else ""
            )
            names = ", ".join(kit.dtype_name(d) for d in SUPPORTED_DTYPES)
            raise TypeError(
                f"{name} has dtype {tensor.dtype}; supported here: {names}{hint}. "
                f"Convert with {name}.to(torch.float16) or another supported dtype"
            )
        if tensor.dim() != 2:
            raise ValueError(
                f"{name} must be a 2-D matrix, got shape {tuple(tensor.shape)}: "
                f"flatten the leading dimensions with {name}.reshape(-1, {name}.shape[-1])"
            )
    if a.dtype != b.dtype:
        raise TypeError(
            f"a and b must have one dtype, got {a.dtype} and {b.dtype}: convert one "
            "with .to(...)"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"inner dimensions differ: a is {tuple(a.shape)} and b is {tuple(b.shape)}, "
            f"so a @ b is undefined; b needs {a.shape[1]} rows (did you mean b.t()?)"
        )
    if activation not in kit.ACTIVATIONS:
        raise ValueError(
            f"activation {activation!r} unknown; choose one of {kit.ACTIVATIONS}"
        )
    if bias is not None:
        kit.check_tensor(bias, "bias", FLOAT_DTYPES, contiguous=False)
        if bias.shape != (b.shape[1],):
            raise ValueError(
                f"bias must have shape ({b.shape[1]},), one value per column of the "
                f"output, got {tuple(bias.shape)}"
            )


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    return (
        torch.bfloat16 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    )


def allocate_outputs(a, b, return_preactivation):
    shape, dtype = (a.shape[0], b.shape[1]), output_dtype(a.dtype)
    out = torch.empty(shape, device=a.device, dtype=dtype)
    pre = torch.empty_like(out) if return_preactivation else None
    return out, pre


def matmul_portable(
    a, b, activation=None, *, bias=None, return_preactivation=False, config=None
):
    """``activation(a @ b + bias)`` with the portable kernel, autotuned unless ``config``
    (a dict of BLOCK_M, BLOCK_N, BLOCK_K, GROUP_SIZE_M, num_warps, num_stages) is given."""
    check_inputs(a, b, activation, bias)
    return launch_portable(a, b, activation, bias, return_preactivation, config)


def launch_portable(a, b, activation, bias, return_preactivation, config):
    """The portable kernel's launch, for inputs that ``check_inputs`` accepted."""
    out, pre = allocate_outputs(a, b, return_preactivation)
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
            ACTIVATION=activation,
            HAS_BIAS=bias is not None,
            STORE_PREACTIVATION=pre is not None,
            UPCAST=kit.INTERPRET and a.dtype == torch.bfloat16,
            **(config or {}),
        )  # fmt: skip
    return (out, pre) if return_preactivation else out


# %%
# The Hopper path: tensor descriptors and persistent programs
# -----------------------------------------------------------
# On an H100 the portable kernel leaves speed on the table in three places, and Hopper has
# hardware for each:
#
# * **Address arithmetic.** Every K-step computes a block of 2-D pointers and issues the
#   loads from the program's threads. Hopper's *TMA* (Tensor Memory Accelerator) is a copy
#   engine that takes a *tensor descriptor* (base address, shape, strides, tile shape) and a
#   tile coordinate, and copies the tile from global to shared memory by itself, filling
#   zeros past the edges. ``tl.make_tensor_descriptor`` builds the descriptor inside the
#   kernel and ``desc.load([row, column])`` issues the copy; the threads are free for the
#   tensor cores, and no masks are needed.
# * **Launch tails.** One program per tile means that the last wave of programs may use only
#   part of the GPU, and every program pays its prologue (filling the pipeline) and epilogue
#   without overlap. A *persistent* kernel launches one program per SM, and each program
#   loops over tiles ``pid, pid + NUM_SMS, pid + 2 * NUM_SMS, ...`` in the grouped order.
# * **The epilogue.** A TMA store writes the finished tile of C from shared memory, again
#   clipped at the edges by the hardware.
#
# The descriptor needs the last dimension of each tensor to be contiguous and every other
# stride to be a multiple of 16 bytes. A transposed operand (``x.t()``, contiguous along its
# rows) is described as the matrix it really is, tiles are loaded in that layout and
# transposed in registers (``.T``), which costs nothing: the tensor cores read either order
# from shared memory. Operands with other strides, or shapes whose rows are not a multiple
# of 16 bytes, go to the portable kernel, which also stays the path on every GPU other than
# Hopper. Descriptors built inside a kernel need a little global scratch memory for the
# descriptor itself, which Triton asks for through ``triton.set_allocator``.
#
# ``FLATTEN`` asks Triton to pipeline the tile loop and the K loop as one, so that a program's
# loads for its next tile can overlap this tile's epilogue. It stays off because it measured
# mixed: 0.4% to 9% faster without an activation, 4% slower to 4% faster with GELU, at 4,096³
# and 8,192³ (``results/nvidia-h100-80gb-hbm3/experiments/matmul_flatten.log``).
#
# The descriptor path also runs under the interpreter, so its correctness is checked below on
# the CPU as well.


@triton.jit
def matmul_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr,
    M, N, K,
    stride_a, stride_b, stride_bias,
    A_COLUMN_MAJOR: tl.constexpr, B_COLUMN_MAJOR: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PREACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, FLATTEN: tl.constexpr = False,
):  # fmt: skip
    # One descriptor per tensor. A column-major operand is described as its transpose.
    if A_COLUMN_MAJOR:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[K, M], strides=[stride_a, 1], block_shape=[BLOCK_K, BLOCK_M]
        )
    else:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
    if B_COLUMN_MAJOR:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K]
        )
    else:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N]
        )
    c_desc = tl.make_tensor_descriptor(
        c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N]
    )
    if STORE_PREACTIVATION:
        pre_desc = tl.make_tensor_descriptor(
            pre_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N]
        )

    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    # Persistent: this program takes every NUM_PROGRAMS-th tile, in the grouped order.
    for tile_id in tl.range(
        tl.program_id(axis=0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN
    ):
        pid_m, pid_n = tile_of_program(tile_id, tiles_m, tiles_n, GROUP_SIZE_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            off_k = k * BLOCK_K
            if A_COLUMN_MAJOR:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_COLUMN_MAJOR:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)

        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = add_bias(acc, bias_ptr, offs_n, N, stride_bias, HAS_BIAS)
        if STORE_PREACTIVATION:
            pre_desc.store([off_m, off_n], acc.to(pre_ptr.dtype.element_ty))
        out = kit.apply_activation(acc, ACTIVATION)
        c_desc.store([off_m, off_n], out.to(c_ptr.dtype.element_ty))


TMA_CONFIGS = [
    config(128, 128, 64, 4, 8, itemsize=2),
    config(128, 256, 64, 3, 8, itemsize=2),
    config(256, 128, 64, 3, 8, itemsize=2),
    config(128, 128, 64, 4, 4, itemsize=2),
    config(64, 128, 64, 4, 4, itemsize=2),
    config(128, 256, 128, 3, 8, itemsize=1),
    config(256, 128, 128, 3, 8, itemsize=1),
    config(128, 128, 128, 4, 8, itemsize=1),
    config(64, 128, 128, 4, 4, itemsize=1),
    config(128, 128, 32, 3, 8, itemsize=4),
    config(128, 64, 32, 4, 4, itemsize=4),
]
matmul_tma_tuned = triton.autotune(
    configs=kit.autotune_configs(TMA_CONFIGS),
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": keep_configs_for_dtype},
)(matmul_tma_kernel)

# Programs of the persistent kernel: one per SM (a few for the interpreter, to exercise the
# loop over tiles).
NUM_SMS = kit.SM_COUNT or 3


def tma_scratch(size: int, alignment: int, stream):
    """Scratch memory for descriptors made inside kernels: Triton asks for it at launch."""
    return torch.empty(size, device=DEVICE, dtype=torch.int8)


def tma_layout(tensor):
    """'row' or 'column' when a TMA descriptor can describe ``tensor``, else None."""
    itemsize = tensor.element_size()
    if tensor.data_ptr() % 16:
        return None
    rows, columns = tensor.shape
    if tensor.stride(1) == 1 and (tensor.stride(0) * itemsize) % 16 == 0:
        return "row" if columns * itemsize >= 16 else None
    if tensor.stride(0) == 1 and (tensor.stride(1) * itemsize) % 16 == 0:
        return "column" if rows * itemsize >= 16 else None
    return None


def tma_applies(a, b):
    """Can the descriptor kernel take these operands (and their M x N output)?"""
    out_itemsize = output_dtype(a.dtype).itemsize
    return (
        a.shape[1] > 0
        and tma_layout(a) is not None
        and tma_layout(b) is not None
        and (b.shape[1] * out_itemsize) % 16 == 0
    )


def matmul_tma(
    a, b, activation=None, *, bias=None, return_preactivation=False, config=None
):
    """``activation(a @ b + bias)`` with the persistent descriptor kernel (Hopper),
    autotuned unless ``config`` is given (as for ``matmul_portable``)."""
    check_inputs(a, b, activation, bias)
    if not tma_applies(a, b):
        raise ValueError(
            "the descriptor kernel needs each operand contiguous along rows or columns, "
            "other strides multiples of 16 bytes, and N * itemsize a multiple of 16 bytes: "
            "call matmul(), which falls back to the portable kernel"
        )
    return launch_tma(a, b, activation, bias, return_preactivation, config)


def launch_tma(a, b, activation, bias, return_preactivation, config):
    """The descriptor kernel's launch, for inputs that ``check_inputs`` and ``tma_applies``
    accepted."""
    out, pre = allocate_outputs(a, b, return_preactivation)
    (M, K), N = a.shape, b.shape[1]
    if out.numel() == 0:
        return (out, pre) if return_preactivation else out
    # Set at every launch: Triton keeps the allocator in a context variable, which other
    # threads, autograd's backward thread among them, do not inherit.
    triton.set_allocator(tma_scratch)
    a_column_major = tma_layout(a) == "column"
    b_column_major = tma_layout(b) == "column"
    grid = lambda meta: (
        min(NUM_SMS, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),
    )
    kernel = matmul_tma_tuned if config is None else matmul_tma_kernel
    kernel[grid](
        a, b, out, bias, pre, M, N, K,
        a.stride(1) if a_column_major else a.stride(0),
        b.stride(1) if b_column_major else b.stride(0),
        bias.stride(0) if bias is not None else 0,
        A_COLUMN_MAJOR=a_column_major,
        B_COLUMN_MAJOR=b_column_major,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        STORE_PREACTIVATION=pre is not None,
        UPCAST=kit.INTERPRET and a.dtype == torch.bfloat16,
        NUM_PROGRAMS=NUM_SMS,
        **(config or {}),
    )  # fmt: skip
    return (out, pre) if return_preactivation else out


# %%
# ``matmul`` is what the rest of the collection calls: the descriptor kernel on Hopper when
# the operands allow it and the output has at least one 128 × 128 tile per SM, the portable
# kernel everywhere else (fp8 excepted, which we only measured on the descriptor kernel).
# Below one tile per SM a persistent program has no loop over tiles to spread its descriptor
# setup over; in the recording before this rule the portable kernel was the faster of the two
# at every such size (fp16 1,024³: 178 against 150 TFLOP/s; 2 to 3 µs less per product at
# 256³ to 1,024³; the skinny family, M = 16 to 256 with N = K = 8,192: 3% to 12% faster). In
# the recording shown below, ``triton`` and ``triton (portable)`` coincide at those sizes.


def fills_the_gpu(M: int, N: int) -> bool:
    """At least one 128 × 128 tile of the M × N output per SM?"""
    return triton.cdiv(M, 128) * triton.cdiv(N, 128) >= NUM_SMS


# %%
# One exception to reading transposes through strides: fp32 on Hopper. Its tensor-core
# instruction (``wgmma``) reads 16-bit operands from shared memory in either order, but tf32
# operands only *K-major*: A with its K index contiguous (row-major), B with its K index
# contiguous (column-major). At 4,096³ on the H100 Triton's tf32 path through the descriptor
# kernel ran at 46 to 78 TFLOP/s for the three other orders of A and B, against 258 when both
# are K-major; cuBLAS ran at 255 to 363 in the four orders, and the same kernel in fp16 at 660
# to 711 (``results/nvidia-h100-80gb-hbm3/experiments/matmul_operand_order.log``). For fp32
# the wrapper therefore copies an operand that is not K-major into one that is, a pass over
# the operand: with the copy, ``matmul`` measured 173 to 209 TFLOP/s for those three orders
# (258 for the K-major one), still below cuBLAS but 2.7 to 3.8 times the uncopied kernel.


def k_major_for_tf32(a, b):
    """``a`` and ``b`` with K contiguous, copying whichever is not (fp32 on Hopper)."""
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(0) != 1:
        b = b.mT.contiguous().mT
    return a, b


def matmul(a, b, activation=None, *, bias=None, return_preactivation=False):
    """``activation(a @ b + bias)`` for 2-D ``a`` (M, K) and ``b`` (K, N) of any strides.

    fp16, bf16 and fp32 (as tf32 on a GPU) with fp32 accumulation, and fp8 (e4m3) on GPUs
    that have it. The bias (N,) and the activation (one of ``kit.ACTIVATIONS``) are applied
    in fp32 before the single rounding to the output dtype: ``a.dtype``, or bf16 for fp8.
    With ``return_preactivation`` it returns ``(out, a @ b + bias)``, both from one kernel.
    """
    check_inputs(a, b, activation, bias)
    use_tma = ON_HOPPER and tma_applies(a, b)
    if (
        a.dtype.itemsize > 1
    ):  # measured for 2-byte types; fp8 stays on the descriptor kernel
        use_tma = use_tma and fills_the_gpu(a.shape[0], b.shape[1])
    if use_tma and a.dtype == torch.float32:
        a, b = k_major_for_tf32(a, b)
    launch = launch_tma if use_tma else launch_portable
    config = _fixed_configs and _fixed_configs[a.dtype.itemsize]
    return launch(a, b, activation, bias, return_preactivation, config=config)


_fixed_configs = None  # itemsize -> config, set by pin_configs


def pin_configs(configs):
    """From now on ``matmul`` launches ``configs[itemsize]`` instead of autotuning (None:
    autotune again). For checks over many small shapes, where tuning each takes minutes."""
    global _fixed_configs
    _fixed_configs = configs


# %%
# Correctness
# -----------
# We compare with the product computed in fp64 from the same (rounded) inputs, the bias
# added and the activation applied in fp64 too. The kernels accumulate in fp32 and round
# once at the end, so the error is about one rounding of the output plus the fp32
# accumulation error. Products of ``randn`` inputs are about sqrt(K) in size, so absolute
# tolerances scale with sqrt(K):
#
# * fp16: rtol = atol / sqrt(K) = 2^-10 (two units in the last place of the output);
# * bf16 and fp8 (bf16 output): 2^-7, two units of bf16;
# * fp32: 1e-5 under the interpreter (true fp32); on a GPU the inputs are rounded to tf32
#   (a relative error of 2^-11 each), so 2^-8 there.
#
# The shapes are the ones that break naive kernels: a 1 × 1 × 1 product, M = 1 and N = 1,
# K = 1 and small odd K, sizes that are not multiples of any block size and sizes that span
# several blocks and several K-steps; each with A and B as they are, transposed views, and a
# slice with a row stride larger than its width. Every call adds a bias, cycles through the
# activations, and asks for the pre-activation, which is checked too. Each kernel is checked
# on its own: the portable one everywhere, the descriptor one on Hopper and under the
# interpreter. bf16 is checked on the GPU only (the interpreter's bf16 ``tl.dot`` returns
# garbage; ``UPCAST`` works around it, but then we would not be testing the real path).


def tolerance(dtype: torch.dtype, K: int) -> dict:
    if dtype == torch.float16:
        unit = 2**-10
    elif dtype in (torch.bfloat16, torch.float8_e4m3fn):
        unit = 2**-7
    else:
        unit = 1e-5 if kit.INTERPRET else 2**-8
    return {"rtol": unit, "atol": unit * max(K, 1) ** 0.5}


def reference(a, b, activation=None, bias=None):
    """activation(a @ b + bias) in fp64, and the pre-activation."""
    pre = a.double() @ b.double()
    if bias is not None:
        pre = pre + bias.double()
    return kit.activation_reference(pre, activation), pre


def layouts(a, b):
    """The same product with A and B as given, transposed in memory, and row-strided."""
    yield "contiguous", a, b
    yield "a.t(), b.t() views", a.t().contiguous().t(), b.t().contiguous().t()
    padded = torch.zeros(a.shape[0], a.shape[1] + 8, device=a.device, dtype=a.dtype)
    padded[:, : a.shape[1]] = a
    yield "row-strided a", padded[:, : a.shape[1]], b


# On a GPU the checks run one fixed config per dtype: autotuning each of the dozens of
# shape, layout and activation variants below would compile and time every config for each,
# minutes of tuning that checks nothing more. The two large shapes go through autotuning.
CHECK_CONFIGS = {
    itemsize: {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128 // itemsize}
    | {"GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 3}
    for itemsize in (1, 2, 4)
}


def check(kernel, dtype, shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for index, (M, N, K) in enumerate(shapes):
        a = torch.randn(M, K, generator=generator).to(DEVICE, dtype)
        b = torch.randn(K, N, generator=generator).to(DEVICE, dtype)
        bias = torch.randn(N, generator=generator).to(DEVICE, torch.float32)
        activation = kit.ACTIVATIONS[index % len(kit.ACTIVATIONS)]
        expected, expected_pre = reference(a, b, activation, bias)
        for _, a_view, b_view in layouts(a, b):
            if kernel is matmul_tma and not tma_applies(a_view, b_view):
                continue
            small = kit.ON_GPU and M * N < 2**20
            out, pre = kernel(
                a_view,
                b_view,
                activation,
                bias=bias,
                return_preactivation=True,
                config=CHECK_CONFIGS[dtype.itemsize] if small else None,
            )
            assert out.shape == (M, N) and out.dtype == output_dtype(dtype)
            assert out.is_contiguous()
            tol = tolerance(dtype, K)
            torch.testing.assert_close(out.double(), expected, **tol)
            torch.testing.assert_close(pre.double(), expected_pre, **tol)


check_dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if kit.ON_GPU else [])
check_shapes = [
    (1, 1, 1),
    (1, 136, 48),
    (96, 1, 64),
    (33, 40, 1),
    (50, 24, 13),
    (77, 136, 48),
    (130, 264, 200),
] + kit.choose(gpu=[(1000, 1500, 700), (2048, 3000, 4096)], cpu=[])
check_kernels = [matmul_portable] + ([matmul_tma] if ON_HOPPER or kit.INTERPRET else [])
if not kit.loaded_by_another_chapter():  # chapter 05 imports this one for matmul alone
    for kernel in check_kernels:
        for dtype in check_dtypes:
            check(kernel, dtype, check_shapes)
    names = ", ".join(kit.dtype_name(d) for d in check_dtypes)
    print(
        f"{len(check_kernels)} kernels x {len(check_dtypes)} dtypes ({names}) x "
        f"{len(check_shapes)} shapes x 3 layouts match fp64 within tolerance"
    )

# %%
# fp8 is checked apart, with B column-major, the layout the Hopper tensor cores want for fp8
# and the one ``torch._scaled_mm`` requires. Values are scaled so that they use the e4m3
# range (largest finite value 448) without overflowing it.

if HAS_FP8 and not kit.loaded_by_another_chapter():
    for M, N, K in [(64, 96, 128), (77, 136, 48)] + kit.choose(
        gpu=[(1000, 1536, 704)], cpu=[]
    ):
        a8 = (torch.randn(M, K, device=DEVICE) * 4).to(torch.float8_e4m3fn)
        b8 = (torch.randn(N, K, device=DEVICE) * 4).to(torch.float8_e4m3fn).t()
        expected, _ = reference(a8, b8)
        tol = tolerance(torch.float8_e4m3fn, K)
        tol["atol"] *= 16  # the inputs are 4x larger, so the products are 16x
        torch.testing.assert_close(matmul(a8, b8).double(), expected, **tol)
    print("fp8 (e4m3) inputs with bf16 output match fp64 within tolerance")

# %%
# And the inputs the wrapper cannot take are refused with a message, not answered wrongly:

a = torch.randn(8, 16, device=DEVICE)
b = torch.randn(16, 4, device=DEVICE)
bad_calls = {
    "inner dims differ": lambda: matmul(a, b[:-1]),
    "dtypes differ": lambda: matmul(a, b.half()),
    "integer dtype": lambda: matmul(a.int(), b.int()),
    "not 2-D": lambda: matmul(a[None], b),
    "wrong device": lambda: matmul(a.to("meta"), b.to("meta")),
    "bias length": lambda: matmul(a, b, bias=torch.zeros(5, device=DEVICE)),
    "activation": lambda: matmul(a, b, activation="tanh"),
}
kit.show_refusals("matmul()", bad_calls)

# %%
# What autotuning costs
# ---------------------
# The first call for a new (M, N, K) and dtype times every config that survives the prune;
# the first call of a process also compiles them (a second or two each, cached on disk
# afterwards). We time the first call of ``matmul`` at a few square fp16 sizes, and a later
# call of the same shape, and report the difference as the tuning cost of that shape.


def autotune_cost(size: int, dtype=torch.float16) -> tuple[float, float]:
    x = torch.randn(size, size, device=DEVICE, dtype=dtype)
    y = torch.randn(size, size, device=DEVICE, dtype=dtype)
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        matmul(x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[0], times[1]


if kit.ON_GPU and not kit.loaded_by_another_chapter():
    for size in (1024, 4096, 8192):
        first, later = autotune_cost(size)
        print(
            f"fp16 {size}^3: first call {first:.2f} s, later call {later * 1e3:.2f} ms: "
            f"autotuning took {first - later:.2f} s"
        )
else:
    print("Under the interpreter there is one config and nothing to time.")

# %%
# Benchmark: square matrices
# --------------------------
# We time ``matmul`` (``triton``; on the H100 the descriptor kernel from 2,048³ up and the
# portable one below, as ``fills_the_gpu`` decides), the portable kernel on its own
# (``triton (portable)``), ``torch.matmul`` (cuBLAS) and ``torch.compile(torch.mm)``
# from 256³ to 8,192³ in fp16 and bf16, counting 2·M·N·K FLOPs per call. ``torch.compile``
# runs in its default mode, which hands a lone matmul to cuBLAS, so its line is a second
# measurement of cuBLAS; the ``max-autotune`` modes, which would also try Triton templates,
# take minutes to tune and we leave them out. The H100 recording shown here times the GPU
# work of each call, replayed from a CUDA graph with the L2 cache flushed before every replay
# (How we measure): the Python on a call's path (input checks, the autotuner's lookup) is not
# in these numbers. The dashed line is cuBLAS fp16 at 4,096³ on the same GPU, timed as plain
# calls.


def make_square(provider: str, size: int, dtype: torch.dtype):
    x = torch.randn(size, size, device=DEVICE, dtype=dtype)
    y = torch.randn(size, size, device=DEVICE, dtype=dtype)
    if provider == "torch.compile":
        compiled_mm = kit.compile_static(torch.mm)
        compiled_mm(x, y)  # compile before the timing
        return lambda: compiled_mm(x, y)
    return {
        "triton": lambda: matmul(x, y),
        "triton (portable)": lambda: matmul_portable(x, y),
        "torch": lambda: torch.matmul(x, y),
    }[provider]


def matmul_flops(size: int, dtype: torch.dtype) -> int:
    return 2 * size**3


square = kit.Benchmark(
    name="matmul-square",
    x_name="M = N = K",
    x_values=[256, 512, 1024, 2048, 3072, 4096, 6144, 8192],
    providers=["triton", "triton (portable)", "torch", "torch.compile"],
    make=make_square,
    work=matmul_flops,
    unit="TFLOP/s",
    dtypes=(torch.float16, torch.bfloat16),
    smoke_x=64,
    headline_x=4096,
)
kit.run(square)

# %%
# What the H100 recording shows (the table in the README has every point):
#
# * At 4,096³ the descriptor kernel runs at 668 TFLOP/s in fp16 and 696 in bf16, against 666
#   and 716 for ``torch.matmul`` in the same sweep: 100% and 97% of cuBLAS. One cuBLAS shape
#   is not one number, though: the limit line, cuBLAS fp16 at 4,096³ in the same process, is
#   697, and the ``torch.compile`` line, cuBLAS again, 697 (fp16) and 743 (bf16). Read 4,096³
#   as level with cuBLAS or a few percent behind it, not a win.
# * At 8,192³ we are ahead of ``torch.matmul`` in fp16 (658 against 626, 105%; the
#   ``torch.compile`` line measured 657) and behind in bf16 (588 against 669, 88%). Our code
#   and config list are the same for both dtypes (which config the autotuner chose is not
#   recorded). The recording before this one had 631 (fp16) and 615 (bf16) for us, 639 and
#   716 for cuBLAS; the ``FLATTEN`` experiment's plain loop (one fixed config, plus a bias)
#   measured 662 and 679. Differences of this size between runs and dtypes at 8,192³ are seen
#   on this GPU, and we have not measured their cause. At 6,144³ we reach 97% in fp16 (608
#   against 626) and 108% in bf16 (702 against 653).
# * The portable kernel reaches 560 (fp16) and 622 (bf16) at 4,096³: TMA and the persistent
#   loop are worth 19% and 12% there, 8% and 16% at 6,144³, and 8% in fp16 at 8,192³ (611);
#   in bf16 at 8,192³ the two kernels tie (590 portable, 588 descriptor).
# * We lose at 3,072³: 543 against 693 in fp16 (78%), 547 against 720 in bf16 (76%). The tile
#   counts are uneven there: 3,072 is 24 tiles of 128 per side, so 128 × 128 tiles make 576
#   tiles for 132 SMs, 4.4 waves, and 576 of the 660 program slots of five waves do work
#   (87%); 128 × 256 tiles make 288, 2.2 waves, 288 of 396 slots (73%). Which config the
#   autotuner chose is not recorded, so we cannot say how much of the gap this is.
# * At 2,048³ we reach 91% of cuBLAS in both dtypes (536 against 592 in fp16, 543 against 594
#   in bf16). Below that ``matmul`` runs the portable kernel: 84% of cuBLAS at 1,024³ in fp16
#   (180 against 216) and 82% in bf16 (175 against 213), 94% and 99% at 512³, and at 256³ 96%
#   in fp16 but 76% in bf16 (3.6 against 4.8). In time that is about 2 µs more per product at
#   1,024³ (11.9 against 10.0 µs in fp16) and at 256³ in bf16 (9.2 against 7.0 µs); we have
#   not measured where those microseconds go.
# * The ``torch.compile`` line, compiled afresh for each shape, is within 6% of
#   ``torch.matmul`` at every size but 6,144³, where it measured 674 against 626 in fp16 and
#   697 against 653 in bf16 (8% and 7% more). Both are cuBLAS, and we have not looked into why
#   they differ there; the spread is a reason to read a few percent either way against cuBLAS
#   as a tie.
#
# Against our floors: 95% of cuBLAS at 4,096³ and 8,192³ is met in fp16 (100% and 105%) and at
# 4,096³ in bf16 (97%; 94% against the ``torch.compile`` line), and missed at 8,192³ in bf16
# (88%). 85% of cuBLAS from 1,024³ up is met at 2,048³, 4,096³, 6,144³ and 8,192³ in both
# dtypes, and missed at 1,024³ (84% in fp16, 82% in bf16) and 3,072³ (78% in fp16, 76% in
# bf16).
#
#
# Benchmark: what the program order is worth
# ------------------------------------------
# The same portable kernel with one fixed config (128 × 256 × 64 tiles, 3 stages, 8 warps),
# launched once with ``GROUP_SIZE_M = 1`` (row-major order) and once with 8, in fp16.

ORDER_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64} | {
    "num_stages": 3,
    "num_warps": 8,
}


def make_order(provider: str, size: int, dtype: torch.dtype):
    group_size_m = int(provider.split("=")[1].rstrip(")"))
    x = torch.randn(size, size, device=DEVICE, dtype=dtype)
    y = torch.randn(size, size, device=DEVICE, dtype=dtype)
    settings = ORDER_CONFIG | {"GROUP_SIZE_M": group_size_m}
    if kit.INTERPRET:  # small blocks for the smoke run
        settings |= {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    return lambda: matmul_portable(x, y, config=settings)


program_order = kit.Benchmark(
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
kit.run(program_order)

# %%
# With ``GROUP_SIZE_M = 8`` the kernel gains under 1% at 2,048³ and 4,096³, where A and B (16
# and 64 MB together) fit or nearly fit in the 50 MB L2 anyway, 6% at 8,192³ (596 against 563
# TFLOP/s) and 63% at 16,384³ (605 against 371). With 128 × 256 tiles a row of C at 16,384³ has
# 64 tiles, so in row-major order the 132 programs in flight span about two rows of tiles and
# all 64 column panels of B: at each K-step they fetch 2 slices of A and 64 of B, each B slice
# used by two programs. Grouped 8 rows deep, the same 132 programs span 8 row panels and about
# 17 column panels: 25 slices per K-step instead of 66, each used 8 or 17 times, and the L2
# cache serves the repeats.
#
# Benchmark: skinny matrices
# --------------------------
# A batch of M tokens through an 8,192 × 8,192 weight: M = 16 to 256, N = K = 8,192. Here
# the arithmetic of the first section turns around. The weight is 134 MB in fp16 and must be
# read whatever M is, while the FLOPs grow with M: at M = 16 the product is 2.1 GFLOP for
# 134 MB, 16 FLOPs per byte, and at 3.0 TB/s the ceiling is about 48 TFLOP/s. These shapes
# are memory bound; what matters is to read B once, at full bandwidth, with enough programs
# to keep every SM's loads in flight.


SKINNY_SIZE = kit.choose(gpu=8192, cpu=64)  # N = K


def make_skinny(provider: str, m: int, dtype: torch.dtype):
    x = torch.randn(m, SKINNY_SIZE, device=DEVICE, dtype=dtype)
    y = torch.randn(SKINNY_SIZE, SKINNY_SIZE, device=DEVICE, dtype=dtype)
    return {
        "triton": lambda: matmul(x, y),
        "triton (portable)": lambda: matmul_portable(x, y),
        "torch": lambda: torch.matmul(x, y),
    }[provider]


skinny = kit.Benchmark(
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
kit.run(skinny)

# %%
# None of these outputs has 132 tiles of 128 × 128 (M = 256 gives 2 × 64 = 128), so ``matmul``
# runs the portable kernel and the two Triton lines coincide. It trails cuBLAS at every M, at
# 90 to 96%: 34.6 against 36.5 TFLOP/s at M = 16, 138 against 145 at M = 64, 489 against 542 at
# M = 256. At M = 16 the bandwidth bound is about 48 TFLOP/s, so ours runs at 72% of it and
# cuBLAS at 76%. The descriptor kernel would do worse here: its tiles are at least 128 columns
# wide, so for M up to 64 an 8,192-wide C gives it at most 64 programs for 132 SMs, and half
# the GPU issues no loads (in the recording before the small-output rule it ran at 85 to 88%
# of cuBLAS). The portable list's 64 × 64 tile makes 128 programs for M up to 64. Split-K
# (exercise 1) would add programs along K as well; neither kernel has it yet.
#
#
# Benchmark: fp8
# --------------
# fp8 (e4m3) halves the bytes again and doubles the tensor-core rate: about 1,980 dense
# TFLOP/s on the H100's data sheet. We compare ``matmul`` on fp8 inputs (B column-major,
# bf16 output) with ``torch._scaled_mm``, PyTorch's fp8 matmul, which wants the same layout
# plus one fp32 scale per operand (we pass 1.0: our inputs are already in range).


def make_fp8(provider: str, size: int, dtype: torch.dtype):
    x = (torch.randn(size, size, device=DEVICE) * 4).to(dtype)
    y = (torch.randn(size, size, device=DEVICE) * 4).to(dtype).t()  # column-major
    one = torch.ones((), device=DEVICE)
    return {
        "triton": lambda: matmul(x, y),
        "torch": lambda: torch._scaled_mm(x, y, one, one, out_dtype=torch.bfloat16),
    }[provider]


fp8 = kit.Benchmark(
    name="matmul-fp8",
    x_name="M = N = K",
    x_values=[1024, 2048, 4096, 8192],
    providers=["triton", "torch"],
    make=make_fp8,
    work=matmul_flops,
    unit="TFLOP/s",
    dtypes=(torch.float8_e4m3fn,),
    smoke_x=64,
    headline_x=8192,
)
if HAS_FP8:
    kit.run(fp8)
else:
    print("This GPU has no fp8 tensor cores (compute capability below 8.9): skipped.")

# %%
# At 4,096³ and 8,192³ our fp8 kernel is ahead of ``torch._scaled_mm`` by 2% and 1%: 1,250
# against 1,222 and 1,203 against 1,190 TFLOP/s, 1.9 and 1.8 times our fp16 kernel at the same
# sizes and 63% and 61% of the data sheet's 1,980. The floor of 1,200 TFLOP/s at 8,192³ is met,
# by 3 TFLOP/s. It trails at 2,048³ (800 against 866, 92%) and at 1,024³ (182 against 234,
# 78%): 1.6 and 2.6 µs more per product (21.5 against 19.8 µs, 11.8 against 9.2).
#
#
# What we learned
# ---------------
# * A matmul is compute bound only if its tiles are large and reused: a program computes a
#   BLOCK_M × BLOCK_N tile of C from panels of A and B, read through 2-D blocks of pointers
#   that follow any strides.
# * The order in which programs take their tiles decides what the L2 cache holds; a grouped
#   order reads fewer distinct panels for the same work.
# * Autotuning picks tile shapes, warps and pipeline depth per shape and dtype, at a cost paid
#   on the first call of each shape.
# * The epilogue is free real estate: bias, activation and a second output cost a few
#   instructions per element after the K loop, and save whole passes over C.
# * On Hopper, tensor descriptors hand the copies to the TMA engine and persistent programs
#   remove launch tails, once the output has a tile for every SM; below that, and on every
#   other GPU, the portable kernel is the one to run.
#
# Exercises
# ---------
# 1. Split-K: for the skinny shapes, give each program a slice of K as well as a tile of C
#    and add the partial tiles with ``tl.atomic_add`` into an fp32 buffer. How many programs
#    does M = 16 then launch, and what happens to the bandwidth?
# 2. Add per-row and per-column fp32 scales for fp8 inputs (as ``torch._scaled_mm`` takes)
#    to the epilogue, and check against ``_scaled_mm`` with non-unit scales.
# 3. Fuse a residual: ``out = activation(a @ b + bias) + residual`` with ``residual`` an M × N
#    tensor. How many bytes does it save against a separate addition, at 4,096³ and at
#    M = 16?
