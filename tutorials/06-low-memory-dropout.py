r"""
Low-memory dropout, and a fused bias + activation + dropout layer
=================================================================

We write a dropout that stores no mask: its backward regenerates the mask from a seed with
Triton's counter-based random numbers. Then we fuse a bias add, an activation and dropout
into one kernel, forward and backward, and measure both against PyTorch.

What you will learn:

* counter-based random numbers (Philox, behind ``tl.rand``): a mask that is a pure
  function of (seed, position), numbered so that it never repeats across blocks or rows;
* four (or eight) random numbers from one Philox call, and why that matters for speed;
* a backward that recomputes what it needs instead of saving it, in an
  ``autograd.Function`` and ``nn.Module`` with reproducible seeds.

Prerequisites: chapter 01 (blocks, masks, the grid, effective bandwidth), chapter 04.
"""

# %%
# Setup
# -----

from stepkernels.lessons import bench, figures_dropout, tutorial
from stepkernels.lessons.check_dropout import check_fused, fused_mask
import torch
import triton
import triton.language as tl

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# What dropout costs
# ------------------
# Dropout keeps each element with probability 1 - p and scales it by 1 / (1 - p): the expected
# output equals the input. Its backward applies the *same* mask, dx = dy * keep / (1 - p), so the
# forward must tell the backward what it kept. PyTorch's CUDA dropout stores it, a ``bool`` per
# element: for N fp16 elements its forward moves 2N (read x) + 2N (write y) + N (mask) bytes, a
# quarter more than needed, and keeps the mask in memory until the backward. If element i's random
# number is a pure function f(seed, i), the backward calls f again: the forward keeps an integer.
#
# Counter-based random numbers
# ----------------------------
# An ordinary generator carries a state that each draw updates; thousands of GPU threads cannot
# share one. A *counter-based* generator is a keyed hash: it scrambles a counter (position i) with a
# key (the seed) in a few rounds of multiplications and XORs, so each thread computes its elements'
# numbers in any order, as often as it likes. Triton ships Philox-4x32-10 (Salmon et al., SC 2011):
# ``tl.rand4x(seed, offsets)`` returns four uniform floats in [0, 1) per offset, ``tl.rand`` one.
#
# Two mistakes have shipped in real libraries. **Counters that restart in every tile**
# (``tl.arange(0, BLOCK_SIZE)``) repeat a mask tile after tile, the same features dropping together,
# silently: number elements by their place in the tensor, each launch with a fresh seed. **A seed
# from an address** (``x.data_ptr()``) defeats ``manual_seed``; a reused address repeats a mask.
#
# Four numbers per Philox call
# ----------------------------
# ``tl.rand`` runs all 10 rounds of Philox (about 60 integer instructions) per element and keeps a
# quarter of the output; at 3 TB/s an H100 has time for about 40 instructions per fp16 element.
# Measured on one, a dropout with ``tl.rand`` per element ran fp16 forward and backward at under
# half the speed of ours from 2^24 elements on (``lab/dropout_variants.py`` times it). So
# our counter is the group index ``offset // 4``, and one call serves the group's four elements: a
# block is ``BLOCK_SIZE // 4`` groups x 4 lanes, consecutive in memory (group g, lane l at 4g + l).
# The counter depends only on the position, never on the block size, and its 32 bits cover 2^34
# elements. Cells marked ``# @save ops/dropout`` are the package's ``stepkernels.ops.dropout``.

# @save ops/dropout
import functools
import math

from stepkernels.runtime import core

# Device functions by name: torch.compile copies a kernel's source with the @triton.jit
# functions it names, not a module it reads them from (``activations.apply_activation``).
from stepkernels.runtime.activations import activation_derivative, apply_activation
from stepkernels.runtime.arguments import (
    activation_argument,
    dropout_bias,
    dropout_input,
    dropout_p,
    dropout_seed,
    flag_argument,
)
from stepkernels.runtime.launch import cdiv, lean  # cheap repeated launches: chapter 08
import torch
import triton
import triton.language as tl


@triton.jit
def keep_mask(seed, p, groups):
    """For a block of group indices (int64, shape [G]), which of the [G, 4] elements to
    keep."""
    # Counters as uint32: the same Philox variant on every Triton version (32-bit
    # words).
    r0, r1, r2, r3 = tl.rand4x(seed, groups.to(tl.uint32))
    lane = tl.arange(0, 4)[None, :]
    random = tl.where(
        lane == 0,
        r0[:, None],
        tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
    )
    # Uniform in [0, 1): P(random >= p) = 1 - p; p = 0 keeps everything, p = 1 nothing.
    return random >= p


