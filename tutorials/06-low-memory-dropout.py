r"""
Low-memory dropout, and a fused bias + activation + dropout layer
=================================================================

We write dropout twice: first the classic way, which stores a mask in the forward pass and
reads it back in the backward, then with Triton's counter-based random numbers, which store
nothing: the backward regenerates the mask from a seed. Then we fuse a bias add, an
activation and dropout into one kernel, forward and backward.

What you will learn:

* what a *counter-based* random number generator is (Philox, behind ``tl.rand``), and why
  it makes a random mask a pure function of (seed, position);
* how to number positions so that masks never repeat across blocks or rows, and two ways
  libraries have got this wrong;
* how to get four random numbers out of one Philox call, and why that matters for speed;
* how to write a backward pass that recomputes what it needs instead of saving it, and how
  to measure the memory that saves;
* how to wrap it all in ``torch.autograd.Function`` and ``nn.Module`` with reproducible
  seeds.

Prerequisites: chapter 01 (blocks, masks, the grid, effective bandwidth).
"""

# %%
# Setup
# -----
# ``kit`` first, as always: without a GPU it switches Triton to its interpreter.

import kit
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl

kit.announce()
DEVICE = kit.DEVICE

# %%
# What dropout costs
# ------------------
# Dropout keeps each element with probability 1 - p and scales the kept ones by 1 / (1 - p),
# so that the expected output equals the input; the dropped ones become zero. Its backward
# applies the *same* mask to the incoming gradient: dx = dy * keep / (1 - p). The forward
# must therefore leave the backward some way to know which elements it kept.
#
# The classic way stores the mask. PyTorch's CUDA dropout writes one byte per element (a
# ``bool`` tensor) next to the output, and keeps it alive until the backward. For N fp16
# elements the forward then moves 2N (read x) + 2N (write y) + N (write the mask) bytes,
# a quarter more than the 4N that dropout needs, and the backward again reads the mask:
# 2N + N + 2N. In fp32 the overhead is an eighth. The memory is the bigger cost: a transformer
# layer runs dropout on its attention probabilities and its activations, and every mask stays
# alive from the forward until the backward. One byte for each two-byte activation is half
# as much memory again.
#
# A mask can instead be *recomputed*. If the random number of element i is a pure function
# f(seed, i), the backward calls f again with the same seed and gets the same mask, and the
# forward needs to store only one integer. Triton's ``tl.rand(seed, offsets)`` is such a
# function.
#
# Counter-based random numbers
# ----------------------------
# An ordinary generator (a Mersenne twister, say) carries a state that each draw updates, so
# the i-th number depends on all draws before it. Thousands of GPU threads cannot share such
# a state. A *counter-based* generator is instead a keyed hash: it scrambles a counter (the
# position i) with a key (the seed) through a few rounds of multiplications and XORs, and the
# result looks uniformly random. Nothing is carried from one number to the next, so every
# thread computes the numbers of its own elements, in any order, as many times as it likes.
#
# Triton ships Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
# SC 2011): a 128-bit counter, a 64-bit key, 10 rounds. ``tl.randint4x(seed, offsets)`` puts
# ``offsets`` into the counter and the seed into the key, and returns four independent 32-bit
# words per offset; ``tl.rand`` and ``tl.randint`` run the whole computation and keep one of the
# four. ``tl.rand4x`` keeps all four, converted to floats in [0, 1).
#
# A small kernel shows the property that everything below relies on: the numbers depend only
# on (seed, offset), not on which program computes them or when.


@triton.jit
def uniform_kernel(out_ptr, seed, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offsets, tl.rand(seed, offsets), mask=offsets < n_elements)


def uniform(n_elements: int, seed: int, block_size: int) -> torch.Tensor:
    out = torch.empty(n_elements, device=DEVICE)
    grid = (triton.cdiv(n_elements, block_size),)
    uniform_kernel[grid](out, seed, n_elements, BLOCK_SIZE=block_size)
    return out


# Same seed and offsets, different block sizes (so different programs): the same numbers.
assert torch.equal(uniform(1000, seed=7, block_size=128), uniform(1000, 7, 512))
# Another seed: other numbers.
assert not torch.equal(uniform(1000, seed=7, block_size=128), uniform(1000, 8, 128))
print("first numbers of seed 7:", uniform(1000, 7, 128)[:5].tolist())

# %%
# Two ways to get it wrong
# ------------------------
# The mask is a function of (seed, offset), so its quality rests on never handing two
# elements the same pair. Two mistakes have shipped in real libraries.
#
# **Offsets that restart in every block.** A kernel that works on tiles tends to number the
# elements of a tile from 0: ``tl.arange(0, BLOCK_SIZE)``. Pass that to ``tl.rand`` with one
# seed for the whole launch and every tile draws the *same* numbers, so the mask repeats from
# tile to tile (or row to row). Nothing crashes and the keep rate is exactly right; the
# training is simply worse, because the same features are dropped together everywhere. The
# cure is to number elements by their position in the whole tensor (``row * n_cols + col``,
# or ``program_id * BLOCK_SIZE + arange``): every element of a launch then has its own
# counter. A fresh seed for each *launch* then keeps different calls apart.
#
# **A seed derived from a tensor's address.** Using ``x.data_ptr()`` as the seed looks
# convenient: it differs between tensors and needs no bookkeeping. But the address is chosen by
# the caching allocator, so it changes from run to run and with every unrelated allocation:
# ``torch.manual_seed`` no longer makes training reproducible. Worse, the allocator reuses
# freed blocks, so successive steps often get the *same* address and therefore the same mask.
# We take the seed as an explicit integer argument instead, and our modules draw it from
# PyTorch's generator.
#
# Here is the first mistake next to the fix, for a 32 x 64 tensor with one program per row
# and p = 0.5.


