"""Chapter 06's Philox (64-bit products) against ``tl.randint4x``, and the forward's launch.

Run on a GPU from the repository root (``PYTHONPATH=src``)::

    python lab/fused_dropout_philox.py

``tl.randint4x`` computes each Philox round's two products with ``umulhi`` and a multiply,
two IMAD instructions each; chapter 06's ``philox`` multiplies in 64 bits, one IMAD.WIDE for
both halves, and returns the same bits. The fused forward (GELU, p = 0.1, 16,384 x 4,096) is
timed with each generator, walking strips of rows (the backward's launch: 1,024 columns, 3
stages) or a program per row block (1,024 to 4,096 columns, 1 stage). GB/s counts 2N
elements' bytes; the copy moves the same bytes. ``check()`` asserts the two generators' masks
and outputs are equal bit for bit (under the interpreter too).
"""

from stepkernels.lessons import bench
from stepkernels.ops.dropout import BACKWARD_PROGRAMS_PER_SM, column_block, keep_eight, row_tile
from stepkernels.runtime import core
from stepkernels.runtime.activations import apply_activation
import torch
import triton
import triton.language as tl

P, SEED = round(0.1 * 2**16) / 2**16, 1234  # a p the 16-bit mask draws exactly


@triton.jit
def keep_eight_randint4x(seed, threshold, groups):
    """``keep_eight`` with Triton's ``tl.randint4x`` for the words."""
    r0, r1, r2, r3 = tl.randint4x(seed, groups.to(tl.uint32))
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (groups.shape[0], 4))
    draws = tl.reshape(tl.join(words & 0xFFFF, words >> 16), (groups.shape[0], 8))
    return draws.to(tl.int32) >= threshold


@triton.jit(do_not_specialize=["seed"])
def forward_kernel(x_ptr, bias_ptr, out_ptr, n_rows, n_cols, rows_per_program, threshold,
                   scale, seed, OURS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                   NUM_STAGES: tl.constexpr):  # fmt: skip
    """The package's forward with GELU, its Philox chosen by OURS."""
    col_groups, cols = column_block(BLOCK_COLS)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols).to(tl.float32)
    first_row = tl.program_id(0).to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=NUM_STAGES):
        tile = row_tile(first_row + i, col_groups, cols, n_rows, n_cols)
        counters, offsets, in_bounds = tile
        x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
        activated = apply_activation(x + bias, "gelu", out_ptr.dtype.element_ty)
        if OURS:
            keep = keep_eight(seed, threshold, counters)
        else:
            keep = keep_eight_randint4x(seed, threshold, counters)
        out = tl.where(keep, activated * scale, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


def forward(x, bias, ours, one_row, cols=1024, stages=3, warps=4):
    out = torch.empty_like(x)
    n_rows, n_cols = x.shape
    col_blocks = triton.cdiv(n_cols, cols)
    rows_per_program = 1  # a program per row block, or the backward's strips:
    if not one_row:
        wanted = triton.cdiv(BACKWARD_PROGRAMS_PER_SM * core.sm_count(), col_blocks)
        rows_per_program = triton.cdiv(n_rows, min(n_rows, wanted))
    grid = (triton.cdiv(n_rows, rows_per_program), col_blocks)
    forward_kernel[grid](x, bias, out, n_rows, n_cols, rows_per_program, round(P * 2**16),
                         1 / (1 - P), SEED, OURS=ours, BLOCK_COLS=cols, NUM_STAGES=stages,
                         num_warps=warps)  # fmt: skip
    return out


def check():
    from stepkernels import dropout_bias_act

    for dtype in (torch.float32, torch.float16):
        x = torch.randn(9, 72, device=core.DEVICE).to(dtype)
        bias = torch.randn(72, device=core.DEVICE).to(dtype)
        theirs = forward(x, bias, False, False, 64, 1, 2)
        assert torch.equal(forward(x, bias, True, True, 64, 1, 2), theirs)
        assert torch.equal(dropout_bias_act(x, bias, P, "gelu", SEED), theirs)
    print("chapter 06's Philox gives tl.randint4x's bits: the same outputs")


LAUNCHES = [(False, 1024, 3, 4), (True, 1024, 1, 4), (True, 2048, 1, 4), (True, 4096, 1, 8)]


def sweep(dtype, n_rows=16384, n_cols=4096):
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype)
    bias = torch.randn(n_cols, device="cuda", dtype=dtype)
    assert torch.equal(forward(x, bias, True, True), forward(x, bias, False, False))
    nbytes = 2 * x.numel() * x.element_size()
    copy = bench.rate(nbytes, bench.copy_of(nbytes))
    print(f"{core.dtype_name(dtype)}, {n_rows} x {n_cols}, forward: copy {copy:,.0f} GB/s")
    for ours in (False, True):
        line = f"  {'ours' if ours else 'tl.randint4x':12s}"
        for one_row, cols, stages, warps in LAUNCHES:
            gbs = bench.rate(nbytes, lambda o=ours, r=one_row, c=cols, s=stages, w=warps:
                             forward(x, bias, o, r, c, s, w))  # fmt: skip
            launch = f"{'row' if one_row else 'strips'} {cols}/{stages}/{warps}w"
            line += f" | {launch} {gbs:,.0f} ({gbs / copy:.0%})"
        print(line, flush=True)


if __name__ == "__main__":
    check()
    if core.ON_GPU:
        with bench.side_stream():  # as bench.measure does
            for n_rows in (4096, 16384, 65536):
                for dtype in (torch.float16, torch.float32):
                    sweep(dtype, n_rows)
