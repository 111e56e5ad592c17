r"""
Cross-entropy for large vocabularies
====================================

We write the language-model loss as one kernel that reads the logits once and writes their
gradient in the same pass, then a linear layer + loss that never holds the logits at all.

What you will learn:

* what PyTorch's loss moves and keeps for a 8,192 x 128,256 matrix of logits, against the
  minimum: one read, one write and one logits-sized buffer;
* the loss and its gradient from one online log-sum-exp, with label smoothing and ignored
  tokens folded into a *target distribution* q;
* computing a gradient in the forward pass, and handing it to autograd without a pass to
  scale it and without overwriting a tensor that someone still needs;
* chunking tokens so that a linear layer + loss keeps one chunk of logits at a time.

Prerequisites: chapter 02 (the online softmax), chapter 05 (autograd),
chapter 07 (the matmul we reuse).
"""

# %%
# Setup
# -----

from stepkernels import bench, tutorial
import torch

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# What the loss costs
# -------------------
# A language model ends with logits X, one row of V scores per token, and a target class t per
# row. The loss of a row is -log softmax(x)_t = lse(x) - x_t, with lse the log-sum-exp
# log sum_j exp(x_j); the gradient of a row is softmax(x) minus the one-hot row of t.
#
# ``F.cross_entropy`` runs ``log_softmax`` (read X, write a logits-sized Y, kept for the
# backward) and ``nll_loss`` (read a value per row). Its backward writes the gradient of Y, a
# logits-sized tensor of zeros with one value per row, then ``log_softmax``'s backward reads Y
# and that gradient and writes dX. Six passes over logits-sized tensors and three buffers the
# size of X; the minimum is two passes, read X and write dX, and dX is the only buffer.


def sizes(tokens, vocabulary, itemsize):
    logits = tokens * vocabulary * itemsize / 2**30
    return f"{logits:5.2f} GiB of logits; torch keeps {3 * logits:5.2f} GiB, we keep {logits:5.2f}"


for vocabulary in (32_768, 50_257, 128_256):
    print(f"8,192 tokens x {vocabulary:>7,} in bf16: {sizes(8192, vocabulary, 2)}")

# %%
# Training scripts often upcast first, ``F.cross_entropy(logits.float(), t)``: in bf16 that
# adds an fp32 copy of X and doubles every later buffer. At the H100's 3 TB/s a pass over 2 GiB
# takes 0.7 ms, so the arithmetic promises about 3x over eager PyTorch, with a third of its
# memory.
#
# The loss and its gradient, from one log-sum-exp
# -----------------------------------------------
# Two options change the formula. **Label smoothing** ε mixes the one-hot target with a uniform
# one: the target distribution becomes q_j = (1 - ε) [j = t] + ε / V. **Ignored tokens** (target
# equal to ``ignore_index``, padding say) count nothing. For the other rows:
#
#     loss = lse(x) - sum_j q_j x_j,        d loss / d x_j = softmax(x)_j - q_j.
#
# ``reduction="mean"`` divides by the number of rows not ignored, n, and so does the gradient.
# Everything the gradient needs (the row's lse, t, ε and n) is known in the forward pass. The
# only unknown is the gradient flowing into the loss from above, ``grad_loss``, and in training
# it is 1: ``loss.backward()`` starts there. So the forward can write dX = (softmax - q) / n
# while it holds the row, and the backward has nothing left to read.
#
# The kernel
# ----------
# One program per row. The first pass over the row is chapter 02's online softmax: a running
# maximum m and sum s of exp(x - m), one chunk of the row at a time, and beside them the dot
# product sum_j q_j x_j (which picks up x_t, so nothing reads X after the first pass but the
# gradient's own chunk). Then lse = m + log s, the row's loss, and a second pass that reads
# each chunk again and writes its gradient. A target outside [0, V) that is not
# ``ignore_index`` gives its row a NaN loss and gradient, never a finite number (PyTorch stops
# with a device-side assert).
#
# Three passes of traffic, unless the second read finds the row still in L2: a row of 128K
# bf16 values is 256 KB, and the 50 MB L2 holds the rows of about 200 programs at once. So the
# second pass walks the row backwards, from the chunks read last, and the first pass marks its
# loads ``evict_last``, the second ``evict_first``. Chapter 02's other answer, a row split over
# programs that wait for each other with their chunks in registers, measured slower here with
# a gradient to write: every program of a row waits for its slowest sibling
# (``tools/experiments/cross_entropy_split.py`` times both).

