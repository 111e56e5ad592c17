r"""
Linear + cross-entropy without the logits
=========================================

We fuse a language model's last layer with its loss, forward and backward, in chunks of tokens,
so that the logits (3.9 GiB for 16,384 tokens and a vocabulary of 128,256 in bf16) never exist.

What you will learn:

* where the memory of a language model's head goes, in PyTorch and at the minimum;
* gradients computed in the forward pass, chunk by chunk, from chapter 09's loss kernel
  writing into the chunk's logits in place, and chapter 07's matmul;
* accumulating into a matmul's output (BLAS's beta = 1) instead of a sum of products;
* the chunk size as a trade between memory and speed, measured.

Prerequisites: chapter 05 (autograd for a linear layer), chapter 07 (the matmul),
chapter 09 (the loss kernel).
"""

# %%
# Setup
# -----

from stepkernels.lessons import bench, tutorial
import torch

tutorial.announce()
DEVICE = tutorial.DEVICE

# Linear + loss without the logits
# --------------------------------
# The logits come from the model's last layer, X = H W^T + b, with H the hidden states (N x D)
# and W the vocabulary's weights (V x D). For 16,384 tokens, D = 4,096 and V = 128,256 in bf16,
# H is 0.13 GiB, W 0.98 GiB, and X 3.9 GiB; PyTorch with fp32 logits keeps about six times
# that through the backward. Yet the loss needs only one row of X at a time, and every
# gradient follows from dX: dH = dX W, dW = dX^T H, db = the column sums of dX.
#
# So we take the tokens in chunks of C rows. For each chunk: the logits X_c = H_c W^T + b
# (chapter 07's matmul), the loss and dX_c written into X_c itself, a buffer of our own that
# nobody else holds, then dH_c = dX_c W and dW += dX_c^T H_c. One chunk of logits exists at a
# time. The accumulation ``matmul(a, b, accumulate=dW)`` adds the product to dW inside the
# matmul's epilogue, as BLAS's beta = 1 does, instead of a second C x V product and a sum; in
# bf16, dW is rounded once per chunk. C sets the trade: 256 MiB of bf16 logits is 1,024 tokens
# at V = 128,256, the matmuls' FLOPs do not change, and dW (0.98 GiB) is read and written
# once per chunk, 16 times for 16K tokens. The three matmuls cost 6 N D V FLOPs; the loss is
# a pass over X_c while it is in L2-sized pieces, nearly free next to them.

# @save ops/linear_cross_entropy
from stepkernels.ops.cross_entropy import (
    check_target,
    loss_rows,
    mean_scale,
    reduced_loss,
    scale_unless_one,
)
from stepkernels.ops.matmul import product
from stepkernels.runtime.arguments import (
    OPTIONAL_TENSOR_TYPES,
    TENSOR_TYPES,
    classes_in_range,
)
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    check_tensor,
    loss_dtype,
    refuse_double_backward,
)
from stepkernels.runtime.launch import lean_now, plan_cache
import torch

LOGITS_CHUNK_BYTES = 2**28  # logits held at once by linear_cross_entropy: 256 MiB


