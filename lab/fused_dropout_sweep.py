"""Where does chapter 06's fused bias + activation + dropout forward spend its time?

The log beside this script (fused_dropout_sweep.log) was written at commit 8b8530e, when the
chapter's fused forward used 3-D tiles [rows, groups, 4], 128 columns wide: on the H100 it ran
at 1.1 to 1.3 TB/s in fp32 with GELU, p = 0.1 and rows of 4,096, where plain seeded dropout
ran at 2.95. The package now ships the row-tile
kernel that this sweep led to; run today, "package" below is that kernel. On the same
(N / 4096) x 4096 inputs the script times:

* the package's fused forward (``stepkernels.dropout_bias_act``) for each activation, so that
  GELU's ``erf`` is separated from the rest;
* a flat variant, tiled like plain dropout (one block of consecutive elements), which finds
  each element's bias with ``offset % n_cols``. When n_cols is a multiple of 8 its Philox
  counters are the package's (row * n_cols / 8 + column / 8 = offset / 8), so its output must
  equal the package's bit for bit: ``check()``, which tests/test_dropout.py also runs;
* plain seeded dropout, for the ceiling of the generator and the bytes;
* plain seeded dropout at 2^24 elements over blocks and warps, next to a plain copy of the
  same bytes (``bench.copy_of``): what a streaming kernel can reach at that size.

    python lab/fused_dropout_sweep.py
"""

from stepkernels import dropout, dropout_bias_act
from stepkernels.lessons import bench
from stepkernels.ops.dropout import dropout_kernel, keep_eight, scale_for
from stepkernels.runtime.activations import ACTIVATIONS, apply_activation
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
import torch
import triton
import triton.language as tl

P = round(0.1 * 2**16) / 2**16  # a p the 16-bit mask draws exactly
SEED = 1234


@triton.jit(do_not_specialize=["seed"])
def flat_bias_act_dropout_kernel(
    x_ptr, bias_ptr, out_ptr, n_elements, n_cols, threshold, scale, seed,
    ACTIVATION: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    groups = tl.program_id(0).to(tl.int64) * (BLOCK_SIZE // 8) + tl.arange(0, BLOCK_SIZE // 8)
    offsets = groups[:, None] * 8 + tl.arange(0, 8)[None, :]  # groups of eight, as the package's
    in_bounds = offsets < n_elements
    bias = tl.load(bias_ptr + offsets % n_cols, mask=in_bounds).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    activated = apply_activation(x + bias, ACTIVATION, out_ptr.dtype.element_ty)
    keep = keep_eight(seed, threshold, groups)
    out = tl.where(keep, activated * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


def flat_forward(x2d, bias, activation, block_size=4096, num_warps=8):
    assert x2d.shape[1] % 8 == 0, "the flat numbering matches the package's when n_cols % 8 == 0"
    out = torch.empty_like(x2d)
    grid = (triton.cdiv(x2d.numel(), block_size),)
    flat_bias_act_dropout_kernel[grid](
        x2d, bias, out, x2d.numel(), x2d.shape[1], round(P * 2**16), scale_for(P), SEED,
        ACTIVATION=activation, BLOCK_SIZE=block_size, num_warps=num_warps,
    )  # fmt: skip
    return out


def check():
    generator = torch.Generator().manual_seed(0)
    for n_rows, n_cols in [(3, 8), (5, 4096 // bench.choose(gpu=1, cpu=16)), (7, 104)]:
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(n_rows, n_cols, generator=generator).to(DEVICE, dtype)
            bias = torch.randn(n_cols, generator=generator).to(DEVICE, dtype)
            for activation in ACTIVATIONS:
                ours = flat_forward(x, bias, activation, block_size=64, num_warps=2)
                theirs = dropout_bias_act(x, bias, P, activation, SEED)
                assert torch.equal(ours, theirs), (n_rows, n_cols, dtype, activation)
    print("flat fused forward equals the package's, bit for bit (fp32, fp16, every activation)")


def rates_for(nbytes):
    """GB/s of a call moving ``nbytes``, from its GPU time as the chapters measure it."""
    return lambda fn: bench.rate(nbytes, fn)


def sweep(dtype):
    x = torch.randn(2**27 // 4096, 4096, device="cuda", dtype=dtype)
    bias = torch.randn(4096, device="cuda", dtype=dtype)
    rate = rates_for(2 * x.numel() * x.element_size())

    print(f"{dtype_name(dtype)}, 2^27 elements, GB/s:")
    print(f"  plain seeded dropout  {rate(lambda: dropout(x, P, SEED)):6.0f}")
    for activation in ACTIVATIONS:
        ours = rate(lambda a=activation: dropout_bias_act(x, bias, P, a, SEED))
        line = f"  {str(activation):<13} package {ours:6.0f}"
        for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16)):
            flat = rate(lambda a=activation, b=block, w=warps: flat_forward(x, bias, a, b, w))
            line += f"  flat {block}/{warps}w {flat:6.0f}"
        print(line, flush=True)


def plain_dropout_launches(dtype, n_elements=2**24):
    x = torch.randn(n_elements, device="cuda", dtype=dtype)
    out = torch.empty_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    rate = rates_for(nbytes)

    def launch(block, warps):
        grid = (triton.cdiv(n_elements, block),)
        return lambda: dropout_kernel[grid](x, out, n_elements, P, scale_for(P), SEED, block, num_warps=warps)

    line = f"{dtype_name(dtype)}, 2^24 elements, GB/s: copy {rate(bench.copy_of(nbytes)):6.0f}"
    line += f"  package {rate(lambda: dropout(x, P, SEED)):6.0f} |"
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)):
        line += f"  {block}/{warps}w {rate(launch(block, warps)):6.0f}"
    print(line, flush=True)


if __name__ == "__main__":
    check()
    if ON_GPU:
        with bench.side_stream():  # as bench.measure does
            for dtype in (torch.float32, torch.float16):
                plain_dropout_launches(dtype)
            for dtype in (torch.float32, torch.float16):
                sweep(dtype)
