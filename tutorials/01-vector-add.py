r"""
Vector addition: a first Triton kernel
======================================

We write a kernel that adds two vectors, call it from PyTorch like any other function,
check it against ``x + y``, and time it against PyTorch and the memory bandwidth of the GPU.

What you will learn:

* the SPMD model: one kernel, many *programs*, told apart by their program id;
* blocks, offsets and masks: how a program finds its slice and stays inside the tensor;
* the grid, and how a wrapper turns torch tensors into a launch;
* how to run and debug a kernel without a GPU, under Triton's interpreter;
* why this kernel is measured in GB/s, what its ceiling is, and how close it gets.

Prerequisites: Python and PyTorch. No GPU is needed to follow along: without one, every
cell runs under Triton's interpreter on the CPU, at a smaller size.
"""

# %%
# Setup
# -----
# The chapters build a package, ``stepkernels``: each chapter's final kernels are in it, and
# later chapters import them from it. It also holds what every chapter shares: device
# handling, timing, plots and the recorded GPU results. Import it before ``triton``: on a
# machine without a GPU it switches Triton to its interpreter, a setting Triton reads when it
# is imported.

from stepkernels.lessons import bench, figures, tutorial
import torch
import triton
import triton.language as tl

tutorial.announce()
DEVICE = tutorial.DEVICE
# sphinx_gallery_thumbnail_number = 2

# %%
# Why bandwidth is the whole story here
# -------------------------------------
# Adding two vectors of N fp32 numbers reads 2N × 4 bytes and writes N × 4: 12 bytes for
# each single addition. An H100 does about 60 fp32
# TFLOP/s without its tensor cores, but moves only about 3 TB/s to and from its memory, so
# the additions take about 1/250 of the time the bytes do. The kernel is *memory bound*: its
# time is the bytes it must move divided by the bandwidth, and nothing we do to the
# arithmetic matters.
#
# That gives us the ceiling. For N = 2^26 (67 million elements, 805 MB moved) at
# the 3.0 TB/s that a device-to-device copy reaches on our H100, the floor is
# 805 MB / 3.0 TB/s = 0.27 ms. We report speed as *effective bandwidth*: compulsory bytes
# (each input read once, the output written once) divided by the measured time. A kernel at
# the copy bandwidth cannot go faster.
#
# PyTorch's ``x + y`` already reaches that ceiling, so this chapter is not about beating it.
# It is about the machinery, on a kernel small enough to see all of it. The speed-ups come
# in later chapters, where one kernel does the work of several PyTorch calls and moves a
# fraction of their bytes.
#
# The SPMD model: programs and blocks
# -----------------------------------
# A Triton kernel is a function that many *programs* run at once, each on its own piece of
# the data: single program, multiple data. We choose how many programs to launch (the
# *grid*), and inside the kernel each program asks ``tl.program_id(axis=0)`` which one it is.
#
# Unlike a CUDA thread, which handles one element, a Triton program handles a whole *block*:
# ``tl.arange(0, BLOCK_SIZE)`` is a vector of ``BLOCK_SIZE`` offsets, and every operation on
# it acts on all of them. Triton spreads the block over the program's threads (its
# ``num_warps`` warps of 32) and picks vector loads; we think in blocks, not threads.
#
# Program ``pid`` takes elements ``pid * BLOCK_SIZE`` up to ``(pid + 1) * BLOCK_SIZE``. When
# N is not a multiple of the block size, the last block hangs over the end of the
# tensors. A *mask*, ``offsets < n_elements``, switches those lanes off: masked lanes neither
# load nor store. Here is the picture for ten elements in blocks of four:

figures.draw_programs(n_elements=10, block_size=4)

# %%
# The kernel
# ----------
# ``@triton.jit`` compiles the function for the GPU (or hands it to the interpreter).
# The first line of the cell, ``# @save ops/vector_add``, marks it as part of the package: the
# kernels and wrappers that a chapter marks so are what ``stepkernels.ops.vector_add`` holds,
# written out by ``make export``, so the kernel you edit here and the one the package runs are
# one text.
# Pointer arguments receive torch tensors, which Triton turns into the address of their
# first element; ``x_ptr + offsets`` is then a block of addresses. ``BLOCK_SIZE`` is a
# ``tl.constexpr``: a compile-time constant, because the size of ``tl.arange`` must be known
# when the kernel is compiled (and must be a power of two).
#
# fp16 and bf16 inputs are converted to fp32 for the addition and rounded once when stored.
# That is what PyTorch does too, so results agree to the bit. It is also what the
# interpreter needs: it keeps bf16 values as raw 16-bit integers, and adding those directly
# gives nonsense. The conversions cost nothing measurable in a memory-bound kernel.

