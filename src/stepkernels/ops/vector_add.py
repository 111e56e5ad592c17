"""ops.vector_add: the code of chapter 01, Vector addition: a first Triton kernel."""

# Generated from tutorials/01-vector-add.py by tools/export.py: edit the chapter, then `make
# export`.

from stepkernels.runtime.core import FLOAT_DTYPES, check_tensor, refuse_autograd
import torch
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    program_id = tl.program_id(axis=0)
    # int64, so that offsets past 2**31 elements do not wrap around.
    block_start = program_id.to(tl.int64) * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements  # the last block may hang over the end
    # Add in fp32 and round once on the store, as PyTorch does for fp16 and bf16.
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=in_bounds).to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=in_bounds)


SUPPORTED_DTYPES = FLOAT_DTYPES
BLOCK_SIZE = 1024  # chosen by the measurement at the end of this chapter
NUM_WARPS = 4


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Elementwise ``x + y`` for two contiguous tensors of the same shape and dtype."""
    refuse_autograd("add", "x + y", x, y)  # this lesson's add has no backward
    check_tensor(x, "x", SUPPORTED_DTYPES, contiguous=True)
    check_tensor(y, "y", SUPPORTED_DTYPES, contiguous=True)
    if x.dtype != y.dtype:
        raise TypeError(
            f"add() takes x and y of one dtype, got x {x.dtype} and y "
            f"{y.dtype}: convert one with .to(dtype)"
        )
    if x.shape != y.shape:
        raise ValueError(
            f"add() takes x and y of one shape, got x {tuple(x.shape)} and y "
            f"{tuple(y.shape)}: broadcast first with torch.broadcast_tensors(x, y) and call "
            ".contiguous() on the results"
        )
    out = torch.empty_like(x)
    n_elements = out.numel()
    if n_elements == 0:
        return out
    grid = lambda meta: (triton.cdiv(n_elements, meta["BLOCK_SIZE"]),)
    add_kernel[grid](x, y, out, n_elements, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS)
    return out