def chunk_rows(n_rows: int, n_cols: int, itemsize: int, chunk_tokens=None) -> int:
    """Tokens per chunk: a multiple of 128 (whole matmul tiles) within the budget."""
    if chunk_tokens is None:
        chunk_tokens = 128 * max(1, LOGITS_CHUNK_BYTES // (n_cols * itemsize) // 128)
    return max(1, min(n_rows, chunk_tokens))


def linear_loss_pass(
    x, weight, bias, target, options, needs, chunk_tokens=None, grad_scale=None
):
    """One pass over chunks of tokens: the loss per row, and the gradients that
    ``needs`` asks for (of x, weight, bias) times ``grad_scale``: None (1), one value or
    one per row."""
    n_rows, n_cols = x.shape[0], weight.shape[0]
    chunk = chunk_rows(n_rows, n_cols, x.element_size(), chunk_tokens)
    whole = chunk >= n_rows  # one chunk: no slices, and dX written where it stays
    grad_x = None
    if needs[0] and not whole:
        grad_x = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    grad_w = None
    grad_b = torch.zeros(n_cols, device=x.device) if needs[2] else None
    per_row = grad_scale is not None and grad_scale.dim() > 0
    losses = []
    for start in range(0, n_rows, chunk):
        rows = slice(start, start + chunk)
        x_rows = x if whole else x[rows]
        # product: matmul without its checks, done once by linear_cross_entropy
        logits = product(x_rows, weight.mT, None, bias)
        grad = logits if any(needs) else None  # in place: our own buffer
        scale = grad_scale[rows] if per_row and not whole else grad_scale
        part = target if whole else target[rows]
        losses.append(loss_rows(logits, part, options, grad, scale))
        del grad
        if not any(needs):
            continue
        if needs[0] and whole:
            grad_x = product(logits, weight)
        elif needs[0]:
            grad_x[rows] = product(logits, weight)
        if needs[1]:  # the first chunk's product, then the others added to it
            grad_w = product(logits.mT, x_rows, None, None, False, grad_w)
        if needs[2]:
            grad_b += logits.sum(dim=0, dtype=torch.float32)
        del logits  # before the next chunk's: one chunk of logits at a time
    if needs[0] and grad_x is None:  # no tokens
        grad_x = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if needs[1] and grad_w is None:  # no tokens, no product
        grad_w = torch.zeros_like(weight)
    grads = (grad_x, grad_w, None if grad_b is None else grad_b.to(x.dtype))
    if len(losses) == 1:
        return losses[0], grads
    return torch.cat(losses) if losses else x.new_empty(0, dtype=torch.float32), grads


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, options, chunk_tokens):
        needs = ctx.needs_input_grad[:3]
        early = options.reduction != "none"  # the gradients now, as for cross_entropy
        scale = mean_scale(target, options)  # 1 / the rows kept, for "mean"
        losses, grads = linear_loss_pass(
            x,
            weight,
            bias,
            target,
            options,
            needs if early else (False,) * 3,
            chunk_tokens,
            grad_scale=scale,
        )
        ctx.save_for_backward(x, weight, bias, target, scale)
        ctx.options, ctx.chunk_tokens, ctx.grads = options, chunk_tokens, grads
        ctx.early = early
        return reduced_loss(losses, target, options, loss_dtype(x))

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("linear_cross_entropy", "cross_entropy(F.linear(...))")
        none = (None, None, None)
        if ctx.early:  # computed in the forward: hand them over, once
            grads, ctx.grads, ctx.early = ctx.grads, none, False
            return *(
                g if g is None else scale_unless_one(g, grad_loss) for g in grads
            ), *none
        x, weight, bias, target, scale = ctx.saved_tensors
        row_scale = (grad_loss if scale is None else grad_loss * scale).float()
        _, grads = linear_loss_pass(
            x,
            weight,
            bias,
            target,
            ctx.options,
            ctx.needs_input_grad[:3],
            ctx.chunk_tokens,
            grad_scale=row_scale,
        )
        return *grads, *none


def linear_cross_entropy(
    x,
    weight,
    target,
    bias=None,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    reduction="mean",
    chunk_tokens=None,
):
    """``cross_entropy(x @ weight.T + bias, target)`` for x (tokens, hidden) and weight
    (vocabulary, hidden) of one dtype, with autograd, never holding more than
    ``chunk_tokens`` rows of logits (default: 256 MiB of them). A target outside [0, V)
    that is not ``ignore_index`` is an error, as for ``cross_entropy``: a ValueError for CPU
    tensors, a device-side assert on a GPU."""
    given = (ignore_index, label_smoothing, reduction, chunk_tokens)
    fast = type(x) is torch.Tensor and type(target) is torch.Tensor
    fast = fast and type(weight) in TENSOR_TYPES and type(bias) in OPTIONAL_TENSOR_TYPES
    fast = fast and type(ignore_index) is int and type(label_smoothing) in (int, float)
    fast = fast and type(reduction) is str and type(chunk_tokens) in (int, type(None))
    fast = fast and not torch.compiler.is_compiling() and lean_now()
    options = None
    if fast:  # a call seen before: checked then (the target's values: CPU's, each call)
        key = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device)
        key += (None,) if bias is None else (bias.shape, bias.dtype, bias.device)
        key = (*key, target.shape, target.dtype, target.device, *given)
        options = CHECKED_CALLS.get(key)
        if options is not None:
            classes_in_range(target, weight.shape[0], "target", ignore_index)
    if options is None:
        options = checked_options(x, weight, target, bias, *given)
        if fast:
            CHECKED_CALLS[key] = options
    if torch.compiler.is_compiling():  # an operator the compiler calls (below)
        return compiled_linear_cross_entropy(
            x, weight, bias, target, options, chunk_tokens
        )
    target = target.contiguous()
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        args = (x, weight, bias, target, options, chunk_tokens)
        return LinearCrossEntropyFunction.apply(*args)
    losses, _ = linear_loss_pass(
        x, weight, bias, target, options, (False,) * 3, chunk_tokens
    )
    return reduced_loss(losses, target, options, loss_dtype(x))


