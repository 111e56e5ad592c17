"""The split kernels' wait, made cheaper: poll with plain loads, acquire once.

Chapters 02 and 13 split a row over programs that wait for one another with
``stepkernels.runtime.waiting.wait_for``: it polls the row's counter with ``tl.atomic_add(ptr, 0,
sem="acquire")``. Compiled for sm_90 (``--sass``, without a GPU), each poll is one thread's
strong load followed by ``CCTL.IVALL`` (the SM's whole L1 invalidated, for the acquire) and two
``BAR.SYNC`` of the program's warps (the one thread's result passed on through shared memory).
Chapter 13's layer-norm backward waits once per batch of 4 rows, 32 times a program.

``wait_light`` polls with a volatile load that every thread issues itself (no barrier, no
invalidation) and, once the count looks complete, makes one acquire read of the counter: the
acquire synchronizes with every program's release increment (increments are read-modify-writes,
so they continue one release sequence), and the reads of the siblings' statistics stay ordered
after it. The kernels themselves are the package's, recompiled with ``wait_light`` in place of
``wait_for`` (``rebind``).

    python lab/split_wait.py          # GPU: time; CPU: check under the interpreter
    TRITON_INTERPRET=0 PYTHONPATH=src python lab/split_wait.py --sass

On a GPU it times, in GB/s of GPU time next to a copy of the same bytes, the package against the
light wait: chapter 02's split softmax forward and backward (M = 2^26 / N) and chapter 13's
split layer-norm forward and backward (M = 4,096, as chapter 03's benchmark). On the H100
(``split_wait.log``) the light wait was slower everywhere, by 42% in the fp16 softmax forward:
every thread of every waiting program polling L2 costs more than the one thread, the barriers
and the invalidations it replaces (they also pace the polls). Not taken.
"""

import contextlib
import functools
import itertools
import os
import re
import sys
import types
from unittest import mock

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--sass" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import sm90
from stepkernels.lessons import bench
from stepkernels.ops import layer_norm, long_rows, softmax  # the modules, not the functions
from stepkernels.runtime import waiting
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
import torch
import triton
import triton.language as tl


@triton.jit
def wait_light(counter_ptr, row, n_chunks, MAX_POLLS: tl.constexpr):
    """``wait_for`` with relaxed polling: True once all ``n_chunks`` programs have published."""
    published = tl.load(counter_ptr + row, volatile=True)
    polls = 0
    while (published < n_chunks) & (polls < MAX_POLLS):
        published = tl.load(counter_ptr + row, volatile=True)
        polls += 1
    return tl.atomic_add(counter_ptr + row, 0, sem="acquire") >= n_chunks


def python_function(kernel):
    """The Python function under a ``@lean`` and ``@triton.jit`` kernel, compiled or interpreted."""
    while not isinstance(kernel, types.FunctionType):
        kernel = getattr(kernel, "kernel", None) or kernel.fn
    return kernel


def rebind(kernel, **replacements):
    """A new ``@triton.jit`` kernel from ``kernel``'s source whose globals named in
    ``replacements`` (other jit functions) are replaced: the package's kernel, another wait."""
    fn = python_function(kernel)
    namespace = {**fn.__globals__, **replacements}
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__module__ = fn.__qualname__, fn.__module__
    copy.__annotations__, copy.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__
    return triton.jit(copy)


light_publish_and_wait = rebind(waiting.publish_and_wait, wait_for=wait_light)
LIGHT = {  # (module, kernel name): the kernel with the light wait
    (softmax, "softmax_split_kernel"): rebind(softmax.softmax_split_kernel, publish_and_wait=light_publish_and_wait),
    (softmax, "softmax_backward_split_kernel"): rebind(
        softmax.softmax_backward_split_kernel, publish_and_wait=light_publish_and_wait
    ),
    (long_rows, "layer_norm_forward_split_kernel"): rebind(
        long_rows.layer_norm_forward_split_kernel, publish_and_wait=light_publish_and_wait
    ),
    (long_rows, "layer_norm_backward_split_kernel"): rebind(
        long_rows.layer_norm_backward_split_kernel, wait_for=wait_light
    ),
}


@contextlib.contextmanager
def light_waits():
    """Within the block the package's wrappers launch the light-wait kernels."""
    with contextlib.ExitStack() as stack:
        for (module, name), kernel in LIGHT.items():
            stack.enter_context(mock.patch.object(module, name, kernel))
        yield


