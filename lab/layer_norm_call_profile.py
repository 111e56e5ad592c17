"""Where the CPU time of a layer-norm forward + backward call goes (GPU only).

Chapter 13's benchmark times ``torch.autograd.grad(layer_norm(x, ...), (x, w, b), dy)`` called
from Python; on the H100 our call took 700 to 1,000 µs of CPU against torch's 200 to 370. This
prints, at M × N = 2^26 values (N = 16,384 and 65,536, fp16), the CPU per call of the forward
alone, the backward alone (through a kept graph) and both (``bench.cpu_us``, back to back), for
ours, torch and torch.compile, then cProfile's heaviest functions over 50 of our calls.

    python lab/layer_norm_call_profile.py
"""

import cProfile
import pstats

from stepkernels import layer_norm
from stepkernels.lessons import bench
from stepkernels.runtime.core import ON_GPU
import torch


def calls(provider, n_cols):
    n_rows = 2**26 // n_cols
    x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.rand(n_cols, device="cuda", dtype=torch.float16, requires_grad=True)
    b = torch.randn(n_cols, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn_like(x)
    if provider == "ours":
        fn = lambda: layer_norm(x, (n_cols,), w, b)  # noqa: E731
    else:
        torch_fn = torch.nn.functional.layer_norm
        compiled = torch.compile(torch_fn) if provider == "torch.compile" else torch_fn
        fn = lambda: compiled(x, (n_cols,), w, b)  # noqa: E731
    y = fn()
    return {
        "forward": fn,
        "backward": lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
        "both": lambda: torch.autograd.grad(fn(), (x, w, b), dy),
    }


def timings():
    # torch.compile's backward at 65,536 refused a retained graph's second use: left out there
    cases = [(16384, "ours"), (16384, "torch"), (16384, "torch.compile"), (65536, "ours"), (65536, "torch")]
    for n_cols, provider in cases:
        cpu = {name: bench.cpu_us(fn, calls=50) for name, fn in calls(provider, n_cols).items()}
        gpu = {name: bench.measure_ms(fn)[0] * 1e3 for name, fn in calls(provider, n_cols).items()}
        shown = ", ".join(f"{k} {v:,.0f} (GPU {gpu[k]:,.0f})" for k, v in cpu.items())
        print(f"N = {n_cols:,} {provider:13} CPU µs per call: {shown}", flush=True)


def main():
    if not ON_GPU:
        raise SystemExit("GPU only: this times calls on the GPU's host")
    with bench.side_stream():  # graphs capture only off the default stream
        timings()
        both = calls("ours", 65536)["both"]
        both()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            both()
        torch.cuda.synchronize()
        profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