@triton.jit
def group_offsets(BLOCK_SIZE: tl.constexpr):
    """This program's group indices [G] and element offsets [G, 4], both int64."""
    groups_per_block: tl.constexpr = BLOCK_SIZE // 4
    groups = tl.program_id(0).to(tl.int64) * groups_per_block
    groups += tl.arange(0, groups_per_block)
    return groups, groups[:, None] * 4 + tl.arange(0, 4)[None, :]


# %%
# The seeded dropout
# ------------------
# The backward *is* this kernel, called on ``dy`` with the forward's seed: nothing saved but two
# numbers. ``do_not_specialize`` avoids compiling a kernel per seed value. A CUDA graph replays
# kernels with their captured arguments, one mask forever, so a seed may also lie in memory: a
# one-element int64 tensor that the kernel loads and the step advances in place (chapter 12's GPT).


# @save ops/dropout
@lean
@triton.jit(do_not_specialize=["seed"])
def dropout_kernel(
    x_ptr, out_ptr, n_elements, p, scale, seed, BLOCK_SIZE: tl.constexpr
):
    groups, offsets = group_offsets(BLOCK_SIZE)
    in_bounds = offsets < n_elements
    seed = tl.load(seed) if seed.dtype.is_ptr() else seed  # in memory: a tensor seed
    keep = keep_mask(seed, p, groups)
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


# %%
# The wrapper
# -----------
# The seed is an explicit integer in [0, 2^63) or a tensor: the caller owns reproducibility. p = 1
# would make the scale 1 / 0: we pass 0; p = 0 returns x. A non-contiguous view gets the mask of its
# contiguous copy. ``inplace=True`` writes into x as in ``torch.nn.Dropout``; ``mark_dirty`` lets
# autograd refuse what it refuses for in-place operations, as a second derivative is.

# @save ops/dropout
BLOCK_SIZE = 4096
NUM_WARPS = 8
MAX_ELEMENTS = 2**34  # 2^32 Philox counters of four elements each


def scale_for(p: float) -> float:
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def launch_dropout(x, p, seed, inplace=False, kernel=dropout_kernel) -> torch.Tensor:
    """Dropout of ``x`` into a new tensor, or into ``x`` itself: in place when
    contiguous (each element is read, then written, by the same program), else through
    a copy."""
    source = x.contiguous()
    out = source if inplace else torch.empty_like(source)
    if x.numel():
        grid = (cdiv(x.numel(), BLOCK_SIZE),)
        args = (source, out, x.numel(), p, scale_for(p), seed)
        kernel[grid](*args, BLOCK_SIZE, num_warps=NUM_WARPS)
    return x.copy_(out) if inplace and out is not x else out


class SeededDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed, inplace):
        ctx.p, ctx.seed = p, seed.clone() if torch.is_tensor(seed) else seed  # a copy
        if inplace:
            ctx.mark_dirty(x)
        return launch_dropout(x, p, seed, inplace)

    @staticmethod
    def backward(ctx, grad_out):
        core.refuse_double_backward("dropout", "torch.nn.functional.dropout")
        # The same kernel on the gradient, with the same seed: the same mask.
        return launch_dropout(grad_out, ctx.p, ctx.seed), None, None, None


def dropout(x, p: float, seed, training: bool = True, inplace: bool = False):
    """Drop each element of ``x`` with probability ``p``, scale the rest by 1 / (1 - p).

    The mask, a function of ``seed`` (an int in [0, 2**63), or a one-element int64
    tensor on x's device, read by the kernel) and of the row-major position alone, is
    regenerated in the backward. ``training=False`` or ``p=0`` return ``x``;
    ``inplace=True`` writes into ``x``.
    """
    dropout_input(x, MAX_ELEMENTS, core.FLOAT_DTYPES)  # checks, raising what to do
    p, seed = dropout_p(p), dropout_seed(seed, x)
    flag_argument("training", training)
    flag_argument("inplace", inplace)
    if not training or p == 0.0:
        return x
    if torch.compiler.is_compiling():  # an operator the compiler traces (below)
        out = dropout_op(x, p, seed_tensor(seed, x))
        return x.copy_(out) if inplace else out
    if not (torch.is_grad_enabled() and x.requires_grad):  # nothing for autograd
        out = launch_dropout(x, p, seed, inplace)
        if out is x:  # written in place: autograd's saved copies of x are now stale
            torch.autograd.graph.increment_version(x)
        return out
    return SeededDropout.apply(x, p, seed, inplace)


