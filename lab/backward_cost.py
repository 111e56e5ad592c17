"""Where the CPU time of a forward+backward goes, on a GPU (issue 40; the lead runs it).

For softmax and layer_norm at 64 x 256 and 4096 x 4096 fp16, four calls through
``torch.autograd.grad`` (chapter 08's ``lessons/calls.py``):

* ``Function, no kernel``: an ``autograd.Function`` whose forward returns a view of x and
  whose backward hands dy back, so autograd's machinery alone;
* ``floor``: chapter 08's floor of the call (``make_floor``): our allocations and as many
  empty kernels, launched through the compiled launcher with bound arguments;
* ``ours`` and ``torch``.

Per call, from batches issued back to back: wall time; the CPU time of the calling thread
(``time.thread_time``) and of the whole process (``time.process_time``), whose difference is
the other threads' (autograd's engine runs a CUDA backward on its device thread, which
cProfile on the calling thread never sees); and the forward's and the backward's wall-time
spans. With ``--trace DIR``, a ``torch.profiler`` trace of each ours/torch call (Chrome
format, a row per thread). Last, what allocating costs (the cProfile of chapter 08 put
``torch.empty`` at ~14 µs a call on the H200's host): ``torch.empty`` with a device object or
a string, ``empty_like``, ``new_empty``, and mean/rstd as one (2, rows) tensor unbound.

    python lab/backward_cost.py [--calls 200] [--trace DIR] [--cpu (a dry run)]
"""

import argparse
import sys
import time

import torch

if __name__ == "__main__" and "--cpu" not in sys.argv and not torch.cuda.is_available():
    sys.exit("lab/backward_cost.py measures CUDA calls: run it on a GPU (--cpu: a dry run)")

import stepkernels  # noqa: E402, F401  (without a GPU: Triton's interpreter)
from stepkernels.lessons import calls  # noqa: E402
from stepkernels.runtime.core import DEVICE  # noqa: E402


