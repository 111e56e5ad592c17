r"""
Matrix multiplication on Hopper: tensor descriptors, persistent programs, fp8
=============================================================================

We write the kernel that chapter 04's ``matmul`` hands large products to on an H100: the same
tiles, program order and fused epilogue, with the copies done by Hopper's TMA engine through
*tensor descriptors*, one persistent program per SM, and fp8 inputs.

What you will learn:

* tensor descriptors: describing a matrix once and letting the hardware copy its tiles, edges
  included;
* persistent programs: one program per SM looping over tiles, and when that beats one program
  per tile;
* the last wave: splitting its tiles along K so that no SM idles, the partial tiles summed by
  whichever share arrives last; a weight gradient's few tiles split the same way;
* why fp32 as tf32 wants its operands *K-major* on Hopper, and what a copy buys;
* fp8 (e4m3): half the bytes of fp16 and twice the tensor-core rate, and how to compare it.

Prerequisites: chapter 04 (the portable kernel, its program order and epilogue). The kernel needs
compute capability 9.x (Hopper) to be fast, but it also runs under Triton's interpreter, so
without a GPU every cell runs at a small size.
"""

# %%
# Setup
# -----

from stepkernels.lessons import bench, check_matmul, tutorial
from stepkernels.ops.matmul import ON_HOPPER, matmul
import torch
import triton
import triton.language as tl

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# What the portable kernel leaves on the table
# --------------------------------------------
# On an H100 chapter 04's kernel spends effort in three places where Hopper has hardware:
#
# * **Address arithmetic.** Every K-step computes a block of 2-D pointers and issues the loads
#   from the program's threads. Hopper's *TMA* (Tensor Memory Accelerator) is a copy engine that
#   takes a *tensor descriptor* (base address, shape, strides, tile shape) and a tile coordinate,
#   and copies the tile from global to shared memory by itself, filling zeros past the edges.
#   ``tl.make_tensor_descriptor`` builds the descriptor inside the kernel and
#   ``desc.load([row, column])`` issues the copy; the threads are free for the tensor cores, and
#   no masks are needed.
# * **Launch tails.** One program per tile means that the last wave of programs may use only part
#   of the GPU, and every program pays its prologue (filling the pipeline) and epilogue without
#   overlap. A *persistent* kernel launches one program per SM, and each program loops over tiles
#   ``pid, pid + NUM_PROGRAMS, pid + 2 * NUM_PROGRAMS, ...`` in chapter 04's grouped order.
# * **The epilogue.** A TMA store writes the finished tile of C, clipped at the edges.
#
# The descriptor needs the last dimension of each tensor to be contiguous and every other stride
# to be a multiple of 16 bytes. A transposed operand (``x.t()``, contiguous along its rows) is
# described as the matrix it really is; its tiles are loaded in that layout and transposed in
# registers (``.T``), which costs nothing, since the tensor cores read either order from shared
# memory. The bias, one value per column, is loaded with pointers as in chapter 04.
#
# The kernel
# ----------
# The cells marked ``# @save ops/matmul_hopper`` make the package's ``matmul_hopper`` module.
# It reuses chapter 04's tile order, bias and configs from ``stepkernels.runtime.tiles``. The
# epilogue's helper takes its arguments in groups: the descriptors of the outputs, the bias
# (pointer, length, stride) and the epilogue's four flags as one ``Epilogue``.

# @save ops/matmul_hopper
from typing import NamedTuple

from stepkernels.ops.matmul_tuning import (
    SHARE_STEPS,
    programs,
    tma_autotuned,
)
from stepkernels.runtime.activations import apply_activation
from stepkernels.runtime.core import INTERPRET, sm_count, zeroed
from stepkernels.runtime.launch import lean
from stepkernels.runtime.tiles import (
    add_bias,
    allocate_outputs,
    check_inputs,
    dot_precision,
    output_dtype,
    tile_config,
    tile_of_program,
)
import torch
import triton
import triton.language as tl


