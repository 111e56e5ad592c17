"""Chapter 06's fused bias + GELU + dropout with cheaper arithmetic: before and after.

Run on a GPU from the repository root (``PYTHONPATH=src``)::

    python lab/fused_dropout_cheaper.py
    python lab/fused_dropout_cheaper.py --one-row   # the forward, a program a row
    python lab/fused_dropout_cheaper.py --backward  # the backward's launches

``fused_dropout_arithmetic.py`` found the fp16 layer bound by arithmetic per element: the
generator (one Philox call per four elements, compared as floats) and GELU's ``erf`` from
libdevice. The package now draws eight 16-bit numbers per Philox call, compared as integers,
and computes GELU from an erfc with one ``rsqrt`` and one ``exp2`` (chapter 06). This script
times, on 16,384 x 4,096 inputs at p = 0.1, forward and backward kernels alone:

* ``before``: the kernels as they were (4 draws a call, libdevice ``erf``), kept here;
* ``after``: the package's kernels, over launch options (stages, warps, columns per program);
* two halves of the change alone (``mixed_kernel``): the new mask with libdevice ``erf``, and
  the old mask with the new GELU; the new mask built by selects instead of joins; and, in
  fp16, the fp32 form of the GELU (degree 9) instead of the 16-bit one (degree 5);
* a copy of the same bytes (``bench.copy_of``).

GB/s counts the forward's 2N elements and the backward's 3N (reads dy and x, writes dx). It
also prints the GELU's error on the GPU against float64, beside PyTorch's. ``check()`` (which
runs anywhere, under the interpreter too) asserts that ``before`` is the old layer (the old
mask equals plain dropout's) and that the variants match the package where they should.
"""

import math
import sys

from stepkernels.lessons import bench
from stepkernels.ops.dropout import (
    bias_act_dropout_backward_kernel,
    bias_act_dropout_kernel,
    dropout_bias_act,
    fused_launch,
    keep_eight,
    keep_mask,
    scale_for,
)
from stepkernels.runtime import activations, core
import torch
import triton
import triton.language as tl

P, SEED = round(0.1 * 2**16) / 2**16, 1234  # a p the 16-bit mask draws exactly


@triton.jit
def keep_eight_by_selects(seed, threshold, groups):
    """``keep_eight`` with the [G, 8] draws picked by lane instead of joined."""
    r0, r1, r2, r3 = tl.randint4x(seed, groups.to(tl.uint32))
    lane = tl.arange(0, 8)[None, :]
    word = lane // 2
    r = tl.where(word == 0, r0[:, None], tl.where(word == 1, r1[:, None],
                 tl.where(word == 2, r2[:, None], r3[:, None])))  # fmt: skip
    draws = (r >> ((lane % 2) * 16).to(tl.uint32)) & 0xFFFF
    return draws.to(tl.int32) >= threshold


@triton.jit
def erf_activation(z, ACTIVATION: tl.constexpr, DERIVATIVE: tl.constexpr):
    """The package's activations as they were before the erfc GELU: libdevice's ``erf``."""
    if ACTIVATION == "gelu" and DERIVATIVE:  # Phi(z) + z * phi(z)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        return cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACTIVATION == "gelu":
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif DERIVATIVE:
        return activations.activation_derivative(z, ACTIVATION, tl.float32)
    else:
        return activations.apply_activation(z, ACTIVATION, tl.float32)


@triton.jit
def act(z, ACTIVATION: tl.constexpr, CHEAP: tl.constexpr, DERIVATIVE: tl.constexpr,
        FP32: tl.constexpr):  # fmt: skip
    """CHEAP: 0, libdevice's erf; 1, the package's GELU; 2, its degree-9 form in any dtype."""
    if CHEAP:
        out = tl.float32 if FP32 or CHEAP == 2 else tl.float16
        if DERIVATIVE:
            return activations.activation_derivative(z, ACTIVATION, out)
        return activations.apply_activation(z, ACTIVATION, out)
    return erf_activation(z, ACTIVATION, DERIVATIVE)


@triton.jit
def keep(seed, p, threshold, groups, MASK: tl.constexpr):
    if MASK == 4:
        return keep_mask(seed, p, groups)
    elif MASK == 8:
        return keep_eight(seed, threshold, groups)
    else:
        return keep_eight_by_selects(seed, threshold, groups)