class NoKernel(torch.autograd.Function):
    """autograd's machinery alone: no allocation, no launch."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def no_kernel_call(rows, width, dtype):
    x = torch.randn(rows, width, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.ones_like(x)
    return lambda: torch.autograd.grad(NoKernel.apply(x), x, dy)


def timed_spans(call, calls: int, batches: int = 5) -> dict:
    """µs per call, the fastest batch of each measure: wall, the calling thread's CPU, the
    process's CPU (all threads), and the forward's and backward's wall spans."""
    for _ in range(3):
        call()
    torch.cuda.synchronize() if DEVICE.type == "cuda" else None
    best: dict = {}
    per_batch = max(1, calls // batches)
    for _ in range(batches):
        spans = {"forward": 0.0, "backward": 0.0}
        start = (time.perf_counter(), time.thread_time(), time.process_time())
        for _ in range(per_batch):
            call.spans = spans
            call()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        end = (time.perf_counter(), time.thread_time(), time.process_time())
        measured = {
            "wall": end[0] - start[0],
            "main thread CPU": end[1] - start[1],
            "process CPU": end[2] - start[2],
            **spans,
        }
        for name, seconds in measured.items():
            us = seconds / per_batch * 1e6
            best[name] = min(best.get(name, us), us)
    best["other threads CPU"] = best["process CPU"] - best["main thread CPU"]
    return best


class Spanned:
    """A fwd+bwd call built from a forward ``fn`` and its leaves, timing each half."""

    def __init__(self, forward, leaves, dy):
        self.forward, self.leaves, self.dy, self.spans = forward, leaves, dy, None

    def __call__(self):
        start = time.perf_counter()
        out = self.forward()
        middle = time.perf_counter()
        grads = torch.autograd.grad(out, self.leaves, self.dy)
        end = time.perf_counter()
        if self.spans is not None:
            self.spans["forward"] += middle - start
            self.spans["backward"] += end - middle
        return grads


def spanned(label, provider, rows, width, dtype) -> Spanned:
    """The fwd+bwd ``label`` of ``provider`` with its forward and backward timed apart."""
    name = label.split()[0]
    if provider == "Function, no kernel":
        x = torch.randn(rows, width, device=DEVICE, dtype=dtype, requires_grad=True)
        return Spanned(lambda: NoKernel.apply(x), [x], torch.ones_like(x))
    if provider == "floor":
        whole = calls.make_floor(label, rows, width, (1, 1, 1, 16), DEVICE, dtype)
        function, leaves, dy = whole.parts
        return Spanned(lambda: function.apply(*leaves), leaves, dy)
    mine, theirs, grads = calls.OPERATIONS[name]
    fn = mine if provider == "ours" else theirs
    t = calls.operands(rows, width, (1, 1, 1, 16), DEVICE, dtype, requires_grad=True)
    leaves = [t[g] for g in grads]
    return Spanned(lambda: fn(t), leaves, torch.ones_like(fn(t)))


def allocation_costs(rows, width, dtype, calls_count) -> dict:
    x = torch.empty(rows, width, device=DEVICE, dtype=dtype)
    device, f32 = x.device, torch.float32
    kinds = {
        "torch.empty(shape, dtype=, device=torch.device)": lambda: torch.empty(
            (rows, width), dtype=dtype, device=device
        ),
        "torch.empty(shape, dtype=, device='cuda')": lambda: torch.empty(
            (rows, width), dtype=dtype, device=device.type
        ),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "x.new_empty(shape)": lambda: x.new_empty((rows, width)),
        "mean, rstd: two torch.empty": lambda: (
            torch.empty(rows, dtype=f32, device=device),
            torch.empty(rows, dtype=f32, device=device),
        ),
        "mean, rstd: torch.empty((2, rows)).unbind()": lambda: torch.empty(
            (2, rows), dtype=f32, device=device
        ).unbind(),
    }
    out = {}
    for name, fn in kinds.items():
        for _ in range(10):
            fn()
        start = time.thread_time()
        for _ in range(calls_count):
            fn()
        out[name] = (time.thread_time() - start) / calls_count * 1e6
    return out


def trace(label, provider, rows, width, dtype, directory):
    from torch.profiler import ProfilerActivity, profile

    call = spanned(label, provider, rows, width, dtype)
    for _ in range(3):
        call()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            call()
    name = f"{label.replace(' ', '_').replace('+', '')}_{provider}_{rows}x{width}.json"
    prof.export_chrome_trace(f"{directory}/{name}")
    return name


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--trace", default=None, help="a directory for profiler traces")
    parser.add_argument("--cpu", action="store_true", help="a dry run without a GPU")
    options = parser.parse_args()
    dtype = torch.float16 if DEVICE.type == "cuda" else torch.float32
    sizes = [(64, 256), (4096, 4096)] if DEVICE.type == "cuda" else [(8, 32)]
    providers = ["Function, no kernel", "floor", "ours", "torch"]
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "no GPU (dry run)"
    print(
        f"µs per fwd+bwd call through torch.autograd.grad, {gpu}, torch "
        f"{torch.__version__}; fastest of 5 batches of {options.calls // 5}"
    )
    columns = [
        "wall",
        "main thread CPU",
        "other threads CPU",
        "process CPU",
        "forward",
        "backward",
    ]
    print(f"{'call':<44}" + "".join(f"{c:>18}" for c in columns))
    for rows, width in sizes:
        for name in ("softmax", "layer_norm"):
            label = f"{name} fwd+bwd"
            for provider in providers:
                call = spanned(label, provider, rows, width, dtype)
                measured = timed_spans(call, options.calls)
                row = f"{label} {rows}x{width}, {provider}"
                print(f"{row:<44}" + "".join(f"{measured[c]:18.1f}" for c in columns))
                if options.trace and provider in ("ours", "torch"):
                    written = trace(label, provider, rows, width, dtype, options.trace)
                    print(f"    trace: {options.trace}/{written}")
    print(f"µs of the calling thread's CPU per allocation ({dtype}, 4096 x 4096 and 64 x 256):")
    for rows, width in sizes:
        for kind, us in allocation_costs(rows, width, dtype, options.calls * 5).items():
            print(f"  {rows}x{width} {kind:<48} {us:6.2f}")


if __name__ == "__main__":
    main()
