r"""
Launch overhead: what a call costs, and CUDA graphs and torch.compile to remove it
==================================================================================

Our kernels move memory near the copy bandwidth, yet a model built from them, called from
Python one operation at a time, can run slower than PyTorch. This chapter measures what a call
costs the CPU and where, makes our launches cheap, and then removes the CPU from the loop: a
whole training step replayed as a CUDA graph, and ``torch.compile`` tracing our kernels.

What you will learn:

* where the CPU time of a call goes: the Python wrapper, Triton's launcher, autograd's engine
  calling a Python backward; and which of these we can shrink;
* a launch that skips Triton's argument binding once a shape has been seen
  (``stepkernels.runtime.launch.lean``), host arithmetic without Triton's
  ``constexpr_function`` helpers, and skipping autograd when nothing needs a gradient;
* capturing a training step as a CUDA graph (``torch.cuda.graph``,
  ``torch.cuda.make_graphed_callables``), and what must stay static for that;
* ``torch.library.triton_op``: an operator whose Triton kernels ``torch.compile`` sees, so
  that its ``"reduce-overhead"`` mode replays our kernels from CUDA graphs.

Prerequisites: chapters 02 (softmax), 03 (layer norm), 05 (the fused linear layer).
"""

# %%
# Setup
# -----

import cProfile
import functools
import inspect
import pstats
import sys
import timeit

from stepkernels import FusedLinear
from stepkernels.lessons import bench, tutorial
from stepkernels.lessons import calls as calls_of
from stepkernels.runtime.launch import LeanKernel, cdiv, triton_launches
import torch
from torch import nn
import triton

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# The arithmetic of a call
# ------------------------
# A softmax over 4,096 rows of 1,024 fp16 values reads 8 MiB and writes 8 MiB: at the H100's
# 3 TB/s of copy bandwidth the GPU needs under 6 µs. Issuing it is CPU work: Python checks the
# input and allocates the output, Triton's launcher binds the arguments and finds the compiled
# kernel, the CUDA driver queues it. When that takes longer than the kernel, the GPU waits for
# the CPU, and a model made of such calls runs at the CPU's pace. ``torch.softmax`` is C++ from
# end to end; ours is Python until the driver call.
#
# Where the time goes
# -------------------
# We time the CPU side of each piece alone, 200 calls issued back to back (``bench.cpu_us``),
# on the GPU's host. The first three launch an empty kernel: through Triton's ``kernel[grid]``,
# through our ``lean`` launch, and the compiled kernel's launcher called directly, the floor.

LAUNCH_PIECES = {
    0: "empty kernel: Triton's kernel[grid]",
    1: "empty kernel: lean",
    2: "compiled launcher alone",
    3: "torch.empty_like",
    4: "autograd.Function.apply",
    5: "autograd.grad, Python backward",
    6: "autograd.grad, C++ backward",
}


