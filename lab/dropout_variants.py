"""The two dropouts chapter 06 compares its own with, and what they cost on a GPU.

* ``triton (stored mask)``: the classic dropout. Its forward draws the package's mask, applies
  it and stores it, one byte per element; its backward is a second kernel that reads it back.
* ``triton (rand per element)``: the package's dropout with ``tl.rand``, one full Philox call
  per element, of which three quarters of the output is thrown away.

The provider names are those of the recorded ``dropout-forward`` and
``dropout-forward-backward`` results (src/stepkernels/results/), where these variants were
measured next to the chapter's providers. ``check()`` runs anywhere (under the interpreter
too, from tests/test_dropout.py); on a GPU the script then times ``triton`` and the two
variants at the chapter's sizes, as the chapter's benchmarks do, and prints GB/s.

    python lab/dropout_variants.py
"""

from stepkernels import dropout
from stepkernels.lessons import bench
from stepkernels.ops.dropout import BLOCK_SIZE, NUM_WARPS, group_offsets, keep_mask, launch_dropout, scale_for
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name, refuse_double_backward
import torch
import triton
import triton.language as tl

P = 0.1
SEED = 1234


@triton.jit(do_not_specialize=["seed"])
def dropout_store_mask_kernel(x_ptr, out_ptr, keep_ptr, n_elements, p, scale, seed, BLOCK_SIZE: tl.constexpr):
    groups, offsets = group_offsets(BLOCK_SIZE)
    in_bounds = offsets < n_elements
    keep = keep_mask(seed, p, groups)
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)
    tl.store(keep_ptr + offsets, keep, mask=in_bounds)  # the byte per element the package avoids


@triton.jit
def apply_stored_mask_kernel(grad_ptr, keep_ptr, out_ptr, n_elements, scale, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements
    keep = tl.load(keep_ptr + offsets, mask=in_bounds) != 0
    grad = tl.load(grad_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, grad * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


class StoredMaskDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):
        x = x.contiguous()
        out, keep = torch.empty_like(x), torch.empty(x.shape, dtype=torch.bool, device=x.device)
        if x.numel():
            grid = (triton.cdiv(x.numel(), BLOCK_SIZE),)
            dropout_store_mask_kernel[grid](
                x, out, keep, x.numel(), p, scale_for(p), seed, BLOCK_SIZE, num_warps=NUM_WARPS
            )
        ctx.save_for_backward(keep)  # one byte per element, alive until the backward
        ctx.p = p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        refuse_double_backward("StoredMaskDropout", "torch.nn.functional.dropout")
        (keep,) = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_in = torch.empty_like(grad_out)
        if grad_out.numel():
            grid = (triton.cdiv(grad_out.numel(), BLOCK_SIZE),)
            apply_stored_mask_kernel[grid](
                grad_out, keep, grad_in, grad_out.numel(), scale_for(ctx.p), BLOCK_SIZE, num_warps=NUM_WARPS
            )
        return grad_in, None, None


@triton.jit(do_not_specialize=["seed"])
def dropout_rand_per_element_kernel(x_ptr, out_ptr, n_elements, p, scale, seed, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements
    keep = tl.rand(seed, offsets.to(tl.uint32)) >= p  # one Philox call per element
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


class RandPerElementDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.p, ctx.seed = p, seed
        return launch_dropout(x, p, seed, kernel=dropout_rand_per_element_kernel)

    @staticmethod
    def backward(ctx, grad_out):
        refuse_double_backward("RandPerElementDropout", "torch.nn.functional.dropout")
        return launch_dropout(grad_out, ctx.p, ctx.seed, kernel=dropout_rand_per_element_kernel), None, None


PROVIDERS = {
    "triton": lambda x: dropout(x, P, SEED),
    "triton (rand per element)": lambda x: RandPerElementDropout.apply(x, P, SEED),
    "triton (stored mask)": lambda x: StoredMaskDropout.apply(x, P, SEED),
}


def saved_by(saved: list):
    def pack(tensor):
        saved.append(tensor)
        return tensor

    return pack


def check():
    """The stored-mask dropout is the package's, bit for bit, forward and backward, and saves
    one byte per element; rand per element keeps 1 - p of the elements, scaled."""
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(3 * 4096 + 5, device=DEVICE).to(dtype).requires_grad_()
        grad_out = torch.randn_like(x)
        ours = dropout(x, P, SEED)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(saved_by(saved), lambda t: t):
            stored = StoredMaskDropout.apply(x, P, SEED)
        assert torch.equal(stored, ours) and [t.dtype for t in saved] == [torch.bool]
        grads = [torch.autograd.grad(y, x, grad_out)[0] for y in (ours, stored)]
        assert torch.equal(*grads)
        per_element = RandPerElementDropout.apply(x.detach() + 10.0, P, SEED)  # no zeros in x
        kept = (per_element != 0).sum().item()
        n = x.numel()
        assert abs(kept - n * (1 - P)) < 5 * (n * P * (1 - P)) ** 0.5
    print("stored-mask dropout equals the package's bit for bit; rand per element keeps 1 - p")


def timed(function, x, grad_out, backward: bool):
    if backward:
        return lambda: torch.autograd.grad(function(x), x, grad_out)
    return lambda: function(x)


def sweep():
    for dtype in (torch.float32, torch.float16):
        for backward in (False, True):
            print(f"{dtype_name(dtype)}, {'forward + backward' if backward else 'forward'}, GB/s:")
            for i in (16, 18, 20, 22, 24, 26, 27, 28):
                x = torch.randn(2**i, device="cuda", dtype=dtype, requires_grad=backward)
                grad_out = torch.randn_like(x)
                nbytes = (4 if backward else 2) * x.numel() * x.element_size()
                line = f"  2^{i}:"
                for name, function in PROVIDERS.items():
                    line += f"  {name} {bench.rate(nbytes, timed(function, x, grad_out, backward)):6.0f}"
                print(line, flush=True)


if __name__ == "__main__":
    check()
    if ON_GPU:
        with bench.side_stream():  # as bench.measure does
            sweep()
