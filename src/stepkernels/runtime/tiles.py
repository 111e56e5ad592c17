"""runtime.tiles: the code of chapter 04, Matrix multiplication at cuBLAS speed."""

# Generated from tutorials/04-matrix-multiplication.py by tools/export.py: edit the chapter, then
# `make export`.

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