class Identity(torch.autograd.Function):
    """The cheapest autograd.Function: what the machinery costs, with no kernel."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def make_piece(provider, piece, dtype):
    # a lean kernel, launched on 1 x 16 values
    from stepkernels.ops.softmax import softmax_kernel
    import triton

    x = torch.zeros(1, 16, device=DEVICE, dtype=dtype)
    y, grad = torch.empty_like(x), torch.ones_like(x)
    leaf = x.clone().requires_grad_()
    args, meta = (x, y, 1, 16, 16, 16), dict(ROWS=1, BLOCK_N=16, LOG=False, num_warps=4)
    compiled = softmax_kernel.kernel[(1,)](*args, **meta)

    def launcher_alone():  # what a lean launch calls (stepkernels.runtime.launch)
        stream = triton.runtime.driver.active.get_current_stream(x.device.index)
        compiled.run(1, 1, 1, stream, *kernel, *hooks, *args, *constexprs)

    if tutorial.ON_GPU:  # the interpreter has no launcher
        kernel = (compiled.function, compiled.packed_metadata)
        hooks = (None, None, None)  # launch metadata, enter and exit hooks: none
        constexprs = (1, 16, False)  # ROWS, BLOCK_N, LOG: the launcher takes them too
    return {
        0: lambda: softmax_kernel.kernel[(1,)](*args, **meta),
        1: lambda: softmax_kernel[(1,)](*args, **meta),
        2: launcher_alone if tutorial.ON_GPU else lambda: None,
        3: lambda: torch.empty_like(x),
        4: lambda: Identity.apply(leaf),
        5: lambda: torch.autograd.grad(Identity.apply(leaf), leaf, grad),
        6: lambda: torch.autograd.grad(leaf * 1, leaf, grad),
    }[piece]


pieces = bench.run(
    bench.Benchmark(
        name="launch-pieces",
        x_name="piece of a call",
        x_values=list(LAUNCH_PIECES),
        providers=["cpu"],
        make=make_piece,
        work=lambda x, dtype: 1,
        unit=bench.CPU_UNIT,
        dtypes=(torch.float16,),
        smoke_x=1,
        headline_x=None,  # the lines below name each piece
        x_labels=LAUNCH_PIECES,
    )
)
if pieces:
    print(f"CPU per call, {pieces.how}:")
    for piece, label in LAUNCH_PIECES.items():
        print(f"  {label:<38} {pieces.value('cpu', piece, 'float16'):6.1f} µs")

# %%
# Triton's ``kernel[grid](...)`` costs more than twice what its launcher needs. At every call
# it binds the arguments to the kernel's signature, works out how each one specializes the
# kernel (its dtype, whether a pointer is 16-byte aligned, whether an integer is 1 or a
# multiple of 16), turns that into a cache key and looks the compiled kernel up. Autograd adds
# its own cost: ``apply`` builds a graph node, and a backward written in Python is called by
# autograd's engine from its own thread. A forward+backward of one operation through
# ``torch.autograd.grad`` costs tens of microseconds before any kernel of ours runs.
#
# A lean launch
# -------------
# The answers Triton works out change only with the arguments' dtypes, alignments and integer
# values. ``stepkernels.runtime.launch.lean`` wraps a kernel: the first call with a new *launch key*
# goes through Triton, and later calls with that key call the compiled kernel's launcher
# directly. Every kernel of the package is declared ``@lean``. The key holds every integer's
# value, so it is finer than Triton's own: a call Triton would compile differently never
# reuses another's kernel (``tests/test_launch.py`` checks aligned and unaligned inputs).

print(inspect.getsource(LeanKernel.key))

# %%
# Three more rules make our wrappers lean. Launch decisions (block sizes, warps, the grid's
# shape) are computed once per shape and kept (``functools.cache``), so a repeated call looks
# them up. What is left at every call is a little integer arithmetic, and there Triton's own
# helpers are a trap: ``triton.cdiv`` and ``triton.next_power_of_2`` are
# ``constexpr_function`` objects (since Triton 3.5), callable from kernels and from the host,
# and a host call pays for that generality:

seconds = lambda fn: timeit.timeit(fn, number=20_000) / 20_000
print(
    f"triton.cdiv(4096, 128): {seconds(lambda: triton.cdiv(4096, 128)) * 1e6:.2f} µs; "
    f"cdiv(4096, 128): {seconds(lambda: cdiv(4096, 128)) * 1e6:.2f} µs (this CPU)"
)

# %%
# So the package's host code takes ``cdiv`` and ``next_power_of_2`` from
# ``stepkernels.runtime.launch``: plain arithmetic. Each argument is checked once per call:
# chapter 05's layer checks its inputs, then calls chapter 04's ``product`` (``matmul`` less
# its checks) for its three products. Each operation records one ``autograd.Function``
# node, with no reshape or view nodes around it for the engine to walk. And when nothing
# needs a gradient, under ``torch.no_grad()`` or for inputs that do not require one, the
# public functions call the forward wrapper directly instead of an ``autograd.Function``.
#
# The last step skips even the key. What a call's launches read from it is its tensors'
# shapes, strides, dtypes, devices and alignments, and its other arguments: keyed by those, a
# repeated call of softmax, layer norm, matmul, linear, the losses or attention skips its
# checks, which passed for that key, its launch rules and ``LeanKernel.key``. Its first
# call's launches are recorded (``recorded_launches``) and bound (``LeanKernel.bound``: grid,
# integers, constexprs, compiled kernel fixed): a repeat passes its tensors (or descriptors).
#
# Benchmark: CPU per call, before and after
# -----------------------------------------
# Every public operation at 64 x 256 fp16 (attention: 1 x 4 heads of 64 x 64; matmul, linear
# and the losses 256 features), where the GPU's work is a few microseconds and a call costs
# what the CPU spends on it: forward alone (no input requires a gradient), and forward and
# backward through ``torch.autograd.grad``. Ours, ours launched through Triton's own path
# (inside ``triton_launches()``: what ``lean`` saves, the "before"), torch's own operation,
# and the *floor*, the least a wrapper launching through Triton can cost
# (``calls.make_floor``): our allocations and as many launches of empty ``@triton.jit``
# twins of our kernels, through the compiled launcher with every argument bound; with a
# backward, inside an ``autograd.Function``. Targets: at most 1.5 times torch's CPU time per
# forward, twice per forward and backward; where the floor itself is above that, at most
# 1.1 times the floor.

ROWS, WIDTH = tutorial.choose(gpu=(64, 256), cpu=(8, 32))
HEAD_DIM = tutorial.choose(gpu=64, cpu=16)
HEADS = (1, 4, ROWS, HEAD_DIM)  # batch, heads, sequence, head dim
# x value -> "softmax", "softmax fwd+bwd", ...: every public operation (lessons.calls)
CALLS = calls_of.labels()
PROFILED = list(CALLS.values()).index("layer_norm fwd+bwd")


def operation_call(provider, index, dtype):
    """The call ``CALLS[index]`` by ``provider``, on fresh inputs."""
    if provider == "floor":
        return calls_of.make_floor(CALLS[index], ROWS, WIDTH, HEADS, DEVICE, dtype)
    ours = provider != "torch"
    call = calls_of.make_call(CALLS[index], ours, ROWS, WIDTH, HEADS, DEVICE, dtype)
    if provider == "triton (Triton's launch)":
        return lambda: launched_by_triton(call)
    return call


def launched_by_triton(call):
    with triton_launches():
        return call()


calls = bench.run(
    bench.Benchmark(
        name="cpu-per-call",
        x_name="operation, 64 x 256 fp16",  # on a GPU
        x_values=list(CALLS),
        providers=["triton", "triton (Triton's launch)", "torch", "floor"],
        make=operation_call,
        work=lambda x, dtype: 1,
        unit=bench.CPU_UNIT,
        dtypes=(torch.float16,),
        smoke_x=PROFILED,
        headline_x=None,  # the lines below name each operation
        x_labels=CALLS,
    )
)
if calls:  # by the names recorded: a recording made before an operation joined lacks it
    print(f"µs of CPU per call, {calls.how}:")
    print(f"  {'':<28} {'ours':>6} {'Triton launch':>14} {'torch':>6} {'floor':>6}")
    for index, label in calls.bench.x_labels.items():
        ours, triton_path, theirs, least = (
            calls.value(p, index, "float16") for p in calls.bench.providers
        )
        target = 2.0 if "bwd" in label else 1.5
        # Where even the floor misses torch's target, ours must come within 10% of it.
        met = ours <= (1.1 * least if least > target * theirs else target * theirs)
        print(
            f"  {label:<28} {ours:6.1f} {triton_path:14.1f} {theirs:6.1f} {least:6.1f}"
            f"  {ours / theirs:3.1f}x torch, {ours / least:4.2f}x floor: "
            + ("meets" if met else "misses")
            + (", torch below the floor" if theirs < least else "")
        )
    lean_ratio = lambda x: calls.ratio(
        "triton", "triton (Triton's launch)", x, "float16"
    )
    slower = [label for x, label in calls.bench.x_labels.items() if lean_ratio(x) > 1]
    print("Slower lean than through Triton's launch:", ", ".join(slower) or "none")

# %%
# Where the time of one call goes now: ``cProfile`` over 100 calls of ``layer_norm``'s
# forward and backward, the functions that take the most time of their own. On a GPU these
# are our wrappers, autograd's and the launcher; under the interpreter the interpreter's own
# functions lead (it runs the kernel), and ``lab/call_cost.py`` measures our Python without
# a GPU, launches made no-ops, per operation, before and after.


PROFILED_CALLS = tutorial.choose(gpu=100, cpu=3)  # the interpreter's calls are slow


def profile_call(call, calls=PROFILED_CALLS, top=8) -> None:
    call()  # compiled, tuned, keyed
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [call() for _ in range(calls)])
    stats = pstats.Stats(profiler, stream=sys.stdout).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)


profile_call(operation_call("triton", PROFILED, torch.float16))

# %%
# The call from Python at full size
# ---------------------------------
# At 4096 x 4096 fp16 the GPU's work is no longer small (a softmax forward and backward
# moves 168 MB, 56 µs at the H100's copy bandwidth), and a user's call runs at the slower of
# the CPU issuing it and the GPU running it. Here each call is timed as a user makes it
# (``do_bench`` of the Python call) beside the GPU time alone, ours and torch's: the target is
# a call rate at least torch's. Bytes counted: x read and y written (forward), and x or y,
# dy read and dx written again (backward).

RATE_CALLS = calls_of.labels(("softmax", "layer_norm"))
SIDE = tutorial.choose(gpu=4096, cpu=16)


def rate_call(provider, index, dtype):
    ours, label = provider != "torch", RATE_CALLS[index]
    return calls_of.make_call(label, ours, SIDE, SIDE, (1, 1, 1, 16), DEVICE, dtype)


rates = bench.run(
    bench.Benchmark(
        name="call-rate",
        x_name="operation, 4096 x 4096 fp16",  # on a GPU
        x_values=list(RATE_CALLS),
        providers=["triton", "torch"],
        make=rate_call,
        work=lambda x, dtype: (5 if x % 2 else 2) * SIDE * SIDE * dtype.itemsize,
        dtypes=(torch.float16,),
        smoke_x=3,
        headline_x=None,
        x_labels=RATE_CALLS,
    ),
    draw=False,
)
if rates:
    print(f"GB/s called from Python (GPU time alone), {rates.how}:")
    for index, label in rates.bench.x_labels.items():
        line = [
            f"{p} {rates.call(p, index, 'float16'):6,.0f} "
            f"({rates.value(p, index, 'float16'):,.0f})"
            for p in rates.bench.providers
        ]
        print(f"  {label:<20} " + ", ".join(line))

# %%
# Chapter 04's matmul, under the linear layer, sits under an autotuner and a
# ``triton.heuristics`` layer (``EVEN_K``: whether K is a multiple of the chosen BLOCK_K).
# ``lean`` evaluates such rules once, at a key's first launch, on the arguments and the
# autotuner's choice; later calls skip both layers. A rule that reads a tensor (whose shape
# and strides are not all in the key) keeps Triton's path. Chapter 11's attention passes
# tensor descriptors: ``lean`` keys them by what Triton specializes on (dtype, block shape,
# padding), so its launches are lean too.
#
# No Python wrapper will reach C++. To remove the CPU's cost we have to stop paying it at
# every step: record the GPU work once and replay it.
#
# A model to train
# ----------------
# Four residual blocks of a Transformer's MLP, ``x + W2 gelu(W1 LayerNorm(x))``, width 384
# (the capstone's GPT), trained on a squared error. ``use_triton`` switches between our
# kernels and PyTorch's modules; the same seed gives both the same weights.


class Block(nn.Module):
    def __init__(self, width, use_triton, **factory):
        super().__init__()
        Norm = TracedLayerNorm if use_triton else nn.LayerNorm  # noqa: N806
        self.norm = Norm(width, **factory)
        if use_triton:
            self.up = FusedLinear(width, 4 * width, activation="gelu", **factory)
            self.down = FusedLinear(4 * width, width, **factory)
        else:
            self.up, self.down = (
                nn.Sequential(nn.Linear(width, 4 * width, **factory), nn.GELU()),
                nn.Linear(4 * width, width, **factory),
            )

    def forward(self, x):
        return x + self.down(self.up(self.norm(x)))


# %%
# Letting torch.compile see our kernels
# -------------------------------------
# ``torch.compile`` traces Python into a graph of operators. Inside an ``autograd.Function``
# it would have to trace our wrapper and its lean launch, which reads memory addresses that a
# traced tensor does not have. ``torch.library.triton_op`` declares an operator whose body
# launches Triton kernels through ``wrap_triton`` (our ``lean`` kernels do that by
# themselves when traced): the compiler traces the body with tensors that only have shapes
# (which gives the operator's meta function for free), sees each kernel as a node of its
# graph, and can replay the whole graph from CUDA graphs. ``register_autograd`` gives the
# derivative, itself an operator. Chapter 03 wrote layer norm this way
# (``layer_norm_forward_op``, ``layer_norm_backward_op``); every public operation of the
# package follows the same pattern in its own chapter, under the ``stepkernels::``
# namespace. Eager calls keep the cheap path: the public function dispatches to the operator
# only while ``torch.compile`` traces it (``torch.compiler.is_compiling()``). Where the
# compiler cannot copy a kernel (Inductor recompiles a ``triton_op``'s kernels from their
# source, and cannot copy a class such as chapter 07's ``Epilogue``, or build chapter 11's
# host-side TMA descriptors), the operator is a ``custom_op`` with a ``register_fake``:
# opaque, called by the compiled graph as it is, still without a graph break (chapter 05's
# fused linear). Two rules keep a kernel copyable: name each ``@triton.jit`` function it
# calls directly (``apply_activation``, not ``activations.apply_activation``), and use no
# global but ints, strings, bools and ``tl.constexpr`` in it, defaults included.
#
# ``explain`` counts the graphs and breaks of one call; ours compiles whole.

# @save ops/compiler_ops
from stepkernels.ops.layer_norm import (  # noqa: F401  (chapter 03's, kept here by name)
    LayerNorm,
    layer_norm_backward_op,
    layer_norm_forward_op,
)
from stepkernels.ops.layer_norm import layer_norm as traced_layer_norm  # noqa: F401

# Chapter 03's LayerNorm calls the operators itself while compiled: the old name stays.
TracedLayerNorm = LayerNorm


# %%
def norm_twice(x, norm):
    return norm(norm(x))


norm = LayerNorm(64, device=DEVICE)
explanation = torch._dynamo.explain(norm_twice)(torch.randn(8, 64, device=DEVICE), norm)
print(
    f"graphs: {explanation.graph_count}, breaks: {explanation.graph_break_count}, "
    f"operators: {explanation.op_count}"
)


# %%
# One model each way, and a training step: forward, loss, backward and an SGD update.
# ``set_to_none=True`` makes the backward allocate fresh gradients, which a CUDA graph then
# owns. We check ours against PyTorch first: the same loss and the same updated weights.

GPU_WIDTH, DEPTH = 384, 4  # the model the benchmark times (and recorded)
WIDTH_MODEL = tutorial.choose(gpu=GPU_WIDTH, cpu=32)
DTYPE = torch.bfloat16 if tutorial.ON_GPU else torch.float32  # bf16: no loss scaling


def make_model(use_triton, seed=0):
    torch.manual_seed(seed)
    factory = dict(device=DEVICE, dtype=DTYPE)
    return nn.Sequential(
        *[Block(WIDTH_MODEL, use_triton, **factory) for _ in range(DEPTH)]
    )


def training_step(model, optimizer, x, target):
    optimizer.zero_grad(set_to_none=True)
    loss = (model(x).float() - target).square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def tokens_of(n_tokens, seed=1):
    generator = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(n_tokens, WIDTH_MODEL, generator=generator)
    return make().to(DEVICE, DTYPE), make().to(DEVICE)


x, target = tokens_of(tutorial.choose(gpu=4096, cpu=16))
losses, models = [], [make_model(use_triton) for use_triton in (True, False)]
for model in models:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses.append([training_step(model, optimizer, x, target).item() for _ in range(3)])
bf16 = DTYPE == torch.bfloat16
tolerance = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
torch.testing.assert_close(
    torch.tensor(losses[0]), torch.tensor(losses[1]), **tolerance
)
for ours, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
    torch.testing.assert_close(ours, theirs, **tolerance)
print(
    f"three steps, ours and PyTorch's: losses {losses[0]} and {losses[1]}, same weights"
)

# %%
# A training step as a CUDA graph
# -------------------------------
# ``torch.cuda.graph`` records every kernel the CPU queues on a stream, with its arguments,
# into a graph; ``graph.replay()`` queues them all again with one call. What the CPU decided
# while recording is frozen: the inputs must live at the same addresses (we copy each batch
# into ``static_x``), shapes cannot change, and no CPU-side choice may differ between steps. A
# dropout that draws its seed on the CPU would replay one mask forever: chapter 06's kernels can
# read their seed from a GPU tensor instead, which chapter 12's model advances inside its graph.
# Autotuning and Triton's compilation cannot happen while recording: a few eager steps on a
# side stream come first, as PyTorch's CUDA-graph notes ask.


def graphed_step(model, n_tokens):
    """The step recorded as a CUDA graph: (replay, static_x, static_target)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x, static_target = tokens_of(n_tokens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile, autotune, allocate
        for _ in range(3):
            training_step(model, optimizer, static_x, static_target)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = training_step(model, optimizer, static_x, static_target)
    return (lambda: graph.replay() or static_loss), static_x, static_target


if tutorial.ON_GPU:
    ours, reference = make_model(True), make_model(True)
    replay, static_x, static_target = graphed_step(ours, len(x))
    static_x.copy_(x), static_target.copy_(target)
    replayed = replay().item()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(4):
        eager = training_step(reference, optimizer, x, target).item()
    print(f"fourth step, replayed graph {replayed:.5f}, eager {eager:.5f}")
    torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
    # make_graphed_callables records a module's forward and backward: the rest stays eager.
    # (PyTorch 2.11 warns of an AccumulateGrad stream here for any module, torch's own too.)
    module, x_leaf = make_model(True)[0], x.clone().requires_grad_()
    graphed = torch.cuda.make_graphed_callables(module, (x_leaf,))
    torch.testing.assert_close(graphed(x_leaf), module(x_leaf), rtol=0, atol=0)
else:
    print(
        "CUDA graphs need a GPU: the interpreter runs kernels on the CPU, one by one."
    )

# %%
# Three warm-up steps ran; recording queues kernels without running them, so the first
# replay is the fourth step, and gives the loss of the fourth eager step. The graph owns its memory
# (a private pool of PyTorch's allocator): every activation of the step stays allocated.
#
# Benchmark: time per training step
# ---------------------------------
# The call from Python, as a training loop makes it (``do_bench``, L2 flushed): PyTorch eager
# and ``torch.compile`` of it, ours eager, ours replayed from a CUDA graph, and ours under
# ``torch.compile``. Both compiled models use ``mode="reduce-overhead"``, which replays the
# compiled forward and backward from CUDA graphs; the optimizer's update stays eager in those
# two. Rates count the matrix products' FLOPs, 6 per weight per token (forward 2, backward
# 4); the limit is cuBLAS on 4096³. Targets: ours under a CUDA graph or ``torch.compile`` at
# least 1.3 times faster than eager PyTorch, and no slower than ``torch.compile`` of it.

STEP_PROVIDERS = [
    "torch",
    "torch.compile",
    "triton",
    "triton + CUDA graph",
    "triton + torch.compile",
]


def make_step(provider, n_tokens, dtype):
    model = make_model(use_triton=provider.startswith("triton"))
    if provider == "triton + CUDA graph":
        return graphed_step(model, n_tokens)[0]
    if provider.endswith("torch.compile"):
        torch._dynamo.reset()
        model = torch.compile(model, mode="reduce-overhead", dynamic=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = tokens_of(n_tokens)
    return functools.partial(training_step, model, optimizer, x, target)


def step_flops(n_tokens, dtype, width=WIDTH_MODEL):
    return 6 * n_tokens * DEPTH * 2 * 4 * width**2


steps = bench.run(
    bench.Benchmark(
        name="training-step",
        x_name="tokens per step, 4 MLP blocks of width 384, bf16",
        x_values=[1024, 4096, 16384],
        providers=STEP_PROVIDERS,
        make=make_step,
        work=step_flops,
        unit="TFLOP/s",
        dtypes=(torch.bfloat16,),
        smoke_x=16,
        headline_x=4096,
        gpu_time=False,
        in_turns=False,  # a compile's dynamo.reset() drops the last one's CUDA graphs
    )
)
if steps:
    print(f"ms per step, {steps.how}:")
    for n in steps.bench.x_values:
        ms = {
            p: step_flops(n, None, GPU_WIDTH) / steps.value(p, n, "bfloat16") / 1e9
            for p in STEP_PROVIDERS
        }
        print(f"  {n:,} tokens: " + ", ".join(f"{p} {t:.3f}" for p, t in ms.items()))
        best = min(ms["triton + CUDA graph"], ms["triton + torch.compile"])
        print(
            f"    ours, best of graph and compile: {ms['torch'] / best:.2f}x eager "
            f"torch, {ms['torch.compile'] / best:.2f}x torch.compile"
        )

# %%
# Eager, our step is several times slower than PyTorch's: each of its dozens of calls costs
# the CPU more (above), and at these sizes the CPU sets the pace of every eager step. Replayed
# from a CUDA graph, the whole step, optimizer included, is one call and takes the GPU's time
# alone. ``torch.compile``'s ``"reduce-overhead"`` replays the forward and the backward, but
# the loss, the optimizer's update and its own bookkeeping stay on the CPU, which leaves both
# compiled models behind our graph at small sizes. At 16,384 tokens the products dominate and
# what is compared is GPU time: there ``torch.compile`` of PyTorch's model can be ahead, with
# cuBLAS's products (chapters 04 and 05 compare ours) and the elementwise work between them
# (residual additions, the loss) fused, which our graph runs as separate kernels.
#
# What we learned
# ---------------
# * A call from Python costs microseconds of CPU in the wrapper, Triton's argument binding and
#   autograd's engine; a small kernel's GPU time is often less.
# * Triton's binding can be done once per launch key; a key finer than Triton's keeps it
#   correct. Skipping autograd when nothing needs a gradient is free speed.
# * A CUDA graph replays a whole step with one call, if its inputs stay at fixed addresses and
#   nothing decided on the CPU changes between steps.
# * ``triton_op`` makes our kernels operators that ``torch.compile`` traces and replays.
#
# Exercises
# ---------
# 1. Add ``torch.compile`` of the whole step, optimizer included (with
#    ``torch.optim.SGD(..., capturable=True)`` where needed). How much of the eager optimizer's
#    time was left in the two compiled steps?
# 2. Record only the model with ``torch.cuda.make_graphed_callables`` (above) and keep the
#    optimizer's update eager. How much of the whole-step graph's lead over eager is left?
# 3. Wrap ``softmax`` as a ``triton_op`` like the layer norm above, and compile a function that
#    uses it with ``fullgraph=True``. What does ``TORCH_LOGS=output_code`` show of our kernel?
# 4. Give chapter 04's matmul a heuristic that reads a tensor (say, whether ``a`` is
#    contiguous) and measure ``matmul``'s CPU per call with ``lean``. Why must ``lean`` fall
#    back to Triton's path there, and what would the launch key have to hold to avoid it?