@triton.jit(do_not_specialize=["seed"])
def mixed_kernel(grad_out_ptr, x_ptr, bias_ptr, out_ptr, n_rows, n_cols, rows_per_program,
                 p, threshold, scale, seed, ACTIVATION: tl.constexpr, MASK: tl.constexpr,
                 CHEAP: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_COLS: tl.constexpr,
                 NUM_STAGES: tl.constexpr):  # fmt: skip
    """Forward (y = dropout(act(x + b))) or backward without db (dx = dy * mask * act'(z)),
    with the old or new mask (MASK = 4 lanes, 8, or 8 by selects) and GELU (CHEAP)."""
    LANES: tl.constexpr = 4 if MASK == 4 else 8
    groups_per_block: tl.constexpr = BLOCK_COLS // LANES
    col_groups = tl.program_id(1) * groups_per_block + tl.arange(0, groups_per_block)
    cols = col_groups[:, None] * LANES + tl.arange(0, LANES)[None, :]
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols).to(tl.float32)
    first_row = tl.program_id(0).to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=NUM_STAGES):
        row = first_row + i
        in_bounds = cols < tl.where(row < n_rows, n_cols, 0)
        counters = row * ((n_cols + LANES - 1) // LANES) + col_groups
        offsets = row * n_cols + cols
        z = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32) + bias
        kept = keep(seed, p, threshold, counters, MASK)
        if BACKWARD:
            grad = tl.load(grad_out_ptr + offsets, mask=in_bounds).to(tl.float32)
            fp32: tl.constexpr = out_ptr.dtype.element_ty == tl.float32
            out = tl.where(kept, grad * scale, 0.0) * act(z, ACTIVATION, CHEAP, True, fp32)
        else:
            fp32: tl.constexpr = out_ptr.dtype.element_ty == tl.float32
            out = tl.where(kept, act(z, ACTIVATION, CHEAP, False, fp32) * scale, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


def mixed(x, bias, mask, cheap, grad_out=None, activation="gelu", stages=2, warps=4):
    out = torch.empty_like(x)
    block_cols, rows_per_program, grid = fused_launch(*x.shape, backward=True)  # strips
    mixed_kernel[grid](grad_out if grad_out is not None else x, x, bias, out, *x.shape,
                       rows_per_program, P, round(P * 2**16), scale_for(P), SEED,
                       ACTIVATION=activation, MASK=mask, CHEAP=cheap,
                       BACKWARD=grad_out is not None, BLOCK_COLS=block_cols,
                       NUM_STAGES=stages, num_warps=warps)  # fmt: skip
    return out


def launch_rule(n_rows, n_cols, block_cols, programs_per_sm=8):
    col_blocks = triton.cdiv(n_cols, block_cols)
    wanted = triton.cdiv(programs_per_sm * core.sm_count(), col_blocks)
    rows_per_program = triton.cdiv(n_rows, min(n_rows, wanted))
    return rows_per_program, (triton.cdiv(n_rows, rows_per_program), col_blocks)


def package_forward(x, bias, block_cols=1024, stages=2, warps=4, one_row=False):
    out = torch.empty_like(x)
    rows_per_program, grid = launch_rule(*x.shape, block_cols)
    if one_row:  # a program per row and column block: the loop runs once
        rows_per_program, grid = 1, (x.shape[0], grid[1])
    bias_act_dropout_kernel[grid](x, bias, out, *x.shape, rows_per_program, round(P * 2**16),
                                  scale_for(P), SEED, ACTIVATION="gelu",
                                  BLOCK_COLS=block_cols, NUM_STAGES=stages,
                                  num_warps=warps)  # fmt: skip
    return out


def package_backward(grad_out, x, bias, block_cols=1024, stages=2, warps=4, per_sm=8,
                     db=False):  # fmt: skip
    grad_in = torch.empty_like(x)
    rows_per_program, grid = launch_rule(*x.shape, block_cols, per_sm)
    partial = torch.empty(grid[0], x.shape[1], device=x.device)
    bias_act_dropout_backward_kernel[grid](  # db as partial sums (the deterministic path)
        grad_out, x, bias, grad_in, partial, partial, bias, *x.shape, rows_per_program,
        round(P * 2**16), scale_for(P), SEED, ACTIVATION="gelu", BLOCK_COLS=block_cols,
        NUM_STAGES=stages, DETERMINISTIC=True, num_warps=warps,
    )  # fmt: skip
    return (grad_in, partial.sum(0).to(bias.dtype)) if db else grad_in


def check():
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(9, 40, generator=generator).to(core.DEVICE, dtype)
        bias = torch.randn(40, generator=generator).to(core.DEVICE, dtype)
        grad = torch.randn(9, 40, generator=generator).to(core.DEVICE, dtype)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
        new = dropout_bias_act(x, bias, P, "gelu", SEED)
        for mask in (8, 9):
            torch.testing.assert_close(mixed(x, bias, mask, True), new, rtol=0, atol=0)
        torch.testing.assert_close(mixed(x, bias, 8, False), new, **tol)
        torch.testing.assert_close(package_forward(x, bias, 64, 1, 2), new, rtol=0, atol=0)
        one_row = package_forward(x, bias, 64, 1, 2, one_row=True)
        torch.testing.assert_close(one_row, new, rtol=0, atol=0)
        want_back = package_backward(grad, x, bias)
        torch.testing.assert_close(mixed(x, bias, 8, True, grad), want_back, **tol)
        # before: the old mask is plain dropout's, applied to the old GELU
        old = mixed(x, bias, 4, False)
        z = activations.activation_reference(x.float() + bias.float(), "gelu")
        plain = dropout_mask(x.shape)
        torch.testing.assert_close(old.float(), torch.where(plain, z * scale_for(P), 0.0),
                                   **(tol or {"rtol": 2e-3, "atol": 2e-3}))  # fmt: skip
    print("variants agree with the package; the old mask is plain dropout's")


def dropout_mask(shape):
    """The old layer's mask: groups of four in a row, as plain dropout numbers a flat tensor
    when n_cols is a multiple of 4."""
    from stepkernels import dropout

    return dropout(torch.ones(shape, device=core.DEVICE), P, SEED) != 0


def gelu_error():
    z = torch.linspace(-12, 12, 2**22 + 1, device="cuda")
    truth = z.double() * 0.5 * torch.special.erfc(-z.double() / math.sqrt(2))
    bias = torch.zeros(z.numel(), device="cuda")
    ours = dropout_bias_act(z[None], bias, 0.0, "gelu", SEED)[0].double()
    torch_gelu = torch.nn.functional.gelu(z).double()
    for name, y in (("ours", ours), ("torch", torch_gelu)):
        err = (y - truth).abs()
        rel = err / truth.abs()
        big = truth.abs() > 1e-6
        print(f"  GELU fp32, {name:5s}: max |error| {err.max().item():.2e}, "
              f"max relative where |GELU| > 1e-6: {rel[big].max().item():.2e}")  # fmt: skip


LAUNCHES = [(1024, 1, 4), (1024, 2, 4), (1024, 3, 4), (2048, 1, 8), (2048, 3, 4), (2048, 3, 8)]


def sweep(dtype, n_rows=16384, n_cols=4096, variants=True):
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype)
    bias = torch.randn(n_cols, device="cuda", dtype=dtype)
    grad = torch.randn_like(x)
    n = x.numel() * x.element_size()
    name = core.dtype_name(dtype)
    for label, nbytes, runs in (
        ("forward", 2 * n, {
            "copy of the same bytes": bench.copy_of(2 * n),
            **({} if not variants else {
            "before (4 draws a call, libdevice erf)": lambda: mixed(x, bias, 4, False),
            "new mask, libdevice erf": lambda: mixed(x, bias, 8, False),
            "old mask, new GELU": lambda: mixed(x, bias, 4, True),
            "new mask by selects, new GELU": lambda: mixed(x, bias, 9, True),
            "new mask, new GELU of degree 9": lambda: mixed(x, bias, 8, 2)}),
            **{f"after: {c} cols, {s} stages, {w} warps":
               (lambda c=c, s=s, w=w: package_forward(x, bias, c, s, w))
               for c, s, w in LAUNCHES},
        }),
        ("backward", 3 * n, {
            "copy of the same bytes": bench.copy_of(3 * n),
            **({} if not variants else {
            "before (no db; 4 draws a call, libdevice erf)": lambda: mixed(x, bias, 4, False, grad),
            "new mask, libdevice erf (no db)": lambda: mixed(x, bias, 8, False, grad),
            "after, no db": lambda: mixed(x, bias, 8, True, grad),
            "after, no db, GELU of degree 9": lambda: mixed(x, bias, 8, 2, grad)}),
            **{f"after: {c} cols, {s} stages, {w} warps":
               (lambda c=c, s=s, w=w: package_backward(grad, x, bias, c, s, w))
               for c, s, w in LAUNCHES},
        }),
    ):  # fmt: skip
        copy = None
        print(f"{name}, {n_rows} x {n_cols}, {label}:")
        for what, fn in runs.items():
            gbs = bench.rate(nbytes, fn)
            copy = copy or gbs
            print(f"  {what:48s} {gbs:6,.0f} GB/s ({gbs / copy:4.0%})", flush=True)