# @save ops/vector_add
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


# %%
# The wrapper
# -----------
# Readers of our code call ``add(x, y)``, not the kernel. The wrapper checks its inputs,
# allocates the output, and launches one program per block. The grid is a function of the
# launch's meta-parameters, so it stays right whatever ``BLOCK_SIZE`` we pass;
# ``triton.cdiv`` rounds the division up, so the last, partial block gets a program too.
#
# The kernel treats its inputs as flat arrays of consecutive elements, so the wrapper refuses
# anything else with a message that says what to do: a strided view, tensors of different
# shapes (no broadcasting), different dtypes, or a tensor on the wrong device. A silent wrong
# answer is the one outcome we never accept. The checks every chapter needs live in the
# package, ``check_tensor``.

# @save ops/vector_add
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


# %%
# Seeing inside a kernel
# ----------------------
# Set ``TRITON_INTERPRET=1`` before Triton is imported (``stepkernels`` does it for you
# when there is no GPU) and every ``@triton.jit`` function runs as ordinary Python on the
# CPU: the programs of the grid run one after another, and every block value is a NumPy
# array. You can then debug a kernel as you would any Python function:
#
# * ``print(offsets)`` or ``tl.device_print("offsets", offsets)`` inside the kernel. The
#   second also works on a GPU, but there every thread that holds a value prints it, so a
#   small block prints many times over, to the process's output rather than the notebook's;
# * ``breakpoint()`` inside the kernel stops in ``pdb`` with every local in reach, for
#   example to look at ``in_bounds`` of the last program;
# * ``tl.static_print`` prints at compile time (block shapes, constexpr values), and
#   ``tl.device_assert(cond, "message")`` checks a condition on every lane.
#
# The interpreter checks what a kernel computes, not how fast: it is hundreds of times slower
# than a GPU, and since programs run one at a time it cannot show a race between them.
#
# The kernel below prints what each program of the picture above sees: its offsets and which
# lanes its mask keeps. It loads and stores nothing. We run it under the interpreter only,
# where its output is one readable line per program.


