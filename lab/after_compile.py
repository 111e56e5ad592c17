"""Are timings taken just after a torch.compile compilation slow? (GPU only; not in the gallery.)

Chapter 02's points right after a ``torch.compile`` provider had compiled (ours at the next
N, and the compiled provider itself) came out several times slower than the kernels, while
eager ``torch``, timed a few seconds later, did not. Inductor compiles in a pool of worker
processes that it starts again for each compilation. This times the same calls before a
compilation, right after it, and 2 to 10 s later, and prints the load average:

    python lab/after_compile.py

Here Inductor compiles as configured (its pool of workers by default); run it once with
TORCHINDUCTOR_COMPILE_THREADS=1 to compile in this process, as ``bench`` does while measuring.
"""

import os
import time

from stepkernels import softmax
from stepkernels.lessons import bench
import torch
import triton


def make_cases():
    """The timed calls: {name: (call, bytes it moves)}."""
    x = torch.randn(4096, 512, device="cuda")
    xg = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(xg)
    return {
        "fwd fp32 N=512 triton": (lambda: softmax(x), 2 * x.numel() * 4),
        "fwd fp32 N=512 torch": (lambda: torch.softmax(x, -1), 2 * x.numel() * 4),
        "fwd+bwd fp16 N=4096 triton": (lambda: torch.autograd.grad(softmax(xg), xg, dy), 5 * xg.numel() * 2),
        "fwd+bwd fp16 N=4096 torch": (lambda: torch.autograd.grad(torch.softmax(xg, -1), xg, dy), 5 * xg.numel() * 2),
    }


def children():
    me = str(os.getpid())
    count = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and open(f"/proc/{pid}/stat").read().split()[3] == me:
                count += 1
        except OSError:
            pass
    return count


def measure(cases, label, names=None):
    parts = []
    for name in names or cases:
        fn, nbytes = cases[name]
        fn()
        parts.append(f"{name} {nbytes / triton.testing.do_bench(fn) / 1e6:6.0f}")
    load = os.getloadavg()[0]
    print(f"{label:<22} load {load:5.1f} children {children():3}  " + "  ".join(parts), flush=True)


def main():
    cases = make_cases()
    print("TORCHINDUCTOR_COMPILE_THREADS =", os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"), "(GB/s)")
    measure(cases, "before any compile")
    for n_cols in (700,):
        compiled = bench.compile_static(lambda t: torch.softmax(t, -1))
        start = time.time()
        compiled(torch.randn(4096, n_cols, device="cuda"))
        print(f"compiled N={n_cols} in {time.time() - start:.1f} s")
        measure(cases, "right after")
        for delay in (2, 5, 10):
            time.sleep(delay - (time.time() - start) if delay > time.time() - start else 0)
            measure(cases, f"{delay:>3} s after", names=("fwd fp32 N=512 triton", "fwd+bwd fp16 N=4096 triton"))


if __name__ == "__main__":
    main()