def one_row_sweep(dtype, n_rows, n_cols=4096):
    """``--one-row``: the forward with a program per row and column block, no strip to walk."""
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype)
    bias = torch.randn(n_cols, device="cuda", dtype=dtype)
    nbytes = 2 * x.numel() * x.element_size()
    copy = bench.rate(nbytes, bench.copy_of(nbytes))
    line = f"{core.dtype_name(dtype)}, {n_rows} x {n_cols}, forward: copy {copy:,.0f}"
    package = bench.rate(nbytes, lambda: package_forward(x, bias, 1024, 3, 4))
    line += f" | strips 1024/3/4w {package:,.0f} ({package / copy:.0%}) | one row:"
    for cols, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
        gbs = bench.rate(nbytes, lambda c=cols, w=warps: package_forward(x, bias, c, 1, w, True))
        line += f"  {cols}/{warps}w {gbs:,.0f} ({gbs / copy:.0%})"
    print(line, flush=True)


def backward_sweep(dtype, n_rows, n_cols=4096):
    """``--backward``: the backward and db's sum, as the layer runs them, over launches."""
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype)
    bias = torch.randn(n_cols, device="cuda", dtype=dtype)
    grad = torch.randn_like(x)
    nbytes = 3 * x.numel() * x.element_size()
    copy = bench.rate(nbytes, bench.copy_of(nbytes))
    print(f"{core.dtype_name(dtype)}, {n_rows} x {n_cols}, backward + db: copy {copy:,.0f}")
    for per_sm in (8, 16):
        line = f"  {per_sm:2d} programs an SM:"
        for cols, stages, warps in ((1024, 3, 4), (1024, 2, 4), (1024, 4, 4), (2048, 3, 8),
                                    (2048, 2, 8), (2048, 3, 4), (512, 3, 2)):  # fmt: skip
            gbs = bench.rate(nbytes, lambda c=cols, s=stages, w=warps, m=per_sm:
                             package_backward(grad, x, bias, c, s, w, m, True))  # fmt: skip
            line += f"  {cols}/{stages}/{warps}w {gbs:,.0f} ({gbs / copy:.0%})"
        print(line, flush=True)


if __name__ == "__main__" and "--backward" in sys.argv:
    with bench.side_stream():
        for n_rows in (4096, 16384, 32768, 65536):
            for dtype in (torch.float16, torch.float32):
                backward_sweep(dtype, n_rows)
elif __name__ == "__main__" and "--one-row" in sys.argv:
    with bench.side_stream():
        for n_rows in (4096, 16384, 65536):
            for dtype in (torch.float16, torch.float32):
                one_row_sweep(dtype, n_rows)
elif __name__ == "__main__":
    check()
    if core.ON_GPU:
        gelu_error()
        with bench.side_stream():  # as bench.measure does
            for dtype in (torch.float16, torch.float32):
                sweep(dtype)
            for n_rows in (4096, 65536):  # 2^24 and 2^28 elements, the package's launches
                for dtype in (torch.float16, torch.float32):
                    sweep(dtype, n_rows, variants=False)