@triton.jit
def show_blocks_kernel(n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.device_print("offsets", offsets)
    tl.device_print("in bounds", offsets < n_elements)


if tutorial.INTERPRET:
    show_blocks_kernel[(triton.cdiv(10, 4),)](10, BLOCK_SIZE=4)
else:
    print(
        "On a GPU: set TRITON_INTERPRET=1 before importing triton to see this output."
    )

# %%
# Correctness
# -----------
# Floating-point addition is correctly rounded, so our kernel and PyTorch must agree to the
# last bit: we assert exact equality. One exception: the interpreter rounds fp32 results to
# bf16 by truncation rather than to nearest even, so there we allow bf16 one unit in the last
# place (a relative error of 2^-7); on a GPU bf16 is exact too.
#
# The sizes are the ones that break naive kernels: a single element, lengths that are not a
# multiple of the block size, exactly one block, one element more than a block, and a large
# vector; plus a 2-D tensor, which works because it is contiguous.


def tolerance(dtype: torch.dtype) -> dict:
    if dtype == torch.bfloat16 and tutorial.INTERPRET:
        return {"rtol": 2**-7, "atol": 0.0}
    return {"rtol": 0.0, "atol": 0.0}


torch.manual_seed(0)
shapes = [
    (1,),
    (97,),
    (BLOCK_SIZE,),
    (BLOCK_SIZE + 1,),
    (3, 333),
    (bench.choose(gpu=98_432_017, cpu=20_011),),
]
for dtype in SUPPORTED_DTYPES:
    for shape in shapes:
        x = torch.randn(shape, device=DEVICE, dtype=dtype)
        y = torch.randn(shape, device=DEVICE, dtype=dtype)
        torch.testing.assert_close(add(x, y), x + y, **tolerance(dtype))
print(f"add(x, y) == x + y for {len(SUPPORTED_DTYPES)} dtypes x {len(shapes)} shapes")

# %%
# And the inputs the kernel cannot take are refused with a message, not answered wrongly:

x = torch.randn(1000, device=DEVICE)
y = torch.randn(1000, device=DEVICE)
bad_calls = {
    "strided view": lambda: add(x[::2], y[::2]),
    "shapes differ": lambda: add(x, y[:-1]),
    "dtypes differ": lambda: add(x, y.half()),
    "integer dtype": lambda: add(x.int(), y.int()),
    "wrong device": lambda: add(x.to("meta"), y.to("meta")),
}
tutorial.show_refusals("add()", bad_calls)

# %%
# Benchmark
# ---------
# We time ``add`` and ``x + y`` from 2^12 to 2^28 elements with
# ``triton.testing.do_bench``, which flushes the L2 cache before every call so that each run
# reads its inputs from memory (How we measure gives the details, and says which recordings
# timed what), and report the median as effective bandwidth, counting
# 3 × N × (bytes per element). The dashed line is the copy bandwidth of the same GPU,
# measured with a 1 GiB device-to-device copy. Without a GPU the plot shows results recorded
# on one with ``make bench``, with the GPU, versions and date in its title.


def make_vector_add(provider: str, n_elements: int, dtype: torch.dtype):
    x = torch.rand(n_elements, device=DEVICE, dtype=dtype)
    y = torch.rand(n_elements, device=DEVICE, dtype=dtype)
    return {"triton": lambda: add(x, y), "torch": lambda: x + y}[provider]


vector_add = bench.Benchmark(
    name="vector-add",
    x_name="elements",
    x_values=[2**i for i in range(12, 29)],
    providers=["triton", "torch"],
    make=make_vector_add,
    work=lambda n_elements, dtype: 3 * n_elements * dtype.itemsize,
    dtypes=(torch.float32, torch.float16),
    smoke_x=2**12,
    headline_x=2**26,
)
bench.run(vector_add)

# %%
# Both lines climb to the ceiling together. At small sizes the time is not the bytes but the
# fixed cost of a launch, a few microseconds, which no kernel avoids: 4,096 fp32 elements
# are 49 kB, a few nanoseconds of bandwidth. From about 2^22 elements the bytes
# dominate and both kernels run close to the copy bandwidth. The summary under the plot gives
# the share of it at 2^26.
#
# At the largest sizes both read slightly *above* the copy line, by about 1 % on our H100.
# The ceiling is the copy's rate, not a law: a copy reads one byte for every byte it writes,
# while an addition reads two, and DRAM loses less time switching between reading and writing
# when writes are fewer. Either way the kernel is as fast as the memory allows.
#
# How big should a block be?
# --------------------------
# ``BLOCK_SIZE`` and ``num_warps`` are the two knobs of this kernel. A block of 1,024
# elements over 4 warps (128 threads) gives each thread 8 fp32 values: two 16-byte loads
# per input, which is how the hardware likes to move memory. Smaller blocks launch more
# programs, each with less work to hide the latency of its loads behind; larger ones give a
# thread more registers' worth of data. The sweep below measures the effective bandwidth at
# 2^26 fp32 elements for each combination.


def make_block_sweep(provider: str, block_size: int, dtype: torch.dtype):
    num_warps = int(provider.split("=")[1])
    x = torch.rand(bench.choose(gpu=2**26, cpu=2**12), device=DEVICE, dtype=dtype)
    y = torch.rand_like(x)
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.numel(), block_size),)
    return lambda: add_kernel[grid](
        x, y, out, x.numel(), BLOCK_SIZE=block_size, num_warps=num_warps
    )


block_sweep = bench.Benchmark(
    name="vector-add-block-size",
    x_name="BLOCK_SIZE",
    x_values=[2**i for i in range(7, 15)],
    providers=["num_warps=1", "num_warps=4", "num_warps=8"],
    make=make_block_sweep,
    work=lambda block_size, dtype: 3 * 2**26 * dtype.itemsize,
    smoke_x=256,
)
bench.run(block_sweep)

# %%
# Very small blocks lose: each program moves too few bytes to keep enough loads in flight,
# and the hardware caps how many programs an SM holds at once. Very large blocks with few
# warps lose too: each thread holds more values than fit comfortably in registers. Between
# those ends lies a wide plateau at the ceiling, and ``BLOCK_SIZE = 1024`` with 4 warps sits
# on it.
#
# What we learned
# ---------------
# * A Triton kernel is written for one program working on a block; the grid says how many
#   programs run, ``tl.program_id`` tells them apart, and masks guard the ragged end.
# * A wrapper owns the launch: output allocation, the grid, and refusing inputs the kernel
#   cannot handle.
# * Element-wise kernels are memory bound; their ceiling is the copy bandwidth, and effective
#   bandwidth (compulsory bytes over time) says how close they get.
# * Under ``TRITON_INTERPRET=1`` a kernel is plain Python that you can print from and step
#   through, on any laptop.
#
# Exercises
# ---------
# 1. Write ``axpy(a, x, y)`` computing ``a * x + y`` for a Python float ``a``. How many bytes
#    does it move, and should it be slower than ``add``?
# 2. Fuse three operations into one kernel, ``(x + y) * z``, and compare its bytes and time
#    with ``(x + y) * z`` in PyTorch, which makes two passes and writes a temporary.
# 3. Remove the mask and run the correctness check under the interpreter. What happens at
#    97 elements, and why is that worse on a GPU?