# @save cross_entropy
from dataclasses import dataclass

from stepkernels._core import (
    FLOAT_DTYPES,
    check_tensor,
    refuse_double_backward,
    sm_count,
)
from stepkernels.launch import lean  # cheap repeated launches: chapter 08
from stepkernels.softmax import as_rows, quiet
import torch
import triton
import triton.language as tl


@triton.jit
def smoothed_target(cols, target, n_cols, smoothing, SMOOTH: tl.constexpr):
    """q over ``cols``: 1 - ε at the target, plus ε / V everywhere (ε = 0 unless SMOOTH)."""
    if SMOOTH:
        return tl.where(cols == target, 1.0 - smoothing, 0.0) + smoothing / n_cols
    return tl.where(cols == target, 1.0, 0.0)


@triton.jit
def row_loss(lse, target_dot, target, n_cols, ignore_index):
    """lse - sum_j q_j x_j; 0 for an ignored row, NaN for a target out of range."""
    loss = tl.where((target < 0) | (target >= n_cols), float("nan"), lse - target_dot)
    return tl.where(target == ignore_index, 0.0, loss)


@triton.jit
def loss_gradient(x, cols, target, lse, scale, n_cols, smoothing, ignore_index,
                  SMOOTH: tl.constexpr):  # fmt: skip
    """(softmax - q) * scale over ``cols``, with the same rules as ``row_loss``."""
    grad = (
        tl.exp(x - lse) - smoothed_target(cols, target, n_cols, smoothing, SMOOTH)
    ) * scale
    grad = tl.where((target < 0) | (target >= n_cols), float("nan"), grad)
    return tl.where(target == ignore_index, 0.0, grad)


