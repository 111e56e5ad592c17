"""ops.matmul_hopper: the code of chapter 07, Matrix multiplication on Hopper: tensor descriptors,
persistent programs, fp8."""

# Generated from tutorials/07-hopper-matmul.py by tools/export.py: edit the chapter, then `make
# export`.

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