class Epilogue(NamedTuple):
    """What a tile's epilogue does, as ``finish_columns`` takes it (chapter 04's
    flags)."""

    ACTIVATION: tl.constexpr  # None, "relu", "gelu"...
    HAS_BIAS: tl.constexpr
    STORE_PREACTIVATION: tl.constexpr  # also write A B + bias, for the backward
    ACCUMULATE: tl.constexpr  # C += A B


@triton.jit
def matmul_tma_kernel(
    a_ptr,  # A (M x K), B (K x N), C (M x N)
    b_ptr,
    c_ptr,
    bias_ptr,  # N values, or unused
    pre_ptr,  # the pre-activation (M x N), or unused
    partial_ptr,  # fp32 scratch: the partial tiles of a split tail
    counter_ptr,  # int32 zeros: one counter a tail tile
    M,
    N,
    K,
    stride_a,  # between rows of A, or its columns if A_COLUMN_MAJOR
    stride_b,
    stride_bias,
    A_COLUMN_MAJOR: tl.constexpr,
    B_COLUMN_MAJOR: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PREACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # of tl.dot: "ieee", "tf32"...
    UPCAST: tl.constexpr,  # bf16 to fp32 before tl.dot (the interpreter's)
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,  # chapter 04's program order
    ACCUMULATE: tl.constexpr = False,
    SPLIT_TAIL: tl.constexpr = False,  # the last wave split along K (below)
    MAX_SPLITS: tl.constexpr = 8,  # matmul_tuning's: a literal, as torch.compile copies it
    PROGRAMS_PER_SM: tl.constexpr = 1,
):
    NUM_PROGRAMS: tl.constexpr = NUM_SMS * PROGRAMS_PER_SM  # the grid
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
    # C is written in tiles of half the columns (the epilogue below).
    c_desc = tl.make_tensor_descriptor(
        c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 2]
    )
    pre_desc = c_desc  # unused unless STORE_PREACTIVATION
    if STORE_PREACTIVATION:
        pre_desc = tl.make_tensor_descriptor(
            pre_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 2]
        )
    outputs, bias = (c_desc, pre_desc), (bias_ptr, N, stride_bias)
    EPILOGUE: tl.constexpr = Epilogue(
        ACTIVATION, HAS_BIAS, STORE_PREACTIVATION, ACCUMULATE
    )

    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    whole, splits = tiles_m * tiles_n, 1
    if SPLIT_TAIL:  # a config's choice, made by the autotuner (below)
        whole, splits = tail_split(tiles_m * tiles_n, k_steps, NUM_PROGRAMS, MAX_SPLITS)
    work = whole + (tiles_m * tiles_n - whole) * splits
    # Persistent: this program takes every NUM_PROGRAMS-th item of work: the first
    # ``whole`` tiles in the grouped order, then (when the last wave is split) a share of
    # the K steps of a tail tile, at most one a program.
    for item in tl.range(tl.program_id(axis=0), work, NUM_PROGRAMS):
        tile_id, k_first, k_last = item, 0, k_steps
        if SPLIT_TAIL:
            share = item - whole  # from 0 on: share ``share % splits`` of a tail tile
            tile_id = tl.where(share >= 0, whole + share // splits, item)
            k_first = tl.where(share >= 0, share % splits * k_steps // splits, 0)
            k_last = tl.where(
                share >= 0, (share % splits + 1) * k_steps // splits, k_steps
            )
        pid_m, pid_n = tile_of_program(tile_id, tiles_m, tiles_n, GROUP_SIZE_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_first, k_last):
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
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        finish = True
        if SPLIT_TAIL:  # the last share of a tail tile to arrive finishes it
            acc, finish = add_shares(
                acc, partial_ptr, counter_ptr, share, splits, BLOCK_M, BLOCK_N
            )
        if finish:  # two halves of the columns in turn: fewer registers live at once
            left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            finish_columns(left, outputs, off_m, off_n, bias, EPILOGUE)
            finish_columns(right, outputs, off_m, off_n + BLOCK_N // 2, bias, EPILOGUE)


@triton.jit
def finish_columns(acc, outputs, off_m, off_n, bias, EPILOGUE: tl.constexpr):
    """The epilogue of the columns of a tile from ``off_n``: bias, C + A B, the
    pre-activation, the activation, the store. ``outputs``: the descriptors of C and of
    the pre-activation; ``bias``: its pointer, N and its stride."""
    c_desc, pre_desc = outputs
    bias_ptr, N, stride_bias = bias
    offs_n = off_n + tl.arange(0, acc.shape[1])
    acc = add_bias(acc, bias_ptr, offs_n, N, stride_bias, EPILOGUE.HAS_BIAS)
    if EPILOGUE.ACCUMULATE:  # C += A B (chapter 04)
        acc += c_desc.load([off_m, off_n]).to(tl.float32)
    if EPILOGUE.STORE_PREACTIVATION:
        pre_desc.store([off_m, off_n], acc.to(pre_desc.dtype))
    out = apply_activation(acc, EPILOGUE.ACTIVATION, c_desc.dtype)
    c_desc.store([off_m, off_n], out.to(c_desc.dtype))


# %%
# The epilogue takes half of a tile's columns at a time (``finish_columns``): with 128 × 256 tiles
# a thread holds 128 fp32 values of the tile, and with GELU those values, their activation and
# their 16-bit copy do not fit in its 255 registers at once: they spill. Half of them fit.
#
# The last wave
# -------------
# Persistent programs do not remove the launch tail, they move it: at 3,072³ with 128 × 256 tiles
# there are 288 tiles for 132 SMs, two full waves and a third of 24 tiles, during which 108 SMs
# idle. This is where chapter 04's benchmark has us furthest behind cuBLAS. So a kernel compiled
# with ``SPLIT_TAIL`` *splits* the last wave's tiles along K when that wave would leave half of the
# SMs idle or more (split-K for the tail only, as stream-K schedules do): each tail tile becomes
# ``splits`` shares of its K steps, one a program (at most ``MAX_SPLITS``, at least 4 K steps).
#
# Each share stores its fp32 partial tile in a scratch buffer and counts itself in with an atomic
# add on the tile's counter; the share that arrives last (the atomic returns ``splits - 1``) sums
# the partial tiles in share order, so that the result does not depend on who came last, runs the
# epilogue and sets the counter back to zero for the next launch. Nobody waits. ``publish`` in
# chapter 02 is the same pattern: a barrier so that every thread has stored, then an atomic whose
# *release* makes the stores visible to the program that *acquires*.


# @save ops/matmul_hopper
@triton.jit
def tail_split(tiles, k_steps, NUM_PROGRAMS: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """(tiles done whole, shares a tail tile): the last wave's tiles are split when it
    would leave half the programs idle or more."""
    tail = tiles % NUM_PROGRAMS
    splits = tl.minimum(NUM_PROGRAMS // tl.maximum(tail, 1), MAX_SPLITS)
    splits = tl.maximum(tl.minimum(splits, k_steps // SHARE_STEPS), 1)
    splits = tl.where(tail == 0, 1, splits)
    return tl.where(splits > 1, tiles - tail, tiles), splits


@triton.jit
def add_shares(
    acc,
    partial_ptr,
    counter_ptr,
    share,
    splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """For a share of a tail tile (``share`` >= 0): store it and count it in. The last
    share of its tile to arrive gets the sum of all of them and True, the others False.
    A whole tile (``share`` < 0) gets its own ``acc`` and True."""
    finish = share < 0
    if share >= 0:
        part = share % splits
        tile = (
            partial_ptr
            + (share - part) * BLOCK_M * BLOCK_N  # a tile's shares are consecutive
            + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
            + tl.arange(0, BLOCK_N)[None, :]
        )
        tl.store(tile + part * BLOCK_M * BLOCK_N, acc)
        tl.debug_barrier()  # every thread of this program has stored
        arrived = tl.atomic_add(counter_ptr + share // splits, 1, sem="acq_rel")
        finish = arrived == splits - 1
        if finish:
            acc = tl.load(
                tile, cache_modifier=".cg"
            )  # from L2, where the others stored
            for other in range(1, splits):
                acc += tl.load(tile + other * BLOCK_M * BLOCK_N, cache_modifier=".cg")
            tl.store(counter_ptr + share // splits, 0)  # ready for the next launch
    return acc, finish


# %%
# The configs are chapter 04's minus its smallest tiles: this kernel only runs when the output has
# a 128 × 128 tile for every SM (fp8 excepted), where small tiles do not win. For tf32 the K
# step is 32 values, the bytes of a 16-bit step of 64; its tiles, 128 × 256 and 128 × 128 in
# deeper pipelines, were the fastest in the fused linear's products. Each
# tile comes twice, with and without ``SPLIT_TAIL``, and the autotuner keeps the faster: the
# split's code costs registers (with GELU on 128 × 256 tiles it spills), which a product
# without a split tail should not pay. It times a split config only where its tail would
# split (``tma_autotuned``, in ``matmul_tuning``).
#
# One fp16 config runs *two* programs an SM (``PROGRAMS_PER_SM``): 128 × 128 tiles in 3 stages fit
# an SM's shared memory twice, and while one program runs a tile's epilogue the other's products
# keep the tensor cores busy, an overlap cuBLAS gets from specialized warps (Triton 3.6 does not
# specialize warps on Hopper). It wins at small K and at 3,072³ and loses from K = 4,096 on, so
# it is one more config for the autotuner; in tf32 two programs an SM never won.

# @save ops/matmul_hopper
TMA_CONFIGS = [
    tile_config(128, 128, 64, 4, 8, itemsize=2),
    tile_config(128, 256, 64, 3, 8, itemsize=2),
    tile_config(256, 128, 64, 3, 8, itemsize=2),
    tile_config(128, 128, 64, 4, 4, itemsize=2),
    tile_config(64, 128, 64, 4, 4, itemsize=2),
    tile_config(128, 256, 128, 3, 8, itemsize=1),
    tile_config(256, 128, 128, 3, 8, itemsize=1),
    tile_config(128, 128, 128, 4, 8, itemsize=1),
    tile_config(64, 128, 128, 4, 4, itemsize=1),
    tile_config(128, 128, 32, 3, 8, itemsize=4),
    tile_config(128, 64, 32, 4, 4, itemsize=4),
    tile_config(128, 128, 32, 5, 8, itemsize=4),
    tile_config(128, 128, 32, 4, 8, itemsize=4),
    tile_config(64, 256, 32, 4, 8, itemsize=4),
    tile_config(128, 256, 32, 3, 8, itemsize=4),
]


def with_constants(config, **constants):
    """``config`` with more constexprs set: a config of its own for the autotuner."""
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    made = triton.Config({**config.kwargs, **constants}, **options)
    made.itemsize = config.itemsize
    return made


def scratch_per_sm(config: dict) -> int:
    """Partial-tile values that ``config``'s programs on one SM may store (split
    tail)."""
    return config.get("PROGRAMS_PER_SM", 1) * config["BLOCK_M"] * config["BLOCK_N"]


TMA_CONFIGS.append(
    with_constants(tile_config(128, 128, 64, 3, 8, 2), PROGRAMS_PER_SM=2)
)
TMA_CONFIGS += [with_constants(config, SPLIT_TAIL=True) for config in TMA_CONFIGS]
# Autotuned as chapter 04's kernel is; lean: cheap repeated launches (chapter 08).
matmul_tma_tuned = lean(tma_autotuned(matmul_tma_kernel, TMA_CONFIGS))
SCRATCH_PER_SM = max(scratch_per_sm(c.kwargs) for c in TMA_CONFIGS)
MOST_PER_SM = max(c.kwargs.get("PROGRAMS_PER_SM", 1) for c in TMA_CONFIGS)


# %%
# The launcher
# ------------
# ``tma_layout`` says whether a descriptor can describe an operand, and how (row- or
# column-major); ``tma_applies`` asks it of both operands and of the output. The grid is one
# program per SM, or two for a config that asks (under the interpreter ``sm_count()`` is 4, so
# the loop over tiles still takes several turns). The tail's counters come from
# ``_core.zeroed``, kept per stream and zeroed once. Descriptors built inside a kernel need a
# little global scratch memory, which Triton asks for through ``triton.set_allocator``.
#
# One exception to reading transposes through strides: fp32 as tf32. Hopper's tensor-core
# instruction (``wgmma``) reads 16-bit operands from shared memory in either order, but tf32
# operands only *K-major*: A with its K index contiguous (row-major), B with its K index contiguous
# (column-major). Other orders run slowly, so ``tma_operands`` copies an fp32 operand that is not
# K-major into one that is when the dot runs as tf32. torch's ``contiguous()`` moves a transposed
# fp32 matrix at under a TB/s, so the copy is ours, ``row_major``: a program loads a tile along the
# source's contiguous axis and stores it along the copy's rows, through shared memory, at a plain
# copy's speed.


# @save ops/matmul_hopper
@lean
@triton.jit
def row_major_kernel(
    src_ptr,
    dst_ptr,
    R,
    C,
    src_stride_r,
    src_stride_c,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    src = src_ptr + rows[:, None] * src_stride_r + cols[None, :] * src_stride_c
    tile = tl.load(src, mask=mask)  # along src's contiguous axis
    tl.store(dst_ptr + rows[:, None] * C + cols[None, :], tile, mask=mask)


def row_major(t, block_r=64, block_c=64, num_warps=4):
    """A row-major copy of the 2-D ``t``: a transpose in memory when ``t`` is
    column-major."""
    out = torch.empty(t.shape, device=t.device, dtype=t.dtype)
    if out.numel():
        grid = (triton.cdiv(t.shape[0], block_r), triton.cdiv(t.shape[1], block_c))
        row_major_kernel[grid](
            t,
            out,
            *t.shape,
            *t.stride(),
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=num_warps,
        )
    return out


def tma_scratch(size: int, alignment: int, stream):
    """Scratch for descriptors made inside kernels: Triton asks for it at launch."""
    return torch.empty(size, device="cpu" if INTERPRET else "cuda", dtype=torch.int8)


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


def k_major_for_tf32(a, b):
    """``a`` and ``b`` with K contiguous, copying whichever is not."""
    if a.stride(1) != 1:
        a = row_major(a)
    if b.stride(0) != 1:
        b = row_major(b.mT).mT
    return a, b


def tma_operands(a, b, realign=False):
    """The operands as the descriptor kernel should get them (K-major for tf32), or None
    when it cannot take them. ``matmul`` calls it on Hopper. ``realign``: copy an operand
    whose rows (or columns) are not 16 bytes apart into one whose are."""
    if a.dtype == torch.float32 and dot_precision(a.dtype) == "tf32":
        a, b = k_major_for_tf32(a, b)
    if realign:
        a, b = aligned(a), aligned(b)
    return (a, b) if tma_applies(a, b) else None


def aligned(t):
    """``t``, or a copy in the same layout with its leading stride padded to 16 bytes
    (the LM head's dY: rows of 65 classes, 130 bytes, that no descriptor describes)."""
    if tma_layout(t) is not None or 1 not in t.stride():
        return t
    if t.stride(1) != 1:  # column-major: pad the transpose's rows
        return aligned(t.mT).mT
    step = 16 // t.element_size()
    padded = t.new_empty(t.shape[0], -(-t.shape[1] // step) * step)
    return padded[:, : t.shape[1]].copy_(t)


def matmul_tma(
    a, b, activation=None, *, bias=None, return_preactivation=False, config=None
):
    """``activation(a @ b + bias)`` with the persistent descriptor kernel, autotuned
    unless ``config`` (as for ``matmul_portable``) is given."""
    check_inputs(a, b, activation, bias)
    operands = tma_operands(a, b)
    if operands is None:
        raise ValueError(
            "the descriptor kernel needs each operand contiguous along rows or "
            "columns, other strides multiples of 16 bytes, and N * itemsize a multiple "
            "of 16 bytes: call matmul(), which falls back to the portable kernel"
        )
    return launch_tma(*operands, activation, bias, return_preactivation, config)


def launch_tma(
    a, b, activation, bias, return_preactivation, config=None, accumulate=None
):
    """The descriptor kernel's launch, for operands that ``tma_operands`` returned."""
    out, pre = allocate_outputs(a, b, return_preactivation, accumulate)
    (M, K), N = a.shape, b.shape[1]
    if out.numel() == 0:
        return (out, pre) if return_preactivation else out
    # Set at every launch: Triton keeps the allocator in a context variable, which other
    # threads, autograd's backward thread among them, do not inherit.
    triton.set_allocator(tma_scratch)
    a_column_major = tma_layout(a) == "column"
    b_column_major = tma_layout(b) == "column"
    sms = sm_count()
    # Scratch for the tail's partial tiles (one a program, at most) and its counters, for
    # the largest grid a config may launch (``programs``: the grid of a config).
    most = programs(config) if config else sms * MOST_PER_SM
    scratch = scratch_per_sm(config) if config else SCRATCH_PER_SM
    partials = torch.empty(sms * scratch, device=a.device, dtype=torch.float32)
    kernel = matmul_tma_tuned if config is None else matmul_tma_kernel
    kernel[lambda meta: (programs(meta),)](
        a,
        b,
        out,
        bias,
        pre,
        partials,
        zeroed(a.device, most),
        M,
        N,
        K,
        a.stride(1) if a_column_major else a.stride(0),
        b.stride(1) if b_column_major else b.stride(0),
        bias.stride(0) if bias is not None else 0,
        A_COLUMN_MAJOR=a_column_major,
        B_COLUMN_MAJOR=b_column_major,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        STORE_PREACTIVATION=pre is not None,
        INPUT_PRECISION=dot_precision(a.dtype),
        UPCAST=INTERPRET and a.dtype == torch.bfloat16,
        NUM_SMS=sms,
        ACCUMULATE=accumulate is not None,
        **(config or {}),
    )
    return (out, pre) if return_preactivation else out


# %%
# When ``matmul`` uses it
# -----------------------
# Chapter 04's ``matmul`` calls this kernel on Hopper when ``tma_operands`` accepts the operands
# and ``fills_the_gpu(M, N)``: the output has a 128 × 128 tile per SM. Below that a persistent
# program has no loop over tiles to spread its setup over, and the recordings had the portable
# kernel faster at every such size (chapter 04's benchmarks show both). fp8 always takes it.
#
# What the K-major copy is worth, on the H100 at 4,096³ for each order of A and B: in fp32 as
# tf32 the kernel runs 319 TFLOP/s with both operands K-major and 60 to 163 in the three other
# orders; ``matmul``, which copies them K-major first, runs 266 to 325 in every order, against
# cuBLAS's 259 to 370. In fp16 the order hardly matters.
#
# What the split tail is worth, at 3,072³ in fp16 (288 tiles of 128 × 256 over 132 SMs leave a
# last wave of 24): those tiles go from 525 TFLOP/s unsplit to 549 with the tail split in four,
# just ahead of the best 128 × 128 tile (547), and still well behind cuBLAS's 722. The split
# stays behind because a share of 9 or 10 K steps pays the pipeline's start as a whole tile
# does, and the last share reads the others' partial tiles before its epilogue.
#
# Weight gradients
# ----------------
# One kind of product takes this kernel below a tile per SM. A linear layer's weight gradient,
# dW = dYᵀ X (chapter 05), is as small as the weight and sums over every token: in chapter 12's
# GPT, 384 to 1,536 wide over 16,384 tokens, at most 36 tiles of 128 × 128 for 132 SMs, each 256
# K steps long. One program a tile would leave 96 SMs of the 132 idle or more. It is the last
# wave again, with no whole wave before it: ``tail_split`` makes every tile ``splits`` shares
# (the qkv layer's 27 tiles, 4 shares each, on 108 programs), and the last share to arrive sums
# them in order, so the gradient has the same bits at every step. dYᵀ is a view of dY, a
# column-major A: its tiles come through a descriptor of dY, and the tensor cores read them from
# shared memory transposed (a flag of the ``wgmma`` instruction), never copied.
# ``splits_k`` (in ``matmul_tuning``) names such a shape: fewer tiles than SMs and K at least
# four times the output's longer side. Chapter 04's ``matmul`` gives it to this kernel, and the
# autotuner times only the configs that split it. cuBLAS, too, runs split-K kernels for these
# products, and sums the shares in a second kernel. ``lab/step_products.py`` times each of the
# step's products against it; those timings are not recorded yet.
#
# fp8
# ---
# fp8 (e4m3: 4 bits of exponent, 3 of mantissa, largest finite value 448) halves the bytes of fp16
# and doubles the tensor-core rate. ``matmul`` takes e4m3 inputs on GPUs of compute capability 8.9
# or newer (and under the interpreter, which emulates them), accumulates in fp32 and writes bf16,
# since a product of fp8 values soon leaves fp8's range. The tensor cores want an fp8 B
# column-major (K-major), the layout ``torch._scaled_mm`` requires too.
#
# Correctness
# -----------
# Chapter 04's harness, ``check_matmul.check``, checks this kernel against the fp64 product of
# the same inputs, with a bias, each activation and the pre-activation, for A and B as given,
# transposed in memory and A row-strided, in fp16 and fp32 (bf16 on a GPU), skipping layouts a
# descriptor cannot describe; then fp8 with B column-major, values scaled by 4. Triton's fp8
# ``tl.dot`` on Hopper accumulates in the tensor cores' fast mode, with fewer bits than fp32, so
# fp8's absolute tolerance is doubled and its output is checked against the activation of the
# (checked) pre-activation.
#
# Each shape, layout and dtype compiles the kernel, and the two largest shapes are autotuned:
# minutes on a GPU. A quick GPU run checks two small shapes (a ragged tile, and several tiles
# with a K-step); ``STEPKERNELS_FULL=1`` checks all six, the autotuned ones included, and
# ``tests/test_matmul.py`` runs the same check over all six on Hopper.

SMALL_SHAPES = [(16, 16, 16), (64, 96, 128), (77, 136, 48), (200, 264, 72)]
TUNED_SHAPES = [(1000, 1536, 704), (2048, 3072, 4096)]  # autotuned on a GPU
CHECK_SHAPES = tutorial.choose(
    gpu=[(77, 136, 48), (200, 264, 72)],
    cpu=SMALL_SHAPES,
    full=SMALL_SHAPES + TUNED_SHAPES,
)
if ON_HOPPER or tutorial.INTERPRET:
    check_matmul.check(
        matmul_tma,
        skip=lambda a, b: tma_operands(a, b) is None,
        dtypes=[torch.float16, torch.float32, torch.float8_e4m3fn]
        + bench.choose(gpu=[torch.bfloat16], cpu=[]),
        shapes=CHECK_SHAPES,
    )
else:
    print("Not a Hopper GPU: matmul runs the portable kernel here, and so do we.")

# %%
# Benchmark: fp8
# --------------
# We compare ``matmul`` on fp8 inputs (B column-major, bf16 output) with ``torch._scaled_mm``,
# PyTorch's fp8 matmul, which takes the same layout plus one fp32 scale per operand (we pass 1.0:
# our inputs are already in range). The dashed line is cuBLAS in *fp16* at 4,096³, for scale only:
# fp8's tensor cores are twice as fast. The fair comparison is ``torch._scaled_mm``, measured in
# the same run; our share of it is printed below the plot.


def make_fp8(provider: str, size: int, dtype: torch.dtype):
    x = (torch.randn(size, size, device=DEVICE) * 4).to(dtype)
    y = (torch.randn(size, size, device=DEVICE) * 4).to(dtype).t()  # column-major
    one = torch.ones((), device=DEVICE)
    return {
        "triton": lambda: matmul(x, y),
        "torch": lambda: torch._scaled_mm(x, y, one, one, out_dtype=torch.bfloat16),
    }[provider]


fp8 = bench.Benchmark(
    name="matmul-fp8",
    x_name="M = N = K",
    x_values=[1024, 2048, 4096, 8192],
    providers=["triton", "torch"],
    make=make_fp8,
    work=lambda size, dtype: 2 * size**3,
    unit="TFLOP/s",
    dtypes=(torch.float8_e4m3fn,),
    smoke_x=64,
    headline_x=None,  # the lines below compare with torch._scaled_mm, not fp16
)
from stepkernels.runtime.tiles import FP8_DTYPES

# the device profile's answer (runtime/device.py): NVIDIA from sm_89, or the interpreter
has_fp8 = tutorial.INTERPRET or bool(FP8_DTYPES)
fp8_results = bench.run(fp8) if has_fp8 else None
if fp8_results is not None:
    print(f"matmul-fp8, {fp8_results.how}:")
    for size in fp8.x_values:
        ours = fp8_results.value("triton", size, torch.float8_e4m3fn)
        theirs = fp8_results.value("torch", size, torch.float8_e4m3fn)
        print(
            f"  {size}³: triton {ours:,.0f} TFLOP/s, torch._scaled_mm {theirs:,.0f}: "
            f"{ours / theirs:.0%} of torch._scaled_mm"
        )
elif not has_fp8:
    print(
        "This GPU has no fp8 tensor cores we use (NVIDIA from compute capability 8.9): skipped."
    )

# %%
# At the large sizes our fp8 kernel and ``torch._scaled_mm`` run level, close to twice our fp16
# rate of chapter 04; at the small ones ``torch._scaled_mm`` is ahead. One difference favours us:
# ``_scaled_mm`` by default accumulates precisely (``use_fast_accum=False``), while Triton's fp8
# dot on Hopper uses the fast mode (``max_num_imprecise_acc``).
#
# What we learned
# ---------------
# * A tensor descriptor hands tile copies, edges included, to the TMA engine: no pointer blocks,
#   no masks, threads free for the tensor cores.
# * A persistent kernel launches one program per SM that loops over tiles; it pays off once the
#   output has a tile for every SM, and below that the portable kernel is faster.
# * Persistent programs still end in a last wave; splitting its tiles along K fills the idle SMs,
#   each partial tile summed once, in a fixed order, by the last share to arrive. A weight
#   gradient (few tiles, a long K) is all last wave: every tile is split.
# * Operand layout can matter more than the kernel: tf32 on Hopper wants K-major operands, and a
#   copy is cheaper than the slow path, if the copy runs at copy speed.
# * fp8 doubles the tensor-core rate again; compare it with an fp8 library call, not an fp16 one.
#
# The measurements behind these choices, and the variants that lost, are in ``lab/NOTES.md``
# (its sections on matrix products).
#
# Exercises
# ---------
# 1. Add per-row and per-column fp32 scales for fp8 inputs (as ``torch._scaled_mm`` takes) to the
#    epilogue, and check against ``_scaled_mm`` with non-unit scales. Time both with the same
#    accumulation: ``use_fast_accum=True``, or ``max_num_imprecise_acc=0`` here.
# 2. Pipeline across tiles: ``tl.range(..., flatten=True)`` over the tile loop lets a program's
#    loads for its next tile overlap this tile's epilogue. Measure it with and without an
#    activation at 4,096³ and 8,192³; is it worth turning on?
# 3. Lower the ``fills_the_gpu`` threshold to half a tile per SM and rerun chapter 04's
#    skinny benchmark. Where does the descriptor kernel start to lose, and why?