@triton.jit
def row_statistics(x_row, target, n_cols, smoothing, BLOCK_N: tl.constexpr,
                   SMOOTH: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """One online pass over a row: its maximum, sum of exp(x - maximum) and sum_j q_j x_j."""
    cols = tl.arange(0, BLOCK_N)
    running_max = -float("inf")
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    lane_dot = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
        offsets = start + cols
        in_row = offsets < n_cols
        x = tl.load(x_row + offsets, mask=in_row, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)  # fmt: skip
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        q = smoothed_target(offsets, target, n_cols, smoothing, SMOOTH)
        lane_dot += tl.where(in_row, q * x, 0.0)
        running_max = new_max
    return running_max, tl.sum(lane_sum, axis=0), tl.sum(lane_dot, axis=0)


@lean
@triton.jit
def cross_entropy_looped_kernel(
    logits_ptr, target_ptr, grad_ptr, loss_ptr, lse_ptr, grad_scale_ptr, n_rows, n_cols,
    logits_row_stride, grad_row_stride, ignore_index, smoothing, BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr, WRITE_GRAD: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        logits_row = logits_ptr + tl.cast(row, tl.int64) * logits_row_stride
        target = tl.load(target_ptr + row).to(tl.int64)
        row_max, row_sum, row_dot = row_statistics(
            logits_row, target, n_cols, smoothing, BLOCK_N, SMOOTH, NUM_STAGES
        )
        lse = row_max + tl.log(row_sum)
        tl.store(loss_ptr + row, row_loss(lse, row_dot, target, n_cols, ignore_index))
        tl.store(lse_ptr + row, lse)
        if WRITE_GRAD:
            scale = 1.0
            if HAS_GRAD_SCALE:
                scale = tl.load(grad_scale_ptr)
            grad_row = grad_ptr + tl.cast(row, tl.int64) * grad_row_stride
            for chunk in tl.range(0, n_chunks, num_stages=NUM_STAGES):
                cols = (n_chunks - 1 - chunk) * BLOCK_N + tl.arange(0, BLOCK_N)
                in_row = cols < n_cols
                x = tl.load(logits_row + cols, mask=in_row, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)  # fmt: skip
                grad = loss_gradient(x, cols, target, lse, scale, n_cols, smoothing,
                                     ignore_index, SMOOTH)  # fmt: skip
                tl.store(
                    grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_row
                )


# %%
# The backward
# ------------
# When ``grad_loss`` is 1, the gradient the forward wrote is the answer. Checking that on the
# CPU would cost a synchronization (``.item()``) and would break a CUDA graph (chapter 08), so
# a tiny kernel checks it on the GPU: every program loads ``grad_loss`` and returns at once when
# it is 1, else scales its part of the gradient in place. Two cases need the gradient again:
# ``reduction="none"``, whose ``grad_loss`` has a value per row, and a second backward through
# the same graph (``retain_graph=True``), after the first handed its buffer to autograd. Both
# recompute it from X and the saved lse: a read and a write, one elementwise kernel.

# @save cross_entropy


@lean
@triton.jit
def scale_unless_one_kernel(grad_ptr, factor_ptr, n_elements, BLOCK: tl.constexpr):
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        first = tl.program_id(0).to(tl.int64) * BLOCK
        for start in range(first, n_elements, tl.num_programs(0) * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            in_range = offsets < n_elements
            grad = tl.load(grad_ptr + offsets, mask=in_range).to(tl.float32) * factor
            tl.store(
                grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=in_range
            )


@lean
@triton.jit
def cross_entropy_backward_kernel(
    logits_ptr, target_ptr, lse_ptr, row_scale_ptr, grad_ptr, n_cols, n_chunks,
    logits_row_stride, grad_row_stride, row_scale_stride, ignore_index, smoothing,
    BLOCK_N: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    cols = (tl.program_id(0) % n_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=in_row).to(tl.float32)
    target = tl.load(target_ptr + row).to(tl.int64)
    scale = tl.load(row_scale_ptr + row * row_scale_stride).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    grad = loss_gradient(
        x, cols, target, lse, scale, n_cols, smoothing, ignore_index, SMOOTH
    )
    grad_row = grad_ptr + row * grad_row_stride
    tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_row)


# %%
# Launches and the autograd function
# ----------------------------------
# The launch rules are the fastest of a sweep on an H100 (``cross_entropy_split.py``): chunks
# of 4,096 values, 4 warps for 16-bit logits and 8 for fp32, 2,048 and 4 warps for the forward
# alone; a program per row beat a persistent grid. The gradient buffer is new, never X: the
# caller may still need X, and autograd may have saved it for an earlier operation. Row
# offsets are 64-bit: 8,192 x 262,144 fp32 logits pass 2^31 elements.

# @save cross_entropy
BACKWARD_BLOCK = 4096  # values per program of the backward kernel
SCALE_BLOCK, SCALE_PROGRAMS_PER_SM = 4096, 4
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class Options:
    ignore_index: int
    smoothing: float
    reduction: str


@dataclass(frozen=True)
class Launch:
    block_n: int  # values per chunk of the loop
    num_warps: int
    programs_per_sm: int = 0  # a persistent grid; 0 launches a program per row
    num_stages: int = 2  # chunks loaded ahead


def default_launch(element_size: int, write_grad: bool) -> Launch:
    if write_grad:
        return Launch(4096, 8 if element_size == 4 else 4)
    return Launch(2048, 4)


def loss_rows(logits, target, options, grad=None, grad_scale=None, launch=None):
    """Per row: the loss and the lse, fp32. Writes the gradient into ``grad`` if given
    (``logits`` itself for in place), times ``grad_scale`` (one element) if given."""
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(losses)
    if n_rows == 0:
        return losses, lse
    launch = launch or default_launch(logits.element_size(), grad is not None)
    per_sm = launch.programs_per_sm
    grid = (min(n_rows, per_sm * sm_count()) if per_sm else n_rows,)
    with quiet():
        cross_entropy_looped_kernel[grid](
            logits, target, logits if grad is None else grad, losses, lse, grad_scale,
            n_rows, n_cols, logits.stride(0), 0 if grad is None else grad.stride(0),
            options.ignore_index, options.smoothing, BLOCK_N=launch.block_n,
            SMOOTH=options.smoothing > 0, WRITE_GRAD=grad is not None,
            HAS_GRAD_SCALE=grad_scale is not None, NUM_STAGES=launch.num_stages,
            num_warps=launch.num_warps,
        )  # fmt: skip
    return losses, lse


def gradient_rows(logits, target, lse, row_scale, options, grad=None):
    """softmax - q per row, times ``row_scale`` (one value, or one per row); in place when
    ``grad`` is ``logits``."""
    grad = torch.empty_like(logits) if grad is None else grad
    if grad.numel() == 0:
        return grad
    block = min(BACKWARD_BLOCK, triton.next_power_of_2(logits.shape[1]))
    n_chunks = triton.cdiv(logits.shape[1], block)
    with quiet():
        cross_entropy_backward_kernel[(logits.shape[0] * n_chunks,)](
            logits, target, lse, row_scale, grad, logits.shape[1], n_chunks,
            logits.stride(0), grad.stride(0), row_scale.stride(0) if row_scale.dim() else 0,
            options.ignore_index, options.smoothing, BLOCK_N=block,
            SMOOTH=options.smoothing > 0, num_warps=8,
        )  # fmt: skip
    return grad


def scale_unless_one(tensor, factor):
    """``tensor *= factor`` in place, skipped on the GPU (no synchronization) when it is 1."""
    if tensor.numel():
        grid = (min(triton.cdiv(tensor.numel(), SCALE_BLOCK),
                    SCALE_PROGRAMS_PER_SM * sm_count()),)  # fmt: skip
        scale_unless_one_kernel[grid](tensor, factor, tensor.numel(), BLOCK=SCALE_BLOCK)
    return tensor


def reduce_losses(losses, count, reduction):
    if reduction == "none":
        return losses
    return losses.sum() / count if reduction == "mean" else losses.sum()


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, options):
        count = target.ne(options.ignore_index).sum(dtype=torch.float32)
        grad = None if options.reduction == "none" else torch.empty_like(logits)
        scale = count.reciprocal() if options.reduction == "mean" else None
        losses, lse = loss_rows(logits, target, options, grad, scale)
        ctx.save_for_backward(logits, target, lse, count)
        ctx.options, ctx.grad = options, grad
        return reduce_losses(losses, count, options.reduction).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("cross_entropy", "torch.nn.functional.cross_entropy")
        if ctx.grad is not None:  # computed in the forward: hand it over, once
            grad, ctx.grad = ctx.grad, None
            return scale_unless_one(grad, grad_loss), None, None
        logits, target, lse, count = ctx.saved_tensors
        mean = ctx.options.reduction == "mean"
        row_scale = (grad_loss / count if mean else grad_loss).float()
        return gradient_rows(logits, target, lse, row_scale, ctx.options), None, None


def check_target(target, n_rows, ignore_index, label_smoothing, reduction) -> Options:
    check_tensor(target, "target")
    if target.is_floating_point() or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold class indices as int64 or int32, got {target.dtype}; class "
            "probabilities are not supported: convert indices with target.long()"
        )
    if target.shape != (n_rows,):
        raise ValueError(f"target must have shape ({n_rows},), one class per row, got "
                         f"{tuple(target.shape)}")  # fmt: skip
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return Options(int(ignore_index), float(label_smoothing), reduction)


def check_loss_inputs(
    logits, target, ignore_index, label_smoothing, reduction
) -> Options:
    check_tensor(logits, "logits", FLOAT_DTYPES)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be (tokens, vocabulary) with a vocabulary of at least 1, got shape "
            f"{tuple(logits.shape)}: flatten with logits.reshape(-1, logits.shape[-1]) (for "
            "(N, C, d1, ...) logits, move the class dimension last first)"
        )
    return check_target(
        target, logits.shape[0], ignore_index, label_smoothing, reduction
    )