CHECKED_CALLS = plan_cache()  # calls' checked options, by what the checks read


def checked_options(
    x, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_tokens
):
    """The loss's options, once every argument is checked (raises, saying what to do)."""
    check_tensor(x, "x", FLOAT_DTYPES)
    check_tensor(weight, "weight", FLOAT_DTYPES)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be (tokens, hidden) and weight (vocabulary, hidden), got x "
            f"{tuple(x.shape)} and weight {tuple(weight.shape)}: flatten x with "
            "x.reshape(-1, x.shape[-1])"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight needs at least one row, got {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(
            f"weight is {weight.dtype} but x is {x.dtype}: one dtype for both, "
            "convert one with .to(...)"
        )
    if bias is not None:
        check_tensor(bias, "bias", (x.dtype,))
        if bias.shape != weight.shape[:1]:
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
    if chunk_tokens is not None and type(chunk_tokens) is not int:
        raise TypeError(f"chunk_tokens must be an int or None, got {chunk_tokens!r}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    shape = (x.shape[0], weight.shape[0])  # the logits'
    return check_target(target, shape, ignore_index, label_smoothing, reduction)


# %%
# ``torch.compile`` sees the layer as an operator of ``torch.library`` (chapter 08): a
# ``custom_op``, opaque as chapter 09's loss and chapter 04's ``matmul`` that it calls, with a
# fake implementation for the outputs' shapes and its derivative. For "mean" and "sum" the
# forward returns the gradients that will be asked for, which the backward scales.

# @save ops/linear_cross_entropy
from stepkernels.ops.cross_entropy import Options
from torch import Tensor
from torch.library import custom_op


@custom_op("stepkernels::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    smoothing: float,
    reduction: str,
    chunk_tokens: int | None,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The loss, then (reduced) the gradients of x, weight and bias that ``needs`` asks
    for, each else empty."""
    options = Options(ignore_index, smoothing, reduction)
    early = needs if reduction != "none" else (False, False, False)
    scale = mean_scale(target, options)
    losses, grads = linear_loss_pass(
        x, weight, bias, target, options, early, chunk_tokens, grad_scale=scale
    )
    loss = reduced_loss(losses, target, options, loss_dtype(x))
    return loss, *(x.new_empty(0) if g is None else g for g in grads)


def gradient_shapes(x, weight, wanted):
    """Empty tensors shaped as the gradients of x, weight and bias where ``wanted``."""
    shapes = (x.shape, weight.shape, weight.shape[:1])
    return tuple(
        x.new_empty(s if w else (0,)) for s, w in zip(shapes, wanted, strict=True)
    )


@linear_cross_entropy_op.register_fake
def _(x, weight, bias, target, ignore_index, smoothing, reduction, chunk_tokens, needs):
    shape = (x.shape[0],) if reduction == "none" else ()
    early = needs if reduction != "none" else (False, False, False)
    return x.new_empty(shape, dtype=loss_dtype(x)), *gradient_shapes(x, weight, early)


@custom_op("stepkernels::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    row_scale: Tensor,
    ignore_index: int,
    smoothing: float,
    chunk_tokens: int | None,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients (reduction "none"), each row's times ``row_scale``."""
    options = Options(ignore_index, smoothing, "none")
    _, grads = linear_loss_pass(
        x, weight, bias, target, options, needs, chunk_tokens, row_scale.float()
    )
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@linear_cross_entropy_backward_op.register_fake
def _(x, weight, bias, target, row_scale, ignore_index, smoothing, chunk_tokens, needs):
    return gradient_shapes(x, weight, needs)


def linear_cross_entropy_setup(ctx, inputs, output):
    x, weight, bias, target, *ctx.options, ctx.chunk_tokens, ctx.needs = inputs
    ctx.save_for_backward(x, weight, bias, target, *output[1:])
    ctx.set_materialize_grads(False)  # the gradient outputs get none


def linear_cross_entropy_backward(ctx, grad_loss, *_grad_grads):
    refuse_double_backward("linear_cross_entropy", "cross_entropy(F.linear(...))")
    x, weight, bias, target, *grads = ctx.saved_tensors
    ignore_index, smoothing, reduction = ctx.options
    if reduction == "none":
        scaled = (x, weight, bias, target, grad_loss, ignore_index, smoothing)
        grads = linear_cross_entropy_backward_op(*scaled, ctx.chunk_tokens, ctx.needs)
    else:  # computed in the forward
        grads = [g * grad_loss for g in grads]
    grads = [g if need else None for g, need in zip(grads, ctx.needs, strict=True)]
    return *grads, None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(
    linear_cross_entropy_backward, setup_context=linear_cross_entropy_setup
)


def compiled_linear_cross_entropy(x, weight, bias, target, options, chunk_tokens):
    tensors = (x, weight, bias)
    grads = torch.is_grad_enabled()
    needs = [grads and t is not None and t.requires_grad for t in tensors]
    chosen = (options.ignore_index, options.smoothing, options.reduction)
    args = (x, weight, bias, target.contiguous(), *chosen, chunk_tokens, needs)
    return linear_cross_entropy_op(*args)[0]


# %%
# We check it against PyTorch in fp64, in chunks of 7 rows so that the loop turns, with
# ignored rows, smoothing and a bias. GPT-2's vocabulary of 50,257 over 64 features makes
# each chunk's matmuls large enough to be autotuned, tens of seconds on a GPU: a quick GPU run
# checks 40,009 classes over 16 features (rows still split over programs, off the 16-byte
# grid; products below the autotuner's threshold), ``STEPKERNELS_FULL=1`` the full size, as
# ``tests/test_cross_entropy.py`` does on a GPU.


def check_linear_loss(n_rows, hidden, n_cols, dtype, reduction="mean", smoothing=0.0):
    x, weight, bias = (
        torch.randn(*shape, device=DEVICE).to(dtype) / hidden**0.25
        for shape in ((n_rows, hidden), (n_cols, hidden), (n_cols,))
    )
    target = torch.randint(0, n_cols, (n_rows,), device=DEVICE)
    target[1::4] = -100
    options = dict(label_smoothing=smoothing, reduction=reduction)
    ours = [t.clone().requires_grad_() for t in (x, weight, bias)]
    theirs = [t.double().requires_grad_() for t in (x, weight, bias)]
    loss = linear_cross_entropy(*ours[:2], target, ours[2], chunk_tokens=7, **options)
    logits = torch.nn.functional.linear(*theirs)
    want = torch.nn.functional.cross_entropy(logits, target, **options)
    grad_loss = torch.rand_like(want)
    got_grads = torch.autograd.grad(loss, ours, grad_loss.to(dtype))
    want_grads = torch.autograd.grad(want, theirs, grad_loss)
    tol = (1e-5 if dtype == torch.float32 else 3e-2) * (
        1 if dtype == torch.float32 else hidden**0.5
    )
    torch.testing.assert_close(loss.double(), want, rtol=tol, atol=tol)
    for got, wanted in zip(got_grads, want_grads, strict=True):
        scale = wanted.abs().max().item()
        torch.testing.assert_close(got.double(), wanted, rtol=tol, atol=tol * scale)


CHECK_SIZES = tutorial.choose(gpu=(16, 40_009), cpu=(64, 300), full=(64, 50_257))
for dtype in (torch.float32, torch.bfloat16):
    for reduction in ("mean", "sum", "none"):
        check_linear_loss(30, *CHECK_SIZES, dtype, reduction, 0.1)  # hidden, classes
print("linear_cross_entropy matches PyTorch in fp32 and bf16, every reduction")

# %%
# Benchmarks
# ----------
# The head of a Llama-3-sized model: D = 4,096, V = 128,256, bf16, 4,096 to 16,384 tokens,
# forward and backward (dH and dW; this head has no bias). We count the three matmuls'
# 6 N D V FLOPs, and draw cuBLAS's level as the limit. The peers: PyTorch as training scripts
# write it, with the logits upcast to fp32, ``F.cross_entropy(F.linear(h, w).float(), t)``;
# its ``torch.compile``; and Liger-Kernel's fused linear cross-entropy, which chunks tokens
# too, sized so that a chunk of logits is about as large as H, and calls cuBLAS. Solid lines
# are GPU time (CUDA-graph replays), dotted ones the call from Python; Liger asks the CPU
# whether ``grad_loss`` is 1, which a graph cannot capture, so its value is the call. A second
# benchmark records the peak memory beyond the inputs (dH and dW included: 0.98 GiB of them
# is dW), a third our time by chunk size at 16,384 tokens (a quick GPU run measures the first
# two at 16,384 tokens over the recording and shows the third as recorded: each chunk size
# autotunes products of its own).

try:  # Liger-Kernel, where installed
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
except ImportError:
    LigerFusedLinearCrossEntropyLoss = None
PROVIDERS = ["triton", "torch", "torch.compile"]
PROVIDERS += ["liger_kernel"] if LigerFusedLinearCrossEntropyLoss else []
HIDDEN, VOCABULARY = bench.choose(gpu=(4096, 128_256), cpu=(64, 300))
GPU_TOKENS = [4096, 8192, 16_384]  # measured on a GPU, and recorded
TOKENS = bench.choose(gpu=GPU_TOKENS, cpu=[32])
CHUNKS = [256, 512, 1024, 2048, 4096]


def torch_head(x, weight, target):
    logits = torch.nn.functional.linear(x, weight).float()
    return torch.nn.functional.cross_entropy(logits, target)


def head_function(provider, chunk_tokens=None):
    if provider == "triton":
        return lambda x, w, t: linear_cross_entropy(x, w, t, chunk_tokens=chunk_tokens)
    if provider == "liger_kernel":
        liger = LigerFusedLinearCrossEntropyLoss()
        return lambda x, w, t: liger(w, x, t)
    return torch_head if provider == "torch" else bench.compile_static(torch_head)


def make_head_call(provider, tokens, dtype, chunk_tokens=None):
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=dtype).requires_grad_()
    weight = torch.randn(VOCABULARY, HIDDEN, device=DEVICE) / HIDDEN**0.5
    weight = weight.to(dtype).requires_grad_()
    target = torch.randint(0, VOCABULARY, (tokens,), device=DEVICE)
    head = head_function(provider, chunk_tokens)
    return lambda: torch.autograd.grad(head(x, weight, target), (x, weight))


def head_benchmark(name, unit="TFLOP/s", chunks=False):
    """The head by tokens; with ``chunks``, ours by chunk size at the most tokens."""
    tokens = TOKENS[-1]
    if chunks:
        make = lambda p, chunk, dtype: make_head_call(p, tokens, dtype, chunk)
        work = lambda chunk, dtype: 6 * tokens * HIDDEN * VOCABULARY
    else:
        make = make_head_call
        work = lambda n, dtype: 6 * n * HIDDEN * VOCABULARY
    return bench.Benchmark(
        name=name,
        x_name="tokens per chunk, 16,384 tokens" if chunks else "tokens",  # on a GPU
        x_values=CHUNKS if chunks else TOKENS,
        providers=["triton"] if chunks else PROVIDERS,
        make=make,
        work=work,
        unit=unit,
        dtypes=(torch.bfloat16,),
        quick_dtypes=() if chunks else None,  # chunks: a quick run shows the recording
        smoke_x=8 if chunks else TOKENS[0],
        headline_x=1024 if chunks else GPU_TOKENS[-1],  # a recorded size
        uncapturable=("liger_kernel",),
    )


head_results = {}
for name, unit, chunks in (
    ("linear-cross-entropy", "TFLOP/s", False),
    ("linear-cross-entropy-memory", bench.MEMORY_UNIT, False),
    ("linear-cross-entropy-chunk-size", "TFLOP/s", True),
):
    head_results[name] = bench.run(head_benchmark(name, unit, chunks))


def show(results):
    for x in sorted({p.x for p in results.points}):  # the recorded sizes
        values = [
            f"{p} {results.value(p, x, 'bfloat16'):,.2f}" for p in results.providers()
        ]
        print(f"  {x:,.0f}: " + ", ".join(values))


for name, results in head_results.items():
    if results:
        print(
            f"{name} ({results.bench.unit}, by {results.bench.x_name}), {results.how}:"
        )
        show(results)
if timed := head_results["linear-cross-entropy"]:
    print("linear-cross-entropy, GPU time, ours against every peer:")
    print("  " + "\n  ".join(timed.standing("triton")))

# %%
# We are ahead of eager PyTorch at every size, and of Liger-Kernel's fused version, slowest
# at 4,096 tokens, where its chunks are smallest. ``torch.compile`` runs cuBLAS on the full
# logits and keeps several GiB for them: it is ahead of us in GPU time where the standing
# above says so, its cuBLAS products against our chunked ones. We keep a little more
# memory than Liger-Kernel, 0.98 GiB of it dW itself. The chunk sweep shows the trade:
# chunks of 2,048 or 4,096 tokens gain speed for 0.25 or 0.75 GiB more.
#
# What we learned
# ---------------
# * The logits of a large vocabulary are the memory of a language model's head; chunks of
#   tokens bound them, and the gradients of the layer need only the chunk's dX.
# * A loss kernel that writes its gradient in place turns the chunk's logits into its dX.
# * ``matmul(..., accumulate=dW)`` sums the weight gradient across chunks inside the epilogue.
#
# Exercises
# ---------
# 1. Choose the chunk from the memory the caller allows (``torch.cuda.mem_get_info``).
# 2. Keep dW in fp32 across chunks when the weight is bf16: how much memory, how much accuracy?
# 3. Skip the logits of chunks whose tokens are all ignored (padding): what must still be
#    written, and what does a batch with 30% padding gain?