@triton.jit
def row_mask_kernel(
    keep_ptr, seed, p, n_cols, BLOCK_SIZE: tl.constexpr, GLOBAL_OFFSETS: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    if GLOBAL_OFFSETS:
        random = tl.rand(
            seed, row * n_cols + cols
        )  # a counter per element of the tensor
    else:
        random = tl.rand(seed, cols)  # the bug: every row restarts at counter 0
    tl.store(keep_ptr + row * n_cols + cols, random >= p, mask=cols < n_cols)


def row_masks(n_rows: int, n_cols: int, global_offsets: bool) -> torch.Tensor:
    keep = torch.empty(n_rows, n_cols, dtype=torch.bool, device=DEVICE)
    block = triton.next_power_of_2(n_cols)
    row_mask_kernel[(n_rows,)](
        keep, 1234, 0.5, n_cols, BLOCK_SIZE=block, GLOBAL_OFFSETS=global_offsets
    )
    return keep.cpu()


def row_correlation(keep: torch.Tensor) -> float:
    """Mean absolute correlation between the masks of different rows."""
    correlation = torch.corrcoef(keep.float())
    off_diagonal = correlation[~torch.eye(len(keep), dtype=torch.bool)]
    return off_diagonal.abs().mean().item()


fig, axes = plt.subplots(1, 2, figsize=(9, 2.8))
for ax, global_offsets in zip(axes, (False, True), strict=True):
    keep = row_masks(32, 64, global_offsets)
    ax.imshow(keep.numpy(), cmap="gray", interpolation="nearest")
    name = "row * n_cols + col (correct)" if global_offsets else "col only (the bug)"
    ax.set_title(
        f"counter = {name}\nmean |correlation| between rows: {row_correlation(keep):.2f}",
        fontsize=9,
    )
    ax.set(xlabel="column", ylabel="row")
fig.suptitle("Dropout masks, p = 0.5 (white: kept)", fontsize=10)
fig.tight_layout()

# %%
# On the left every row is the same mask: correlation 1. On the right the rows are
# unrelated; their correlations are what chance gives for 64 columns, about 0.1.
#
# The classic dropout: a stored mask
# ----------------------------------
# Before the low-memory version we write the classic one, to have something to measure
# against. Its forward draws the mask, applies it and *stores* it, one byte per element; its
# backward is a second kernel that reads the mask back.
#
# Both versions draw their numbers the same way, in a helper that gets four numbers from
# each Philox call. We cut the elements into *groups* of four consecutive ones; the group
# index ``offset // 4`` is the Philox counter, and the four outputs of that one call serve the
# four elements of the group (``offset % 4`` picks which). ``tl.rand`` would run the whole
# 10-round Philox once per element and keep a quarter of its output. On a GPU that matters:
# Philox is about 60 integer instructions, and at 3 TB/s an H100 has time for only about 40
# instructions per fp16 element. One call per four elements brings the generator down to
# about 15.
#
# A block of ``BLOCK_SIZE`` elements is then a 2-D block of ``BLOCK_SIZE // 4`` groups x 4
# lanes. Its memory is still consecutive (group g, lane l sits at 4g + l), so loads and
# stores stay as wide as in chapter 01. The counter depends only on the element's position in
# the tensor, never on the block size, so any block size, or an autotuner choosing one,
# yields the same mask. The counter is 32 bits wide, which covers 2^34 elements.


@triton.jit
def keep_mask(seed, p, groups):
    """For a block of group indices (int64, shape [G]), which of the [G, 4] elements to keep."""
    # Counters as uint32: the same Philox variant on every Triton version (32-bit words).
    r0, r1, r2, r3 = tl.rand4x(seed, groups.to(tl.uint32))
    lane = tl.arange(0, 4)[None, :]
    random = tl.where(
        lane == 0,
        r0[:, None],
        tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
    )
    # random is uniform in [0, 1): P(random >= p) = 1 - p exactly; p = 0 keeps everything
    # and p = 1 nothing.
    return random >= p


@triton.jit
def group_offsets(BLOCK_SIZE: tl.constexpr):
    """This program's group indices [G] and element offsets [G, 4], both int64."""
    groups_per_block: tl.constexpr = BLOCK_SIZE // 4
    groups = tl.program_id(0).to(tl.int64) * groups_per_block
    groups += tl.arange(0, groups_per_block)
    return groups, groups[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit(do_not_specialize=["seed"])
def dropout_store_mask_kernel(
    x_ptr, out_ptr, keep_ptr, n_elements, p, scale, seed, BLOCK_SIZE: tl.constexpr
):
    groups, offsets = group_offsets(BLOCK_SIZE)
    in_bounds = offsets < n_elements
    keep = keep_mask(seed, p, groups)
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)
    tl.store(
        keep_ptr + offsets, keep, mask=in_bounds
    )  # the byte per element we want gone


@triton.jit
def apply_stored_mask_kernel(
    grad_ptr, keep_ptr, out_ptr, n_elements, scale, BLOCK_SIZE: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements
    keep = tl.load(keep_ptr + offsets, mask=in_bounds) != 0
    grad = tl.load(grad_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, grad * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


# %%
# The seeded dropout
# ------------------
# The low-memory forward is the same kernel without the last store. And since the backward
# applies the same mask with the same scale to ``dy``, the backward *is* this kernel, called
# on ``dy`` with the forward's seed. No second kernel, no mask, nothing saved but two numbers.
#
# We also keep the first version one would write, with ``tl.rand`` drawing a full Philox
# call for every element, to measure what the four-for-one trick buys. Its mask is different
# (another numbering of counters) but just as random.


@triton.jit(do_not_specialize=["seed"])
def dropout_kernel(
    x_ptr, out_ptr, n_elements, p, scale, seed, BLOCK_SIZE: tl.constexpr
):
    groups, offsets = group_offsets(BLOCK_SIZE)
    in_bounds = offsets < n_elements
    keep = keep_mask(seed, p, groups)
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit(do_not_specialize=["seed"])
def dropout_rand_per_element_kernel(
    x_ptr, out_ptr, n_elements, p, scale, seed, BLOCK_SIZE: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements
    keep = tl.rand(seed, offsets.to(tl.uint32)) >= p  # one Philox call per element
    x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
    out = tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


# %%
# The wrappers
# ------------
# ``dropout(x, p, seed)`` checks its arguments and launches. The seed is an explicit Python
# integer: the caller owns reproducibility. p is checked to lie in [0, 1]; p = 1 would make
# the scale 1 / 0, so we pass a scale of 0 instead (the kernel keeps nothing anyway), and
# p = 0 keeps everything and multiplies by exactly 1, so it returns x unchanged.
#
# The kernel numbers elements in row-major order of the tensor's shape, so a non-contiguous
# view is first copied (``.contiguous()``): it then gets the same mask as its contiguous copy,
# at the cost of one copy. Integer and float64 tensors are refused.
#
# ``torch.autograd.Function`` makes it differentiable. The seeded version saves only ``p`` and
# the seed on ``ctx``; the stored-mask version saves its mask with ``save_for_backward``,
# as any autograd function saves a tensor.

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZE = 4096
NUM_WARPS = 8
MAX_ELEMENTS = 2**34  # 2^32 Philox counters of four elements each


def check_p(p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"p must be a Python float in [0, 1], got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:  # also refuses nan
        raise ValueError(
            f"p is the probability of dropping an element: 0 <= p <= 1, got {p}"
        )
    return float(p)


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"seed must be a Python int, got {type(seed).__name__}: pass int(seed), or draw "
            "one with int(torch.randint(2**31, ()))"
        )
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    return seed


def check_input(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """The tensor as the kernels want it: supported dtype, right device, contiguous."""
    kit.check_tensor(x, name, SUPPORTED_DTYPES, contiguous=False)
    if x.numel() >= MAX_ELEMENTS:
        raise ValueError(
            f"{name} has {x.numel():,} elements; the 32-bit counter covers fewer than 2**34: "
            "split the tensor and give each part its own seed"
        )
    return x.contiguous()


def scale_for(p: float) -> float:
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def launch_dropout(x: torch.Tensor, p: float, seed: int, kernel=None) -> torch.Tensor:
    out = torch.empty_like(x)
    n_elements = x.numel()
    if n_elements:
        grid = (triton.cdiv(n_elements, BLOCK_SIZE),)
        (kernel or dropout_kernel)[grid](
            x, out, n_elements, p, scale_for(p), seed, BLOCK_SIZE, num_warps=NUM_WARPS
        )
    return out


class SeededDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.p, ctx.seed = p, seed  # two numbers: all the backward needs
        return launch_dropout(x, p, seed)

    @staticmethod
    def backward(ctx, grad_out):
        # The same kernel on the gradient, with the same seed: the same mask.
        return launch_dropout(grad_out.contiguous(), ctx.p, ctx.seed), None, None


def launch_dropout_store_mask(x: torch.Tensor, p: float, seed: int):
    out = torch.empty_like(x)
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    if x.numel():
        grid = (triton.cdiv(x.numel(), BLOCK_SIZE),)
        dropout_store_mask_kernel[grid](
            x,
            out,
            keep,
            x.numel(),
            p,
            scale_for(p),
            seed,
            BLOCK_SIZE,
            num_warps=NUM_WARPS,
        )
    return out, keep


class StoredMaskDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):
        out, keep = launch_dropout_store_mask(x, p, seed)
        ctx.save_for_backward(keep)  # one byte per element, alive until the backward
        ctx.p = p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (keep,) = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_in = torch.empty_like(grad_out)
        if grad_out.numel():
            grid = (triton.cdiv(grad_out.numel(), BLOCK_SIZE),)
            apply_stored_mask_kernel[grid](
                grad_out, keep, grad_in, grad_out.numel(), scale_for(ctx.p), BLOCK_SIZE,
                num_warps=NUM_WARPS,
            )  # fmt: skip
        return grad_in, None, None


def dropout(
    x: torch.Tensor, p: float, seed: int, training: bool = True
) -> torch.Tensor:
    """Drop each element of ``x`` with probability ``p`` and scale the rest by 1 / (1 - p).

    The mask is a function of ``seed`` and the element's position (row-major) alone, and is
    regenerated in the backward: nothing is stored. With ``training=False``, returns ``x``.
    """
    p, seed = check_p(p), check_seed(seed)
    x = check_input(x)
    if not training or p == 0.0:
        return x
    return SeededDropout.apply(x, p, seed)


def dropout_stored_mask(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The classic dropout, for comparison: the same mask as ``dropout``, stored."""
    p, seed = check_p(p), check_seed(seed)
    return StoredMaskDropout.apply(check_input(x), p, seed)


def dropout_keep_mask(shape, p: float, seed: int) -> torch.Tensor:
    """The mask ``dropout`` uses for a tensor of this shape: True where kept."""
    ones = torch.ones(shape, device=DEVICE)
    return launch_dropout_store_mask(ones, check_p(p), check_seed(seed))[1]


# %%
# Seeds for a module
# ------------------
# Training code wants ``nn.Dropout``, not a seed argument. The module draws a fresh seed for
# every call from PyTorch's default (CPU) generator, so ``torch.manual_seed`` makes a whole
# training run reproducible, every call gets its own mask, and drawing costs no GPU
# synchronisation. The seed is captured by the autograd node of that call, so its backward
# regenerates exactly its mask. Activation checkpointing, which re-runs the forward, also
# works: ``torch.utils.checkpoint`` restores the CPU generator's state before re-running, so
# the re-run draws the same seed. In eval mode the module is the identity.


def fresh_seed() -> int:
    return int(torch.randint(2**31 - 1, ()))


class Dropout(torch.nn.Module):
    """Drop-in for ``torch.nn.Dropout`` that stores no mask."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = check_p(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return dropout(x, self.p, fresh_seed())

    def extra_repr(self) -> str:
        return f"p={self.p}"


# %%
# Correctness
# -----------
# A random function has no single right answer to compare with, so we check what defines
# dropout. Let m be the mask (``dropout_keep_mask`` returns it, from the same helper the
# kernels use). Then:
#
# * kept elements are x scaled by 1 / (1 - p) computed in fp32 and rounded once, exactly as
#   PyTorch computes them, and dropped ones are 0: we assert exact equality with
#   ``where(m, x * scale, 0)``, for each dtype (bf16 allows one unit in the last place under
#   the interpreter, which truncates instead of rounding);
# * the stored-mask and the seeded versions agree bit for bit, forward and backward;
# * the keep rate is 1 - p within 5 standard deviations of a binomial count;
# * the gradient equals dy * m / (1 - p), through autograd;
# * the same seed gives the same mask, another seed another one.


def tolerance(dtype: torch.dtype) -> dict:
    if dtype == torch.bfloat16 and kit.INTERPRET:
        return {"rtol": 2**-7, "atol": 0.0}
    return {"rtol": 0.0, "atol": 0.0}


def dropout_reference(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    scale = torch.tensor(scale_for(p), dtype=torch.float32)
    return torch.where(keep, x.float() * scale.to(x.device), 0.0).to(x.dtype)


torch.manual_seed(0)
shapes = [
    (1,),
    (97,),
    (BLOCK_SIZE + 1,),
    (3, 333),
    (kit.choose(gpu=2**24 + 3, cpu=20_011),),
]
for dtype in SUPPORTED_DTYPES:
    for shape in shapes:
        for p in (0.1, 0.5):
            x = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
            seed = int(torch.randint(2**31 - 1, ()))
            keep = dropout_keep_mask(shape, p, seed)
            out = dropout(x, p, seed)
            torch.testing.assert_close(
                out, dropout_reference(x, keep, p), **tolerance(dtype)
            )
            grad_out = torch.randn_like(out)
            (grad_in,) = torch.autograd.grad(out, x, grad_out)
            expected = dropout_reference(grad_out, keep, p)
            torch.testing.assert_close(grad_in, expected, **tolerance(dtype))
            stored = dropout_stored_mask(x, p, seed)
            assert torch.equal(stored, out)
            assert torch.equal(torch.autograd.grad(stored, x, grad_out)[0], grad_in)
print(
    f"dropout == where(mask, x / (1 - p), 0), forward and backward: {len(shapes)} shapes"
)

n = kit.choose(gpu=2**24, cpu=2**16)
for p in (0.1, 0.5, 0.9):
    kept = dropout_keep_mask((n,), p, seed=2024).sum().item()
    sigma = (n * p * (1 - p)) ** 0.5
    print(
        f"p = {p}: kept {kept:,} of {n:,}, expected {n * (1 - p):,.0f} +- {sigma:,.0f}"
    )
    assert abs(kept - n * (1 - p)) < 5 * sigma
x = torch.randn(1000, device=DEVICE)
assert torch.equal(dropout(x, 0.0, 1), x) and torch.equal(dropout(x, 1.0, 1), 0 * x)
assert torch.equal(dropout(x, 0.5, 1), dropout(x, 0.5, 1))
assert not torch.equal(dropout(x, 0.5, 1), dropout(x, 0.5, 2))

# %%
# Bad input is refused with advice:

bad_calls = {
    "p above 1": lambda: dropout(x, 1.5, 0),
    "p negative": lambda: dropout(x, -0.1, 0),
    "seed a tensor": lambda: dropout(x, 0.5, torch.tensor(3)),
    "integer dtype": lambda: dropout(x.int(), 0.5, 0),
    "wrong device": lambda: dropout(x.to("meta"), 0.5, 0),
}
kit.show_refusals("dropout()", bad_calls)

# %%
# The memory saved
# ----------------
# What a function keeps for its backward can be counted exactly with
# ``torch.autograd.graph.saved_tensors_hooks``: autograd calls our hook with every tensor an
# operation saves. We count the bytes of the tensors that the three dropouts save for a tensor
# of N elements. On a GPU we also ask the CUDA allocator how many bytes stay allocated after
# the forward, besides the input and the output.


def saved_bytes(function, x: torch.Tensor) -> tuple[int, int | None]:
    """Bytes saved for the backward (hooks), and the allocator's count of extra bytes held."""
    seen = {}

    def pack(tensor):
        if tensor.data_ptr() != x.data_ptr():  # the input is alive anyway
            seen[tensor.data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    if kit.ON_GPU:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = function(x)
    held = None
    if kit.ON_GPU:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    del out
    return sum(seen.values()), held


n = kit.choose(gpu=2**26, cpu=2**16)
x = torch.randn(n, device=DEVICE, dtype=torch.float16, requires_grad=True)
memory_providers = {
    "torch": lambda x: torch.nn.functional.dropout(x, 0.1, training=True),
    "triton (stored mask)": lambda x: dropout_stored_mask(x, 0.1, seed=5),
    "triton": lambda x: dropout(x, 0.1, seed=5),
}
print(f"Saved for the backward of dropout on {n:,} fp16 elements ({2 * n:,} bytes):")
for provider, function in memory_providers.items():
    hooks, held = saved_bytes(function, x)
    allocator = "" if held is None else f"; the allocator holds {held:,} bytes more"
    print(
        f"  {provider:<21} {hooks:>11,} bytes ({hooks / n:.0f} per element){allocator}"
    )
    if provider == "triton":
        assert hooks == 0 and (held is None or held == 0)

# %%
# The seeded dropout saves nothing: zero bytes of mask, against one byte per element for
# the stored mask (half the size of the fp16 activations). On the CPU PyTorch's dropout even
# saves a mask in the input's dtype, so the count above without a GPU is larger than on one,
# where PyTorch saves a ``bool`` mask.
#
# The fused layer: bias, activation, dropout
# ------------------------------------------
# A feed-forward block computes ``dropout(act(x @ W + b))``. The bias, the activation and the
# dropout are three element-wise passes in eager PyTorch; each reads and writes the whole
# tensor, and the autograd graph keeps the activation's input (or output) and the dropout mask.
# Fused into one kernel, the forward reads x (and the small bias) and writes y: the same bytes
# as dropout alone.
#
# The backward needs, for each element, the mask and act'(z) at z = x + b:
#
#     dz = dy * keep / (1 - p) * act'(x + b),     dx = dz,     db = sum of dz over rows.
#
# The mask is regenerated from the seed, as before. For act'(z) we need z, and we have a
# choice: save z in the forward (one more write of N elements, and N elements held until the
# backward) or save x, which the caller holds anyway, and *recompute* z = x + b in the
# backward. Recomputing costs an addition and no bytes beyond reading x, which any backward
# that needs act'(z) must read in some form. We recompute. With no activation the backward
# does not read x at all.
#
# The bias gradient is a sum over rows, a reduction across programs. Each program therefore
# walks down a strip of rows (``rows_per_program`` of them, chosen so that there are enough
# programs to fill the GPU), keeps the column sums of its strip in registers and writes one row
# of partial sums. A small PyTorch sum over those partial rows finishes db. With about a
# thousand programs the partials are about a thousandth of the work.
#
# The fused layer is 2-D (rows x features), so its counters number *groups of four in a row*:
# counter = row * ceil(n_cols / 4) + col // 4, lane = col % 4. Every row starts a new group,
# so a tile of one row's columns is exactly the 2-D block of groups x 4 lanes that dropout
# uses, and ``keep_mask`` serves it unchanged. A program owns a block of ``BLOCK_COLS``
# columns (bias loaded once) and walks down a strip of rows, one row-tile at a time;
# ``NUM_STAGES = 2`` lets Triton issue the next row's loads before this row's arithmetic.
# As for dropout, every element has its own counter whatever the tiling.
#
# We first wrote these kernels on 3-D tiles (rows x groups x 4 lanes, 128 columns wide):
# on the H100 that forward ran at 1.1 to 1.3 TB/s in fp32 for every activation, where the
# same arithmetic on dropout's 2-D blocks ran at 2.8 to 3.0
# (``tools/experiments/fused_dropout_sweep.py``, log in ``results/``). The row-tile layout
# keeps every tensor in the one shape the generator produces.


@triton.jit
def column_block(BLOCK_COLS: tl.constexpr):
    """This program's groups of columns [G] and columns [G, 4] (axis 1 of the grid)."""
    groups_per_block: tl.constexpr = BLOCK_COLS // 4
    col_groups = tl.program_id(1) * groups_per_block + tl.arange(0, groups_per_block)
    return col_groups, col_groups[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def row_tile(row, col_groups, cols, n_rows, n_cols):
    """One row's tile: Philox counters [G], element offsets [G, 4], and its mask."""
    in_bounds = cols < tl.where(row < n_rows, n_cols, 0)  # rows past the end: nothing
    groups_per_row = (n_cols + 3) // 4
    return row * groups_per_row + col_groups, row * n_cols + cols, in_bounds


@triton.jit(do_not_specialize=["seed"])
def bias_act_dropout_kernel(
    x_ptr, bias_ptr, out_ptr, n_rows, n_cols, rows_per_program, p, scale, seed,
    ACTIVATION: tl.constexpr, BLOCK_COLS: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    col_groups, cols = column_block(BLOCK_COLS)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols).to(tl.float32)
    first_row = tl.program_id(0).to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=NUM_STAGES):
        counters, offsets, in_bounds = row_tile(
            first_row + i, col_groups, cols, n_rows, n_cols
        )
        x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
        activated = kit.apply_activation(x + bias, ACTIVATION)
        keep = keep_mask(seed, p, counters)
        out = tl.where(keep, activated * scale, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit(do_not_specialize=["seed"])
def bias_act_dropout_backward_kernel(
    grad_out_ptr, x_ptr, bias_ptr, grad_in_ptr, bias_partial_ptr,
    n_rows, n_cols, rows_per_program, p, scale, seed,
    ACTIVATION: tl.constexpr, BLOCK_COLS: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    col_groups, cols = column_block(BLOCK_COLS)
    cols_in = cols < n_cols
    if ACTIVATION is not None:
        bias = tl.load(bias_ptr + cols, mask=cols_in).to(tl.float32)
    bias_sum = tl.zeros((BLOCK_COLS // 4, 4), dtype=tl.float32)
    first_row = tl.program_id(0).to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=NUM_STAGES):
        counters, offsets, in_bounds = row_tile(
            first_row + i, col_groups, cols, n_rows, n_cols
        )
        grad = tl.load(grad_out_ptr + offsets, mask=in_bounds).to(tl.float32)
        keep = keep_mask(seed, p, counters)
        grad = tl.where(keep, grad * scale, 0.0)
        if ACTIVATION is not None:  # recompute z = x + b: read x, store nothing
            x = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32)
            grad *= kit.activation_derivative(x + bias, ACTIVATION)
        grad = tl.where(in_bounds, grad, 0.0)
        tl.store(
            grad_in_ptr + offsets, grad.to(grad_in_ptr.dtype.element_ty), mask=in_bounds
        )
        bias_sum += grad
    partial_row = tl.program_id(0).to(tl.int64) * n_cols
    tl.store(bias_partial_ptr + partial_row + cols, bias_sum, mask=cols_in)


# %%
# The wrapper flattens every dimension but the last into rows and picks the launch: blocks of
# up to ``FUSED_BLOCK_COLS`` columns (at least one group of four), and strips of rows long
# enough that about ``FUSED_PROGRAMS_PER_SM`` programs run on each SM. The backward writes one
# row of bias partials per strip: with a few hundred strips, well under 1% of its traffic.

FUSED_BLOCK_COLS = 1024
FUSED_WARPS = 4
FUSED_STAGES = 2
FUSED_PROGRAMS_PER_SM = 8
SM_COUNT = kit.SM_COUNT or 4  # the interpreter has no SMs: a stand-in of 4


def fused_launch(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_COLS, rows per program, row programs) for an n_rows x n_cols input."""
    block_cols = min(FUSED_BLOCK_COLS, max(4, triton.next_power_of_2(n_cols)))
    col_blocks = triton.cdiv(n_cols, block_cols)
    wanted = triton.cdiv(FUSED_PROGRAMS_PER_SM * SM_COUNT, col_blocks)
    rows_per_program = triton.cdiv(n_rows, min(n_rows, wanted))
    return block_cols, rows_per_program, triton.cdiv(n_rows, rows_per_program)


def check_activation(activation) -> None:
    if activation not in kit.ACTIVATIONS:
        raise ValueError(
            f"activation {activation!r} unknown; choose one of {kit.ACTIVATIONS}"
        )


def bias_act_dropout_forward(x2d, bias, p, activation, seed):
    n_rows, n_cols = x2d.shape
    out = torch.empty_like(x2d)
    if x2d.numel():
        block_cols, rows_per_program, row_programs = fused_launch(n_rows, n_cols)
        grid = (row_programs, triton.cdiv(n_cols, block_cols))
        bias_act_dropout_kernel[grid](
            x2d, bias, out, n_rows, n_cols, rows_per_program, p, scale_for(p), seed,
            ACTIVATION=activation, BLOCK_COLS=block_cols, NUM_STAGES=FUSED_STAGES,
            num_warps=FUSED_WARPS,
        )  # fmt: skip
    return out


def bias_act_dropout_backward(grad_out, x2d, bias, p, activation, seed):
    n_rows, n_cols = grad_out.shape
    grad_in = torch.empty_like(grad_out)
    if grad_out.numel() == 0:
        return grad_in, torch.zeros_like(bias)
    block_cols, rows_per_program, row_programs = fused_launch(n_rows, n_cols)
    partial = torch.empty(row_programs, n_cols, device=grad_out.device)
    bias_act_dropout_backward_kernel[(row_programs, triton.cdiv(n_cols, block_cols))](
        grad_out, x2d, bias, grad_in, partial, n_rows, n_cols, rows_per_program,
        p, scale_for(p), seed,
        ACTIVATION=activation, BLOCK_COLS=block_cols, NUM_STAGES=FUSED_STAGES,
        num_warps=FUSED_WARPS,
    )  # fmt: skip
    return grad_in, partial.sum(0).to(bias.dtype)


class BiasActDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, p, activation, seed):
        x2d = x.view(-1, x.shape[-1])
        ctx.save_for_backward(x2d if activation is not None else None, bias)
        ctx.p, ctx.activation, ctx.seed, ctx.shape = p, activation, seed, x.shape
        return bias_act_dropout_forward(x2d, bias, p, activation, seed).view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, bias = ctx.saved_tensors
        grad_out = grad_out.contiguous().view(-1, ctx.shape[-1])
        grad_in, grad_bias = bias_act_dropout_backward(
            grad_out, x2d, bias, ctx.p, ctx.activation, ctx.seed
        )
        return grad_in.view(ctx.shape), grad_bias, None, None, None


def dropout_bias_act(
    x: torch.Tensor,
    bias: torch.Tensor,
    p: float,
    activation: str | None,
    seed: int,
    training: bool = True,
) -> torch.Tensor:
    """``dropout(act(x + bias), p)`` in one kernel, forward and backward; bias over the last
    dimension. The mask is a function of (seed, row, column) and is never stored."""
    p, seed = check_p(p), check_seed(seed)
    check_activation(activation)
    x = check_input(x)
    kit.check_tensor(bias, "bias", SUPPORTED_DTYPES, contiguous=False)
    if x.dim() == 0 or bias.shape != x.shape[-1:] or bias.dtype != x.dtype:
        raise ValueError(
            f"bias must be 1-D with one value per feature (x.shape[-1]) and x's dtype: got x "
            f"{tuple(x.shape)} {x.dtype}, bias {tuple(bias.shape)} {bias.dtype}; reshape or "
            "convert the bias with .to(x.dtype)"
        )
    if not training:
        p = 0.0
    return BiasActDropout.apply(x, bias.contiguous(), p, activation, seed)


def fused_keep_mask(n_rows: int, n_cols: int, p: float, seed: int) -> torch.Tensor:
    """The mask ``dropout_bias_act`` uses for an (n_rows, n_cols) input: True where kept."""
    ones = torch.ones(n_rows, n_cols, device=DEVICE)
    bias = torch.zeros(n_cols, device=DEVICE)
    return dropout_bias_act(ones, bias, p, None, seed) != 0


class DropoutBiasAct(torch.nn.Module):
    """``dropout(act(x + bias))`` with a learned bias of ``features`` values, fused."""

    def __init__(self, features: int, p: float = 0.1, activation: str | None = "gelu"):
        super().__init__()
        check_activation(activation)
        self.p, self.activation = check_p(p), activation
        self.bias = torch.nn.Parameter(torch.zeros(features, device=DEVICE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seed = fresh_seed() if self.training else 0
        bias = self.bias.to(x.dtype)
        return dropout_bias_act(x, bias, self.p, self.activation, seed, self.training)

    def extra_repr(self) -> str:
        return (
            f"features={self.bias.numel()}, p={self.p}, activation={self.activation!r}"
        )


# %%
# Checking the fused layer
# ------------------------
# We compare with PyTorch given the kernel's own mask (``fused_keep_mask``): the forward with
# ``where(m, act(x + b) / (1 - p), 0)``, the gradients with autograd through that same PyTorch
# expression, for every activation and dtype. The kernel computes in fp32 and rounds once; the
# reference rounds after each step in fp16 and bf16, so the tolerances are those of a few
# roundings: 1e-5 relative in fp32, 2e-3 in fp16, 2e-2 in bf16. The bias gradient sums many
# rows, so its tolerance also scales with the number of rows.


def fused_reference(x, bias, keep, p, activation):
    z = x.float() + bias.float()
    activated = kit.activation_reference(z, activation)
    return torch.where(keep, activated * scale_for(p), 0.0)


FUSED_TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def check_fused(shape, dtype, activation, p, seed):
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_()
    keep = fused_keep_mask(x.numel() // shape[-1], shape[-1], p, seed).view(shape)
    out = dropout_bias_act(x, bias, p, activation, seed)
    expected = fused_reference(x, bias, keep, p, activation)
    torch.testing.assert_close(out.float(), expected, **FUSED_TOLERANCE[dtype])
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, bias), grad_out)
    expected_grads = torch.autograd.grad(expected, (x, bias), grad_out.float())
    rows = x.numel() // shape[-1]
    for grad, want, scale in zip(grads, expected_grads, (1, rows**0.5), strict=True):
        tol = {k: v * scale for k, v in FUSED_TOLERANCE[dtype].items()}
        torch.testing.assert_close(grad.float(), want.float(), **tol)


fused_shapes = [(1, 1), (5, 7), (3, 4, 37), (kit.choose(gpu=8192, cpu=67), 300)]
for dtype in SUPPORTED_DTYPES:
    for activation in kit.ACTIVATIONS:
        for shape in fused_shapes:
            check_fused(shape, dtype, activation, p=0.25, seed=11)
print(
    f"dropout_bias_act matches PyTorch forward and backward: {len(kit.ACTIVATIONS)} "
    f"activations x {len(SUPPORTED_DTYPES)} dtypes x {len(fused_shapes)} shapes"
)

layer = DropoutBiasAct(300, p=0.25, activation="relu")
x = torch.randn(64, 300, device=DEVICE)
layer.eval()
assert torch.equal(layer(x), torch.relu(x + layer.bias))
layer.train()
rows_kept = fused_keep_mask(512, 300, 0.5, seed=3)
print(f"fused mask, mean |correlation| between rows: {row_correlation(rows_kept):.3f}")

# %%
# Benchmarks
# ----------
# We time dropout at p = 0.1 on 2^16 to 2^28 elements, fp32 and fp16, forward alone and
# forward + backward (through ``torch.autograd.grad``, so that nothing accumulates into
# ``x.grad``). The providers:
#
# * ``triton``: the seeded dropout;
# * ``triton (rand per element)``: the same with one Philox call per element;
# * ``triton (stored mask)``: the classic version, writing and reading a ``bool`` mask;
# * ``torch``: ``F.dropout`` in eager mode, which stores a ``bool`` mask on the GPU;
# * ``torch.compile``: the same function compiled by Inductor, which generates its own Triton
#   kernel with Philox (``dynamic=True``, so one compilation serves all sizes).
#
# Effective bandwidth counts the compulsory bytes only: the forward reads x and writes y,
# 2N x (bytes per element); forward + backward adds reading dy and writing dx, 4N in all.
# Masks are not compulsory, so the stored-mask versions are charged for them in time but not
# in bytes: that is the cost they pay.


class RandPerElementDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.p, ctx.seed = p, seed
        return launch_dropout(x, p, seed, kernel=dropout_rand_per_element_kernel)

    @staticmethod
    def backward(ctx, grad_out):
        grad = launch_dropout(
            grad_out.contiguous(), ctx.p, ctx.seed, dropout_rand_per_element_kernel
        )
        return grad, None, None


P_BENCH = 0.1
DROPOUT_PROVIDERS = {
    "triton": lambda x: dropout(x, P_BENCH, 1234),
    "triton (rand per element)": lambda x: RandPerElementDropout.apply(
        x, P_BENCH, 1234
    ),
    "triton (stored mask)": lambda x: dropout_stored_mask(x, P_BENCH, 1234),
    "torch": lambda x: torch.nn.functional.dropout(x, P_BENCH, training=True),
}


_compiled = {}


def compiled(name: str, function):
    """One torch.compile per function, shared by every size (dynamic shapes)."""
    if name not in _compiled:
        _compiled[name] = torch.compile(function, dynamic=True)
    return _compiled[name]


def dropout_function(provider: str):
    if provider == "torch.compile":
        return compiled("dropout", DROPOUT_PROVIDERS["torch"])
    return DROPOUT_PROVIDERS[provider]


def make_dropout(provider: str, n_elements: int, dtype: torch.dtype):
    x = torch.randn(n_elements, device=DEVICE, dtype=dtype)
    function = dropout_function(provider)
    return lambda: function(x)


def make_dropout_backward(provider: str, n_elements: int, dtype: torch.dtype):
    x = torch.randn(n_elements, device=DEVICE, dtype=dtype, requires_grad=True)
    grad_out = torch.randn_like(x)
    function = dropout_function(provider)
    return lambda: torch.autograd.grad(function(x), x, grad_out)


SIZES = [2**i for i in (16, 18, 20, 22, 24, 26, 27, 28)]
dropout_providers = [*DROPOUT_PROVIDERS, "torch.compile"]
dropout_forward = kit.Benchmark(
    name="dropout-forward",
    x_name="elements",
    x_values=SIZES,
    providers=[*dropout_providers, kit.COPY_PROVIDER],
    make=make_dropout,
    work=lambda n, dtype: 2 * n * dtype.itemsize,
    dtypes=(torch.float32, torch.float16),
    smoke_x=2**12,
    headline_x=2**24,
)
kit.run(dropout_forward)

# %%
# And forward + backward:

dropout_backward = kit.Benchmark(
    name="dropout-forward-backward",
    x_name="elements",
    x_values=SIZES,
    providers=dropout_providers,
    make=make_dropout_backward,
    work=lambda n, dtype: 4 * n * dtype.itemsize,
    dtypes=(torch.float32, torch.float16),
    smoke_x=2**12,
    headline_x=2**24,
)
kit.run(dropout_backward)

# %%
# The fused layer is timed the same way on (N / 4096) x 4096 inputs with GELU and p = 0.1,
# against eager ``dropout(gelu(x + b))`` (three kernels) and the same function under
# ``torch.compile``. Bytes: the forward reads x and writes y, 2N; the bias (4,096 values) is
# negligible and not counted.
# The backward reads dy and x (to recompute z = x + b, which any backward needing gelu'(z) must
# read in some form) and writes dx, 3N; forward + backward counts 5N. The bias gradient's
# 4,096 values are not counted either.

FEATURES = 4096


def fused_function(provider: str):
    def eager(x, bias):
        activated = kit.activation_reference(x + bias, "gelu")
        return torch.nn.functional.dropout(activated, P_BENCH, training=True)

    if provider == "triton":
        return lambda x, bias: dropout_bias_act(x, bias, P_BENCH, "gelu", 1234)
    if provider == "torch.compile":
        return compiled("bias-gelu-dropout", eager)
    return eager


def fused_inputs(n_elements, dtype, requires_grad):
    x = torch.randn(n_elements // FEATURES, FEATURES, device=DEVICE, dtype=dtype)
    bias = torch.randn(FEATURES, device=DEVICE, dtype=dtype)
    return x.requires_grad_(requires_grad), bias.requires_grad_(requires_grad)


def make_fused(provider: str, n_elements: int, dtype: torch.dtype):
    x, bias = fused_inputs(max(n_elements, FEATURES), dtype, requires_grad=False)
    function = fused_function(provider)
    return lambda: function(x, bias)


def make_fused_backward(provider: str, n_elements: int, dtype: torch.dtype):
    x, bias = fused_inputs(max(n_elements, FEATURES), dtype, requires_grad=True)
    grad_out = torch.randn_like(x)
    function = fused_function(provider)
    return lambda: torch.autograd.grad(function(x, bias), (x, bias), grad_out)


fused_forward = kit.Benchmark(
    name="bias-gelu-dropout-forward",
    x_name="elements",
    x_values=SIZES,
    providers=["triton", "torch", "torch.compile", kit.COPY_PROVIDER],
    make=make_fused,
    work=lambda n, dtype: 2 * n * dtype.itemsize,
    dtypes=(torch.float32, torch.float16),
    smoke_x=2**13,
    headline_x=2**24,
)
kit.run(fused_forward)

# %%
# And forward + backward of the fused layer:

fused_backward = kit.Benchmark(
    name="bias-gelu-dropout-forward-backward",
    x_name="elements",
    x_values=SIZES,
    providers=["triton", "torch", "torch.compile"],
    make=make_fused_backward,
    work=lambda n, dtype: 5 * n * dtype.itemsize,
    dtypes=(torch.float32, torch.float16),
    smoke_x=2**13,
    headline_x=2**24,
)
kit.run(fused_backward)

# %%
# What the numbers say
# --------------------
# On the H100 (GPU time of each call, see How we measure), at 2^28 elements our dropout runs
# at 2,983 GB/s in fp32 and 2,993 in fp16, the copy bandwidth, against 2,285 and 1,999 for
# ``torch.nn.functional.dropout``, and it leads ``torch`` and ``torch.compile`` at every size
# from 2^16 up. The black line is a plain Triton copy of the same bytes (How we measure): a
# reference for what a simple streaming kernel reaches at each size, not a hard bound (at
# 2^27 and 2^28 in fp16 dropout edges past it by 1%). The 2.7 TB/s floor is met from 2^26
# elements (2,894 and 2,834); at 2^24, a 64 MB (fp32) problem of 20 to 30 µs, we reach 2,604
# and 2,348, 98% and 96% of the copy of the same bytes (2,661 and 2,447), which itself falls
# short of 2.7 there. Two of our own variants show where the time would go. Drawing one
# Philox call per element and throwing three of its four numbers away more than halves the
# fp16 rate (1,328 GB/s at 2^28): the generator, not memory, then sets the pace. Storing the
# mask as one byte per element costs 12 to 22% (2,623 and 2,330 GB/s), the extra byte
# written. Forward plus backward keeps the lead at every size: 2,991 and 3,010 GB/s at 2^28
# against 2,471 and 2,198 for ``torch``, and at or above 2.7 TB/s from 2^26 elements (2,692
# and 2,528 at 2^24).
#
# The fused bias + GELU + dropout layer runs at 2,701 GB/s in fp32 at 2^28 (91% of the copy
# of the same bytes), 3.2 times eager PyTorch's three kernels (853) and 1.8 times
# ``torch.compile`` (1,472). In fp16 it reaches 1,442 GB/s, 2.1 times eager (682) and 2.2 times
# ``torch.compile`` (660), but only 49% of the copy: the 2.5 TB/s we aimed for is met in fp32
# from 2^26 elements and never in fp16. The reason shows in elements per second: 338 billion
# in fp32 and 360 billion in fp16, nearly the same, although an fp16 element has half the
# bytes. The pace is set per element, by arithmetic: the exact GELU's ``erf`` and the
# generator. The launch sweep (``tools/experiments/fused_dropout_sweep.py``) separates the
# two: a flat variant of this forward, same bytes and same generator, ran at 2.3 TB/s in fp16
# with ReLU and 1.5 with GELU.
#
# Forward plus backward: 2,288 GB/s in fp32 and 1,633 in fp16 at 2^28, against ``torch``'s
# 1,133 and 983 and ``torch.compile``'s 1,056 and 589. The backward pays the same arithmetic
# again: it regenerates the mask and evaluates GELU's derivative, ``erf`` included.
#
# What we learned
# ---------------
# * A counter-based generator makes a random number a pure function of (seed, counter): any
#   thread can compute any element's number, again and again, so a dropout mask can be
#   regenerated in the backward instead of stored.
# * Every element needs its own counter across the whole launch (global offsets), and every
#   launch its own seed, drawn from a generator the user seeds: never a counter that restarts
#   per tile, never a seed taken from an address.
# * One Philox call yields four 32-bit numbers; using all four cuts the generator's cost by
#   four, which matters when a kernel has only a few dozen instructions per element to spend.
# * A fused backward can recompute cheap intermediates (z = x + b) from what the caller holds
#   instead of saving them; a reduction across programs (the bias gradient) becomes partial
#   sums per program and a small final sum.
#
# Exercises
# ---------
# 1. Philox-4x32 with 7 rounds passes the same statistical tests as with 10 (Salmon et al.).
#    Pass ``n_rounds=7`` to ``tl.rand4x`` and measure the fp16 forward. When does it matter?
# 2. Write a dropout for a tensor of attention probabilities inside a kernel that already
#    has rows and columns (say, of a softmax): number the counters by (batch, head, row, col)
#    and check with ``row_correlation`` that heads and rows are independent.
# 3. Store the mask as bits instead of bytes (eight elements per ``uint8``). How much of the
#    stored-mask version's memory and time does that win back, and what does it cost?