def cross_entropy(
    logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean"
):
    """``torch.nn.functional.cross_entropy`` for (tokens, vocabulary) logits in fp32, fp16 or
    bf16 and integer targets, computed in fp32, with autograd. A target outside [0, V) that
    is not ``ignore_index`` gives NaN for its row."""
    options = check_loss_inputs(
        logits, target, ignore_index, label_smoothing, reduction
    )
    logits, target = as_rows(logits), target.contiguous()
    if logits.requires_grad and torch.is_grad_enabled():
        return CrossEntropyFunction.apply(logits, target, options)
    count = target.ne(options.ignore_index).sum(dtype=torch.float32)
    losses, _ = loss_rows(logits, target, options)
    return reduce_losses(losses, count, reduction).to(logits.dtype)


# %%
# Correctness
# -----------
# Against ``F.cross_entropy`` computed in fp64 from the same logits: values and gradients,
# with odd vocabularies, label smoothing together with ignored rows, every reduction, a
# strided slice of a wider matrix, and large logits. We compute in fp32 and round once; the
# tolerances are a few units in the last place of the dtype. Then what our kernel does where
# torch stops: a target out of range gives NaN, and bad calls get errors that say what to do.

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_loss(n_rows, n_cols, dtype, reduction="mean", smoothing=0.0, scale=1.0):
    x = (scale * torch.randn(n_rows, n_cols + 3, device=DEVICE)).to(dtype)[:, :n_cols]
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    target[::3] = -100  # ignored rows
    options = dict(label_smoothing=smoothing, reduction=reduction)
    x64 = x.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(x64, target, **options)
    loss = cross_entropy(x.requires_grad_(), target, **options)
    grad_loss = torch.rand_like(want)  # not 1: the scaling path too
    (got_grad,) = torch.autograd.grad(loss, x, grad_loss.to(loss.dtype))
    (want_grad,) = torch.autograd.grad(want, x64, grad_loss)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(loss.double(), want, rtol=tol, atol=tol)
    # exp(x - lse) loses digits as |x| grows: the absolute tolerance grows with the logits
    torch.testing.assert_close(
        got_grad.double(), want_grad, rtol=tol, atol=tol * scale / 100
    )