class Dropout(torch.nn.Module):
    """Drop-in for ``torch.nn.Dropout`` that stores no mask, with a 63-bit seed a call
    from PyTorch's generator (``manual_seed`` reproduces a run; 31 bits would repeat in
    ~46,000 calls)."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        flag_argument("inplace", inplace)
        self.p, self.inplace = dropout_p(p), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return dropout(x, self.p, core.fresh_seed(), inplace=self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


# %%
# Counters that restart in every row draw what ``dropout`` draws with a launch per row and one seed.
# Left, that mistake: every row the same mask; right, ours: rows correlate only by chance.

figures_dropout.draw_restarting_counters(dropout)

# %%
# Correctness
# -----------
# Given the mask m (dropout of ones shows it), dropout must equal ``where(m, x * scale, 0)``
# exactly, forward and backward, in every dtype (bf16 to one ulp under the interpreter, which
# truncates), and keep 1 - p of the elements within 5 standard deviations.


def check_dropout(shapes, p: float, seed: int) -> None:
    for dtype in core.FLOAT_DTYPES:
        rtol = 2**-7 if dtype == torch.bfloat16 and tutorial.INTERPRET else 0.0
        for shape in shapes:
            keep = dropout(torch.ones(shape, device=DEVICE), p, seed) != 0
            x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
            grad_out = torch.randn(shape, device=DEVICE).to(dtype)
            out = dropout(x, p, seed)
            (grad_in,) = torch.autograd.grad(out, x, grad_out)
            for ours, given in ((out, x), (grad_in, grad_out)):
                want = torch.where(keep, given.float() * scale_for(p), 0.0).to(dtype)
                torch.testing.assert_close(ours, want, rtol=rtol, atol=0.0)
            sigma = (keep.numel() * p * (1 - p)) ** 0.5
            assert abs(keep.sum().item() - keep.numel() * (1 - p)) <= 5 * sigma + 1e-9
    print(f"dropout == where(mask, x / (1 - p), 0), forward and backward: {shapes}")


n = bench.choose(gpu=2**24 + 3, cpu=20_011)
check_dropout([(1,), (97,), (BLOCK_SIZE + 1,), (3, 333), (n,)], p=0.3, seed=2024)
x = torch.randn(1000, device=DEVICE)
bad_calls = {
    "p above 1": lambda: dropout(x, 1.5, 0),
    "seed a float tensor": lambda: dropout(x, 0.5, torch.tensor(3.0)),
    "seed of 64 bits": lambda: dropout(x, 0.5, 2**63),
}
tutorial.show_refusals("dropout()", bad_calls)

# %%
# The fused layer: bias, activation, dropout
# ------------------------------------------
# ``dropout(act(x @ W + b))`` is three passes over the tensor in eager PyTorch, and autograd
# keeps the activation's input and the mask. Fused, the forward reads x (and the small bias)
# and writes y, the bytes of dropout alone. The backward, with z = x + b:
#
#     dz = dy * keep / (1 - p) * act'(z),     dx = dz,     db = sum of dz over rows.
#
# For act'(z) we save x, which the caller holds anyway, and *recompute* z. For db a backward program
# walks a strip of rows of ``BLOCK_COLS`` columns (bias loaded once), sums its columns in registers
# and adds them into fp32 sums with atomics; a counter finds the column block's last program, which
# casts the sums into db and zeroes them for the next call. That is one kernel where partial rows,
# a sum and a cast take three: at 2^24 fp16 elements it measured 87% of a copy on an H100, the
# three kernels 73%. Atomics add in arrival order, so db's last bits vary from run to run;
# ``torch.use_deterministic_algorithms(True)`` gets the three kernels, whose order is fixed. A
# forward program takes one row block.
#
# Here arithmetic sets the pace: an H100 has time for about 40 instructions per fp16
# element, and a mask of four draws a Philox call with libdevice's ``erf`` takes 68 in the
# forward's loop (counted in its SASS). Three choices bring the forward to 30 instructions an
# element, the backward from 79 to 46:
#
# * **Eight draws per Philox call.** A mask needs a comparison, not a float: a 32-bit word is two
#   16-bit draws, kept if >= round(p * 2^16) (p to 2^-17); counter row * ceil(n_cols/8) + col // 8.
# * **Whole products in Philox.** Each round takes the high and low halves of two 32 x 32-bit
#   products; multiplied in 64 bits, one instruction gives both. Same bits as ``tl.randint4x``.
# * **GELU from erfc**: with a = abs(z), z Phi(z) = max(z, 0) - a Phi(-a) and 2 Phi(-a) =
#   erfc(a / sqrt 2); erfc(u) = t exp(-u^2 + P(t)), t = 1 / (1 + u / 2), ``rsqrt`` squared for t
#   and ``exp2`` for exp: one MUFU instruction each, no branches. P of degree 9 (Numerical Recipes)
#   keeps a relative error of 1e-7 for fp32; 16-bit outputs take our fit of degree 5. This GELU
#   (``normal_tail``) is chapter 04's, in ``activations``, which every kernel with a GELU uses.


# @save ops/dropout
@triton.jit
def philox(seed, counters):
    """Philox-4x32-10, the bits of ``tl.randint4x``, each round's two 32 x 32-bit
    products taken whole in 64 bits: one multiply gives both halves, where ``umulhi``
    takes another."""
    seed = seed.to(tl.uint64)  # an int32 seed shifted by 32 would be undefined
    k0, k1 = seed.to(tl.uint32), (seed >> 32).to(tl.uint32)
    c0, c1, c2, c3 = counters, counters * 0, counters * 0, counters * 0
    for _ in tl.static_range(10):
        a, b = c0.to(tl.uint64) * 0xD2511F53, c2.to(tl.uint64) * 0xCD9E8D57
        c0, c1 = (b >> 32).to(tl.uint32) ^ c1 ^ k0, b.to(tl.uint32)
        c2, c3 = (a >> 32).to(tl.uint32) ^ c3 ^ k1, a.to(tl.uint32)
        k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def keep_eight(seed, threshold, groups):
    """Keep [G, 8]: a Philox call a group gives 4 words, each 2 draws of 16 bits (low
    first)."""
    r0, r1, r2, r3 = philox(seed, groups.to(tl.uint32))
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (groups.shape[0], 4))
    draws = tl.reshape(tl.join(words & 0xFFFF, words >> 16), (groups.shape[0], 8))
    return draws.to(tl.int32) >= threshold


@triton.jit
def column_block(BLOCK_COLS: tl.constexpr):
    """This program's groups of columns [G] and columns [G, 8] (axis 1 of the grid)."""
    groups_per_block: tl.constexpr = BLOCK_COLS // 8
    col_groups = tl.program_id(1) * groups_per_block + tl.arange(0, groups_per_block)
    return col_groups, col_groups[:, None] * 8 + tl.arange(0, 8)[None, :]