def light(fn):
    def call():
        with light_waits():
            return fn()

    return call


def layer_norm_calls(n_rows, n_cols, dtype):
    """x, a forward call and a backward call of the package's layer norm (two-stage dW, dB)."""
    x = torch.randn(n_rows, n_cols, device=DEVICE, dtype=dtype)
    weight, bias = (torch.randn(n_cols, device=DEVICE, dtype=dtype) for _ in "wb")
    dy = torch.randn_like(x)
    _, mean, rstd = layer_norm.layer_norm_forward(x, weight, bias, 1e-5)
    forward = functools.partial(layer_norm.layer_norm_forward, x, weight, bias, 1e-5)
    backward = functools.partial(layer_norm.layer_norm_backward, dy, x, weight, mean, rstd)
    return x, forward, backward


def softmax_calls(n_rows, n_cols, dtype):
    x = torch.randn(n_rows, n_cols, device=DEVICE, dtype=dtype) * 4
    y, dy = torch.softmax(x.float(), dim=-1).to(dtype), torch.randn_like(x)
    forward = functools.partial(softmax.softmax_forward, x)
    backward = functools.partial(softmax.softmax_backward, y, dy)
    return x, forward, backward


def check():
    """Under the interpreter (programs one by one, so most chunks take the way out) or on a
    GPU: the light-wait kernels give the package's results."""
    n_rows, n_cols = (3, 40_000) if not ON_GPU else (64, 65_536)
    for calls in (softmax_calls, layer_norm_calls):
        _, forward, backward = calls(n_rows, n_cols, torch.float32)
        for fn in (forward, backward):
            for ours, theirs in zip(fn(), light(fn)(), strict=False):
                if ours is not None:
                    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    print("the light-wait kernels match the package's (softmax and layer norm, split rows)")


def sweep():
    for name, calls, n_rows_of, passes, widths in (
        ("softmax", softmax_calls, lambda n: 2**26 // n, (2, 3), (65_536, 262_144)),
        ("layer norm", layer_norm_calls, lambda n: 4096, (2, 3), (16_384, 65_536)),
    ):
        for dtype, n_cols in itertools.product((torch.float16, torch.float32), widths):
            x, forward, backward = calls(n_rows_of(n_cols), n_cols, dtype)
            size = x.numel() * x.element_size()
            line = f"{name:10} {dtype_name(dtype):8} N={n_cols:7}"
            for direction, fn, count in (("forward", forward, passes[0]), ("backward", backward, passes[1])):
                if direction == "forward" and name == "layer norm" and n_cols <= 32_768:
                    continue  # one program a row: no wait
                copy = bench.rate(count * size, bench.copy_of(count * size))
                package, lighter = (bench.rate(count * size, f) for f in (fn, light(fn)))
                line += f"  {direction}: copy {copy:5.0f} package {package:5.0f} light {lighter:5.0f}"
            print(line, flush=True)


def sass_counts(kernel, dtype, num_warps=8):
    """Instructions of chapter 02's split forward ``kernel`` compiled for sm_90 at 8,192 values:
    in all, and how many are ``CCTL`` (L1 invalidations) and ``BAR.SYNC``."""
    from softmax_split_way_out import FORWARD_ARGUMENTS, compile_split

    constants = {"BLOCK_N": 8192, "CHUNKS_POW2": 8, "MAX_POLLS": 100_000, "LOG": False}
    cubin = sm90.cubin_file(compile_split(kernel, FORWARD_ARGUMENTS, dtype, constants, num_warps))
    body = re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]*);", sm90.nvidia_tool("cuobjdump", "-sass", cubin))
    return len(body), sum("CCTL" in i for i in body), sum("BAR.SYNC" in i for i in body)


if __name__ == "__main__":
    if "--sass" in sys.argv:
        light_kernel = LIGHT[softmax, "softmax_split_kernel"]
        for name, kernel in (("package", softmax.softmax_split_kernel), ("light wait", light_kernel)):
            counts = sass_counts(kernel, "fp16")
            print(
                f"split softmax forward, fp16, {name}: {counts[0]} instructions, {counts[1]} CCTL, "
                f"{counts[2]} BAR.SYNC (the poll loop holds one CCTL and two BAR.SYNC in wait_for)"
            )
    else:
        check()
        if ON_GPU:
            sweep()