n_cols = bench.choose(gpu=128_256, cpu=5003)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for reduction, smoothing in (("mean", 0.0), ("sum", 0.1), ("none", 0.2)):
        check_loss(bench.choose(gpu=257, cpu=7), n_cols, dtype, reduction, smoothing)
check_loss(5, 50_257 if tutorial.ON_GPU else 1000, torch.float32, scale=1000.0)
print(
    f"cross_entropy matches PyTorch: V = {n_cols:,} and others, 3 dtypes, 3 reductions"
)
bad_target = torch.tensor([1, 7, -100, -3], device=DEVICE)
print("targets 1, 7 (of V = 5), ignored, -3:",
      cross_entropy(torch.zeros(4, 5, device=DEVICE), bad_target, reduction="none"))  # fmt: skip
zeros = lambda *shape, dtype=None: torch.zeros(*shape, device=DEVICE, dtype=dtype)
tutorial.show_refusals("cross_entropy()", {
    "float target": lambda: cross_entropy(zeros(2, 5), zeros(2)),
    "3-D logits": lambda: cross_entropy(zeros(2, 3, 5), zeros(2, 3, dtype=torch.long)),
    "wrong target shape": lambda: cross_entropy(zeros(2, 5), zeros(3, dtype=torch.long)),
    "int8 logits": lambda: cross_entropy(zeros(2, 5, dtype=torch.int8), zeros(2).long()),
    "reduction": lambda: cross_entropy(zeros(2, 5), zeros(2).long(), reduction="avg"),
})  # fmt: skip

# %%
# Benchmarks
# ----------
# 8,192 tokens, vocabularies from 16,384 to 131,072 (GPT-2's 50,257 among them), bf16 and
# fp32, forward alone and forward + backward, against eager PyTorch, ``torch.compile`` and
# Liger-Kernel's loss, which writes the gradient into the logits themselves. We count the
# compulsory bytes: the logits read once, plus the gradient written once with the backward.
# Liger's backward asks the CPU whether ``grad_loss`` is 1 (``torch.equal``), which a CUDA
# graph cannot capture, so every provider is timed as called from Python (do_bench, L2
# flushed): at these sizes each call is 0.1 to 10 ms of GPU work. The copy of the same bytes
# is the limit. A third benchmark records each provider's peak memory beyond its inputs.

try:  # Liger-Kernel, where installed
    from liger_kernel.transformers import LigerCrossEntropyLoss
except ImportError:
    LigerCrossEntropyLoss = None
PROVIDERS = ["triton", "torch", "torch.compile"] + (
    ["liger_kernel"] if LigerCrossEntropyLoss else []
)
TOKENS = bench.choose(gpu=8192, cpu=16)
VOCABULARIES = [16_384, 32_768, 50_257, 65_536, 131_072]


