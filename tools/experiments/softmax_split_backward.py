"""A split-row backward for chapter 02's long rows (its exercise 3), checked and timed.

The package's backward takes its looped kernel past 16,384 columns, which reads y and dy twice
(the row sum, then dx): 5 M N bytes moved for the 3 M N counted. Here, as in the split forward,
each program holds one chunk of y and dy in registers, publishes its partial sum (of y * dy for
softmax, of dy for log-softmax) with ``publish_and_wait``, and writes its chunk of dx: y and dy
are read once. After MAX_POLLS tries a program sums the row itself, so the answer never depends
on its siblings running (under the interpreter, which runs programs one after another, all but
the last chunk of a row take that path).

    python tools/experiments/softmax_split_backward.py

Under the interpreter it checks against torch (tests/test_softmax.py runs it); on a GPU it also
times the kernel at the chapter's long-row sizes against the package's backward and torch.
"""

from stepkernels import bench
from stepkernels._core import DEVICE, ON_GPU, dtype_name
from stepkernels.softmax import MAX_POLLS, publish_and_wait, softmax_backward, softmax_forward
import torch
import triton
import triton.language as tl


@triton.jit
def softmax_backward_split_kernel(
    y_ptr, dy_ptr, dx_ptr, partial_ptr, counter_ptr, n_cols, n_chunks,
    y_row_stride, dy_row_stride, dx_row_stride,
    CHUNK: tl.constexpr, CHUNKS_POW2: tl.constexpr, LOG: tl.constexpr, MAX_POLLS: tl.constexpr,
):  # fmt: skip
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = cols < n_cols
    y = tl.load(y_ptr + row * y_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    if LOG:
        part = tl.sum(dy, axis=0)
    else:
        part = tl.sum(dy * y, axis=0)
    row_partials = partial_ptr + row * CHUNKS_POW2
    tl.store(row_partials + chunk, part)
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):
        chunks = tl.arange(0, CHUNKS_POW2)
        partials = tl.load(row_partials + chunks, mask=chunks < n_chunks, other=0.0, volatile=True)
        total = tl.sum(partials, axis=0)
    else:  # the siblings are not running: sum the row ourselves
        lanes = tl.zeros([CHUNK], tl.float32)
        for start in range(0, n_cols, CHUNK):
            offsets = start + tl.arange(0, CHUNK)
            mask = offsets < n_cols
            dy_part = tl.load(dy_ptr + row * dy_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                lanes += dy_part
            else:
                y_part = tl.load(y_ptr + row * y_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
                lanes += dy_part * y_part
        total = tl.sum(lanes, axis=0)
    if LOG:
        dx = dy - tl.exp(y) * total
    else:
        dx = y * (dy - total)
    tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


def softmax_backward_split(y, dy, log=False, chunk=4096, num_warps=8):
    """dx for 2-D contiguous y and dy, each row split into chunks of ``chunk`` values."""
    n_rows, n_cols = y.shape
    n_chunks = triton.cdiv(n_cols, chunk)
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    partials = torch.empty(n_rows, chunks_pow2, device=y.device, dtype=torch.float32)
    counters = torch.zeros(n_rows, device=y.device, dtype=torch.int32)
    dx = torch.empty_like(y)
    softmax_backward_split_kernel[(n_rows * n_chunks,)](
        y, dy, dx, partials, counters, n_cols, n_chunks, y.stride(0), dy.stride(0), dx.stride(0),
        CHUNK=chunk, CHUNKS_POW2=chunks_pow2, LOG=log, MAX_POLLS=MAX_POLLS, num_warps=num_warps,
    )  # fmt: skip
    return dx


def check():
    generator = torch.Generator().manual_seed(0)
    for n_rows, n_cols, chunk in [(3, 100, 16), (2, 1000, 128), (1, 1, 16), (4, 33, 64)]:
        for dtype, rtol in ((torch.float32, 1e-5), (torch.float16, 2**-10)):
            x = (torch.randn(n_rows, n_cols, generator=generator) * 4).to(DEVICE, dtype)
            dy = torch.randn(n_rows, n_cols, generator=generator).to(DEVICE, dtype)
            for log in (False, True):
                y = softmax_forward(x, log)
                dx = softmax_backward_split(y, dy, log, chunk=chunk, num_warps=4)
                x64 = x.double().requires_grad_()
                fn = torch.log_softmax if log else torch.softmax
                (expected,) = torch.autograd.grad(fn(x64, dim=-1), x64, dy.double())
                atol = rtol * expected.abs().max().item()  # gradients cancel: scale to their size
                torch.testing.assert_close(dx, expected.to(dtype), rtol=rtol, atol=atol)
    print("split-row backward matches torch.autograd (fp32, fp16; softmax and log-softmax)")


def sweep(dtype, n_cols):
    x = torch.randn(2**26 // n_cols, n_cols, device="cuda", dtype=dtype)
    y, dy = softmax_forward(x), torch.randn_like(x)
    nbytes = 3 * x.numel() * x.element_size()
    calls = {
        "package": lambda: softmax_backward(y, dy),
        "torch": lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, dtype),
    }
    for chunk in (2048, 4096, 8192):
        for warps in (4, 8, 16):
            calls[f"split {chunk}/{warps}w"] = lambda c=chunk, w=warps: softmax_backward_split(
                y, dy, chunk=c, num_warps=w
            )
    line = f"{dtype_name(dtype):8} N={n_cols:7}"
    for name, fn in calls.items():
        line += f"  {name} {bench.rate(nbytes, fn):6.0f}"
    print(line, flush=True)


check()
if ON_GPU:
    for dtype in (torch.float32, torch.float16):
        for n_cols in (32_768, 65_536, 131_072, 262_144):
            sweep(dtype, n_cols)