@triton.jit
def row_tile(row, col_groups, cols, n_rows, n_cols):
    """One row's tile: Philox counters [G], element offsets [G, 8], and its mask."""
    in_bounds = cols < tl.where(row < n_rows, n_cols, 0)  # rows past the end: nothing
    groups_per_row = (n_cols + 7) // 8
    return row * groups_per_row + col_groups, row * n_cols + cols, in_bounds


@lean
@triton.jit(do_not_specialize=["seed"])
def bias_act_dropout_kernel(
    x_ptr,
    bias_ptr,
    out_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    threshold,
    scale,
    seed,
    ACTIVATION: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    col_groups, cols = column_block(BLOCK_COLS)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols).to(tl.float32)
    seed = tl.load(seed) if seed.dtype.is_ptr() else seed  # as in dropout_kernel
    first_row = tl.program_id(0).to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=NUM_STAGES):
        tile = row_tile(first_row + i, col_groups, cols, n_rows, n_cols)
        counters, offsets, in_bounds = tile
        x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
        out_type = out_ptr.dtype.element_ty
        activated = apply_activation(x + bias, ACTIVATION, out_type)
        keep = keep_eight(seed, threshold, counters)
        out = tl.where(keep, activated * scale, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


@lean
@triton.jit(do_not_specialize=["seed"])
def bias_act_dropout_backward_kernel(
    grad_out_ptr,
    x_ptr,
    bias_ptr,
    grad_in_ptr,
    bias_sum_ptr,
    counter_ptr,
    grad_bias_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    threshold,
    scale,
    seed,
    ACTIVATION: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
):
    col_groups, cols = column_block(BLOCK_COLS)
    cols_in = cols < n_cols
    seed = tl.load(seed) if seed.dtype.is_ptr() else seed  # as in dropout_kernel
    if ACTIVATION is not None:
        bias = tl.load(bias_ptr + cols, mask=cols_in).to(tl.float32)
    bias_sum = tl.zeros((BLOCK_COLS // 8, 8), dtype=tl.float32)
    first_row = tl.program_id(0).to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=NUM_STAGES):
        tile = row_tile(first_row + i, col_groups, cols, n_rows, n_cols)
        counters, offsets, in_bounds = tile
        grad = tl.load(grad_out_ptr + offsets, mask=in_bounds).to(tl.float32)
        keep = keep_eight(seed, threshold, counters)
        # fp32: torch.compile passes the float scale as fp64, which the sums must not take
        grad = tl.where(keep, (grad * scale).to(tl.float32), 0.0)
        if ACTIVATION is not None:  # recompute z = x + b: read x, store nothing
            x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
            out_type = grad_in_ptr.dtype.element_ty
            grad *= activation_derivative(x + bias, ACTIVATION, out_type)
        grad = tl.where(in_bounds, grad, 0.0)
        grad_in = grad.to(grad_in_ptr.dtype.element_ty)
        tl.store(grad_in_ptr + offsets, grad_in, mask=in_bounds)
        bias_sum += grad
    if DETERMINISTIC:  # a row of partial sums a program, for PyTorch to add in order
        partial_row = tl.program_id(0).to(tl.int64) * n_cols
        tl.store(bias_sum_ptr + partial_row + cols, bias_sum, mask=cols_in)
    else:  # into fp32 sums in arrival order; the column block's last program casts
        tl.atomic_add(bias_sum_ptr + cols, bias_sum, mask=cols_in, sem="relaxed")
        tl.debug_barrier()  # every thread of this program has added
        arrived = tl.atomic_add(counter_ptr + tl.program_id(1), 1, sem="acq_rel")
        # The last: db, then sums and counter back to zero for the next launch.
        if arrived == tl.num_programs(0) - 1:
            sums = tl.load(bias_sum_ptr + cols, mask=cols_in, cache_modifier=".cg")
            grad_bias = sums.to(grad_bias_ptr.dtype.element_ty)
            tl.store(grad_bias_ptr + cols, grad_bias, mask=cols_in)
            tl.store(bias_sum_ptr + cols, tl.zeros_like(sums), mask=cols_in)
            tl.store(counter_ptr + tl.program_id(1), 0)


FUSED_COLS = {False: 2048, True: 1024}  # most columns a program: forward, backward
FORWARD_OPTIONS = {"NUM_STAGES": 1, "num_warps": 4}  # the best launch measured (H100)
BACKWARD_PROGRAMS_PER_SM = 4  # the backward's strips: long enough for about this many
BACKWARD_STAGES = {4: 3, 2: 4}  # by bytes an element: the best measured (H100)


@functools.cache  # once per shape: a repeated call looks its launch up
def fused_launch(n_rows: int, n_cols: int, backward: bool) -> tuple[int, int, tuple]:
    """(BLOCK_COLS, rows per program, grid) for a non-empty input: a forward program
    takes a row block (more rows if they are short, never more than there are), a
    backward program a strip of rows, for db."""
    block_cols = min(FUSED_COLS[backward], max(8, triton.next_power_of_2(n_cols)))
    col_blocks = triton.cdiv(n_cols, block_cols)
    rows_per_program = min(FUSED_COLS[backward] // block_cols, n_rows)
    if backward:
        wanted = triton.cdiv(BACKWARD_PROGRAMS_PER_SM * core.sm_count(), col_blocks)
        rows_per_program = triton.cdiv(n_rows, min(n_rows, wanted))
    row_blocks = triton.cdiv(n_rows, rows_per_program)
    return block_cols, rows_per_program, (row_blocks, col_blocks)


def bias_act_dropout(x, bias, p, activation, seed):
    # Rows by math.prod: with no features, view(-1, 0) would be ambiguous.
    x2d = x.view(math.prod(x.shape[:-1]), x.shape[-1])
    out = torch.empty_like(x2d)
    if x2d.numel():  # an empty input launches nothing
        block_cols, rows_per_program, grid = fused_launch(*x2d.shape, backward=False)
        dropping = (round(p * 2**16), scale_for(p), seed)  # threshold, scale, seed
        options = dict(ACTIVATION=activation, BLOCK_COLS=block_cols, **FORWARD_OPTIONS)
        bias_act_dropout_kernel[grid](
            x2d, bias, out, *x2d.shape, rows_per_program, *dropping, **options
        )
    return out.view(x.shape)


class BiasActDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, p, activation, seed):
        ctx.save_for_backward(x.view(-1) if activation is not None else None, bias)
        seed = seed.clone() if torch.is_tensor(seed) else seed  # callers may advance it
        ctx.p, ctx.activation, ctx.seed = p, activation, seed
        return bias_act_dropout(x, bias, p, activation, seed)

    @staticmethod
    def backward(ctx, grad_out):
        core.refuse_double_backward("dropout_bias_act", "PyTorch's dropout(act(x + b))")
        x, bias = ctx.saved_tensors
        deterministic = torch.are_deterministic_algorithms_enabled()
        grads = (grad_out, x, bias, ctx.p, ctx.activation, ctx.seed, deterministic)
        return *bias_act_dropout_backward(*grads), None, None, None


def bias_act_dropout_backward(grad_out, x, bias, p, activation, seed, deterministic):
    """dx, db; x (read only with an activation) of any shape with grad_out's rows."""
    shape2d = (math.prod(grad_out.shape[:-1]), grad_out.shape[-1])
    x2d = None if activation is None else x.view(shape2d)
    grad_2d = grad_out.contiguous().view(shape2d)
    if not grad_out.numel():  # no rows, or no features: nothing to launch
        return torch.empty_like(grad_out), torch.zeros_like(bias)
    grad_in, grad_bias = torch.empty_like(grad_2d), torch.empty_like(bias)
    block_cols, rows_per_program, grid = fused_launch(*shape2d, backward=True)
    if deterministic:  # partial sums, added by PyTorch: the same bits every run
        sums = counters = torch.empty(grid[0], shape2d[1], device=bias.device)
    else:  # scratch that the kernel leaves zeroed
        sums = core.zeroed(bias.device, shape2d[1], torch.float32)
        counters = core.zeroed(bias.device, grid[1])
    tensors = (grad_2d, x2d, bias, grad_in, sums, counters, grad_bias)
    dropping = (round(p * 2**16), scale_for(p), seed)
    bias_act_dropout_backward_kernel[grid](
        *tensors,
        *shape2d,
        rows_per_program,
        *dropping,
        ACTIVATION=activation,
        BLOCK_COLS=block_cols,
        DETERMINISTIC=deterministic,
        NUM_STAGES=BACKWARD_STAGES[grad_2d.element_size()],
        num_warps=4,
    )
    if deterministic:
        grad_bias = sums.sum(0).to(bias.dtype)
    return grad_in.view(grad_out.shape), grad_bias


def dropout_bias_act(x, bias, p: float, activation, seed, training: bool = True):
    """``dropout(act(x + bias), p)`` in one kernel, forward and backward; bias over the
    last dimension. Its mask, of (seed, row, column), is never stored; seed: as for
    ``dropout``. The mask draws 16 bits: it drops with probability p rounded to a
    multiple of 2^-16."""
    activation_argument(activation)
    dropout_input(x, MAX_ELEMENTS, core.FLOAT_DTYPES)
    p, seed = dropout_p(p), dropout_seed(seed, x)
    dropout_bias(x, bias, core.FLOAT_DTYPES)
    flag_argument("training", training)
    # The p the mask draws, which the scale 1 / (1 - p) must match
    p = round(p * 2**16) / 2**16 if training else 0.0
    x, bias = x.contiguous(), bias.contiguous()
    if torch.compiler.is_compiling():  # an operator the compiler traces (below)
        return dropout_bias_act_op(x, bias, p, activation, seed_tensor(seed, x))
    if torch.is_grad_enabled() and (x.requires_grad or bias.requires_grad):
        return BiasActDropout.apply(x, bias, p, activation, seed)
    return bias_act_dropout(x, bias, p, activation, seed)  # nothing for autograd


# %%
# Both dropouts as operators of ``torch.library``, as chapter 08 explains: ``torch.compile``
# traces each body with its kernels (``triton_op``), and ``register_autograd`` gives the
# derivative. The public functions call them only while being compiled; eager calls keep the
# path above, which costs the CPU less. A seed is a tensor here (an int becomes one), and the
# fused backward adds db's partial sums in PyTorch: no scratch memory kept between calls.

# @save ops/dropout
from stepkernels.runtime.launch import concrete  # a kernel per shape, as in eager calls
from torch import Tensor
from torch.library import triton_op


def seed_tensor(seed, x):
    """A seed as the operators take it: a copy (callers may advance theirs), on x's
    device."""
    if torch.is_tensor(seed):
        return seed.clone()
    return torch.full((), seed, dtype=torch.int64, device=x.device)


@triton_op("stepkernels::dropout", mutates_args={})
def dropout_op(x: Tensor, p: float, seed: Tensor) -> Tensor:
    return launch_dropout(x, p, seed)


def dropout_setup(ctx, inputs, output):
    ctx.p = inputs[1]
    ctx.save_for_backward(inputs[2])


def dropout_backward(ctx, grad_out):
    core.refuse_double_backward("dropout", "torch.nn.functional.dropout")
    return dropout_op(grad_out, ctx.p, *ctx.saved_tensors), None, None


dropout_op.register_autograd(dropout_backward, setup_context=dropout_setup)


@triton_op("stepkernels::dropout_bias_act", mutates_args={})
def dropout_bias_act_op(
    x: Tensor, bias: Tensor, p: float, activation: str | None, seed: Tensor
) -> Tensor:
    return bias_act_dropout(concrete(x), bias, p, activation, seed)


@triton_op("stepkernels::dropout_bias_act_backward", mutates_args={})
def dropout_bias_act_backward_op(
    grad_out: Tensor,
    x: Tensor,
    bias: Tensor,
    p: float,
    activation: str | None,
    seed: Tensor,
) -> tuple[Tensor, Tensor]:
    rows = (concrete(grad_out), concrete(x))  # fused_launch is cached by shape
    return bias_act_dropout_backward(*rows, bias, p, activation, seed, True)


def dropout_bias_act_setup(ctx, inputs, output):
    x, bias, ctx.p, ctx.activation, seed = inputs
    ctx.save_for_backward(x, bias, seed)


def dropout_bias_act_backward(ctx, grad_out):
    core.refuse_double_backward("dropout_bias_act", "PyTorch's dropout(act(x + b))")
    x, bias, seed = ctx.saved_tensors
    grads = dropout_bias_act_backward_op(grad_out, x, bias, ctx.p, ctx.activation, seed)
    return *grads, None, None, None


dropout_bias_act_op.register_autograd(
    dropout_bias_act_backward, setup_context=dropout_bias_act_setup
)


# %%
# ``check_fused`` (``stepkernels.check_dropout``): against PyTorch given the kernel's mask, each
# activation and dtype, to a few roundings (more for db, a sum over rows); on the CPU, 19 rows
# leave the last row block and the backward's last strip short. Each shape, activation and
# dtype compiles kernels, seconds each on a GPU: a quick GPU run checks two of the four shapes
# (leading dimensions with a ragged row, and many rows), ``STEPKERNELS_FULL=1`` all four, as
# the interpreter does (``tests/test_dropout.py`` checks the other two). Then how alike a
# mask's rows are: independent rows of 300 correlate by about 0.05 on average, by chance.

rows = bench.choose(gpu=8192, cpu=19)
FUSED_SHAPES = [(1, 1), (5, 7), (2, 3, 37), (rows, 300)]
CHECK_SHAPES = tutorial.choose(
    gpu=[(2, 3, 37), (rows, 300)], cpu=FUSED_SHAPES, full=FUSED_SHAPES
)
check_fused(dropout_bias_act, CHECK_SHAPES, 0.25, 11)
mask_rows = bench.choose(gpu=512, cpu=64)
mask = fused_mask(dropout_bias_act, (mask_rows, 300), 0.5, seed=3)
correlation = figures_dropout.row_correlation(mask)
print(
    f"fused mask, {mask_rows} x 300: mean |correlation| between rows {correlation:.3f}"
)

# %%
# Benchmarks
# ----------
# Dropout at p = 0.1 on 2^16 to 2^28 elements, and the layer with GELU on (N / 4096) x 4096, forward
# and forward + backward, against eager PyTorch (whose dropout stores a ``bool`` mask) and
# ``torch.compile``. We count compulsory bytes only: 2N x (bytes per element) forward, 4N forward +
# backward, 5N for the layer (whose backward reads x).

P_BENCH, FEATURES = 0.1, 4096


def torch_layer(x, bias=None):
    z = x if bias is None else torch.nn.functional.gelu(x + bias)
    return torch.nn.functional.dropout(z, P_BENCH, training=True)


def ours(x, bias=None):
    if bias is None:
        return dropout(x, P_BENCH, seed=1234)
    return dropout_bias_act(x, bias, P_BENCH, "gelu", seed=1234)


def make(provider, n_elements, dtype, fused=False, backward=False):
    shape = (max(n_elements // FEATURES, 1), FEATURES) if fused else (n_elements,)
    sizes = [shape, (FEATURES,)] if fused else [shape]
    inputs = [torch.randn(size, device=DEVICE, dtype=dtype) for size in sizes]
    inputs = [tensor.requires_grad_(backward) for tensor in inputs]
    function = {"triton": ours, "torch": torch_layer}.get(provider)
    function = function or bench.compile_static(torch_layer)
    if not backward:
        return lambda: function(*inputs)
    grad_out = torch.randn(shape, device=DEVICE, dtype=dtype)
    return lambda: torch.autograd.grad(function(*inputs), inputs, grad_out)


OTHERS = ("torch", "torch.compile", bench.COPY_PROVIDER)
for name, fused, backward, passes in (
    ("dropout-forward", False, False, 2),
    ("dropout-forward-backward", False, True, 4),
    ("bias-gelu-dropout-forward", True, False, 2),
    ("bias-gelu-dropout-forward-backward", True, True, 5),
):
    results = bench.run(
        bench.Benchmark(
            name=name,
            x_name="elements",
            x_values=[2**i for i in (16, 18, 20, 22, 24, 26, 27, 28)],
            providers=["triton", "torch", "torch.compile", bench.COPY_PROVIDER],
            make=lambda *args, f=fused, b=backward: make(*args, fused=f, backward=b),
            work=lambda n, dtype, passes=passes: passes * n * dtype.itemsize,
            dtypes=(torch.float32, torch.float16),
            quick_dtypes=(torch.float16,),  # fp32 compiles kernels of its own: recorded
            smoke_x=2**13 if fused else 2**12,
            headline_x=2**24,
        )
    )
    if results is None:  # nothing measured or recorded
        continue
    for dtype in ("float32", "float16"):
        ratios = [
            f"{results.ratio('triton', o, 2**28, dtype):.2f}x {o}" for o in OTHERS
        ]
        print(f"{dtype}, 2^28 elements: triton at {', '.join(ratios)}")
    print("  called from Python at 2^20 elements, float16:")  # the CPU's share shows
    for p in ("triton", "torch"):
        at = (p, 2**20, "float16")
        called, gpu, cpu = results.call(*at), results.value(*at), results.cpu_us(*at)
        rate = f"{called:6,.0f} GB/s (GPU time {gpu:,.0f})"
        print(f"    {p:8}{rate}, {cpu:,.0f} µs of CPU")
    if fused and not backward:
        for dtype in (torch.float32, torch.float16):
            per_ns = results.value("triton", 2**28, dtype) / (2 * dtype.itemsize)
            print(f"{str(dtype)[6:]}: triton {per_ns:.0f} elements per ns at 2^28")

# %%
# At large sizes our dropout moves bytes about as fast as a copy, ahead of ``torch``, which also
# writes its mask, a byte an element, and reads it back in the backward.
# Dotted lines are Python calls: through autograd our CPU time outlasts the kernels up to 2^24.
#
# The fused layer leaves eager PyTorch and ``torch.compile`` far behind. Per nanosecond fp16
# runs about twice the elements of fp32 (printed), as its bytes allow: the arithmetic keeps up
# with the memory, and both are near the copy. Forward + backward in fp16 stays furthest from
# it at 2^24 elements, where both kernels are short.
#
# What we learned
# ---------------
# * A counter-based generator makes a mask a pure function of (seed, counter): regenerate it.
# * Every element needs its own counter across the launch, every launch a seed (never an address).
# * One Philox call yields 128 bits: four floats, or eight 16-bit draws compared as integers.
#   Count instructions per element when fp16 is no faster than fp32: at 30 instead of 68 the
#   forward's fp16 runs at the pace of its bytes.
# * The launch choices and instruction counts above are measurements (an H100, and SASS
#   compiled for it); ``lab/NOTES.md`` keeps them.
# * A fused backward recomputes cheap intermediates (z = x + b); db's sums over rows go in with
#   atomics, and the last program to finish (a counter says which) writes db: no second kernel.
#
# Exercises
# ---------
# 1. Philox-4x32 with 7 rounds passes the same statistical tests as with 10 (Salmon et al.).
#    Give ``philox`` its number of rounds as a parameter: what does 7 gain the fp16 backward?
# 2. Write a dropout for attention probabilities inside a kernel that already has rows and
#    columns (say, of a softmax): number the counters by (batch, head, row, col) and check
#    with ``figures_dropout.row_correlation`` that heads and rows are independent.
# 3. Store the mask as bits instead of bytes (eight elements per ``uint8``). How much of the
#    classic dropout's memory and time does that win back, and what does it cost?