def loss_function(provider):
    if provider == "triton":
        return cross_entropy
    if provider == "liger_kernel":
        return LigerCrossEntropyLoss()
    torch_loss = torch.nn.functional.cross_entropy
    return torch_loss if provider == "torch" else bench.compile_static(torch_loss)


def make_loss_call(provider, n_cols, dtype, backward=True):
    logits = torch.randn(TOKENS, n_cols, device=DEVICE, dtype=dtype)
    logits.requires_grad_(backward)
    target = torch.randint(0, n_cols, (TOKENS,), device=DEVICE)
    loss = loss_function(provider)
    if not backward:
        return lambda: loss(logits, target)
    return lambda: torch.autograd.grad(loss(logits, target), logits)


def loss_benchmark(name, backward, unit="GB/s"):
    passes = 2 if backward else 1
    return bench.Benchmark(
        name=name, x_name=f"V (vocabulary), {TOKENS:,} tokens", x_values=VOCABULARIES,
        providers=PROVIDERS + ([bench.COPY_PROVIDER] if unit == "GB/s" else []),
        make=lambda p, n, dtype: make_loss_call(p, n, dtype, backward),
        work=lambda n, dtype: passes * TOKENS * n * dtype.itemsize, unit=unit,
        dtypes=(torch.bfloat16,) if unit != "GB/s" else (torch.bfloat16, torch.float32),
        smoke_x=1000, headline_x=131_072, gpu_time=False,
    )  # fmt: skip


loss_results = {}
for name, backward, unit in (
    ("cross-entropy-forward", False, "GB/s"),
    ("cross-entropy-forward-backward", True, "GB/s"),
    ("cross-entropy-memory", True, bench.MEMORY_UNIT),
):
    loss_results[name] = bench.run(loss_benchmark(name, backward, unit))


def show(results, x_values=(32_768, 50_257, 131_072)):
    for dtype in dict.fromkeys(p.dtype for p in results.points):
        for x in x_values:
            shown = ", ".join(f"{p} {results.value(p, x, dtype):,.2f}"
                              for p in results.bench.providers)  # fmt: skip
            print(f"  {dtype}, V = {x:,}: {shown}")


for name, results in loss_results.items():
    if results:
        print(f"{name} ({results.bench.unit}), {results.how}:")
        show(results)

# %%
# Forward and backward, our loss is ahead of torch, ``torch.compile`` and Liger-Kernel at every
# power-of-two vocabulary from 32,768, in both dtypes, but far from the copy of the same bytes:
# about half of it in bf16, two thirds in fp32. The second pass does not find all of its row
# in L2. At V = 50,257 we fall behind, in bf16 behind every peer, in fp32 behind Liger: a row
# of 50,257 values starts at an address that is not a multiple of 16 bytes, so the compiler
# cannot prove any load aligned and issues narrow ones (our reading; exercise 2 tests it).
# The forward alone, which reads the logits once, runs near the copy in fp32. Memory is the
# promised one logits-sized buffer, the gradient, as for ``torch.compile``, against three for
# eager PyTorch; Liger-Kernel adds nothing because it overwrites the caller's logits with
# their gradient.
#
# What we learned
# ---------------
# * The loss and its gradient come from one online log-sum-exp and the target distribution q:
#   loss = lse - q·x, gradient = softmax - q, so smoothing and ignored rows cost nothing extra.
# * A gradient known in the forward can be written there; the backward then only scales it,
#   on the GPU, skipping the pass when ``grad_loss`` is 1 (no synchronization, graph-safe).
# * Autograd owns what we return: hand a buffer over once, recompute for a second backward,
#   and never overwrite a tensor that the caller or autograd still holds.
# * A second pass over a row can come from L2, if the row is small enough and read backwards.
#
# Exercises
# ---------
# 1. Add ``z_loss`` (PaLM's lse² penalty): what changes in the loss and in the gradient?
# 2. At V = 50,257, pad each row to 50,264 (a multiple of 8) with ``-inf`` in a wider buffer
#    and pass the slice: does the bandwidth come back? Then handle the misaligned head of a row
#    inside the kernel instead, so that callers need not pad.
# 3. Make the second pass cheaper still: split a row over two programs that each keep half of
#    it in registers, as chapter 02's split softmax does, and measure against our loop.
