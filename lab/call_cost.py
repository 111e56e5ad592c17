"""What each public op's Python costs per call, measured without a GPU (CPU only).

On a GPU the CPU time of a call is our Python, Triton's launcher (a C call, 5 to 8 µs on the
H100's host, ``lab/call_profile.py``) and autograd. This script takes the launcher out and
keeps the rest: it imports the package *without* Triton's interpreter (``TRITON_INTERPRET=0``,
so ``LeanKernel`` inspects the kernels and takes its cached path as on a GPU), and replaces
what needs a GPU by nothing:

* ``LeanKernel.first_launch`` records the launch (key, runtime arguments, grid) as on a GPU,
  with a compiled kernel whose launcher does nothing; an autotuned kernel "chooses" its first
  config;
* ``LeanKernel.bind_runtime`` hands out device 0 and stream 0.

Every later call with the same key runs the package's own code up to the launcher's call,
which returns at once. The outputs hold garbage: this times calls, it checks nothing.

Where the path here differs from a GPU's (say so beside any figure):

* ``ON_GPU`` is False: ``sm_count()`` is 4, autotuners hold one config, chapter 07's
  descriptor matmul (``on_descriptors``, H100 only) is never chosen, attention takes the
  interpreter's launch table, ``cross_entropy`` reads rows without 16-byte groups;
* a loss's target is checked against the vocabulary on CPU tensors only
  (``classes_in_range``): this script turns that check off, as a GPU skips it;
* ``torch.empty`` and friends allocate CPU memory, not from the CUDA caching allocator;
* the launcher a GPU calls (``compiled.run``) is Python that builds the launch's scratch
  and calls C: here it is an empty function, so add 5 to 8 µs per kernel for a GPU;
* autograd's engine runs a CPU tensor's backward on the calling thread; a CUDA tensor's, on
  the engine's device thread, a hand-over chapter 08's launch-pieces recording puts at tens
  of µs a backward (torch's own ops pay it too).

torch's own op is timed twice: on the same CPU tensors (where it also *computes*, so it is
slower than its GPU call's CPU cost; fp16 on a CPU is slow) and on 2 x 8 fp32 tensors
(``tiny``: its dispatch and autograd with next to no computation, the nearest CPU stand-in
for what a CUDA call costs the host; ``meta`` tensors are no stand-in: many of their ops are
Python decompositions, milliseconds a call). "floor": chapter 08's floor of the call
(``lessons/calls.py``'s ``make_floor``: our allocations and as many launches, of launchers that
do nothing here, inside one autograd.Function); the ratio is ours / floor. "calls": the
Python functions (and C functions called from Python) that one call runs, as cProfile
counts them: the same from run to run, where a time on this shared machine moves by half.
The calls, their inputs and torch's counterparts are chapter 08's (``lessons/calls.py``).

    python lab/call_cost.py [--profile] [--only softmax,layer_norm] [--calls 2000]
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

if __name__ == "__main__":  # before the package is imported (importing the script: not)
    if torch.cuda.is_available():
        sys.exit("lab/call_cost.py times the Python path without a GPU: on a GPU, time calls")
    os.environ["TRITON_INTERPRET"] = "0"  # LeanKernel's GPU path, not the interpreter's
    torch.set_num_threads(1)  # the fp16 ops torch computes here: no threads to wait for

import stepkernels  # noqa: E402
from stepkernels.lessons import calls  # noqa: E402
from stepkernels.ops import (  # noqa: E402
    cross_entropy,
    linear_cross_entropy,
    matmul_hopper,
)
from stepkernels.runtime import arguments  # noqa: E402
from stepkernels.runtime.launch import LeanKernel  # noqa: E402
import triton  # noqa: E402


class NoLaunch:
    """A compiled kernel as LeanKernel keeps it, whose launcher does nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args):
        return None


class NoCompile:
    """Triton's ``kernel[grid](...)`` at a key's first call: no compile, no launch."""

    def __getitem__(self, grid):
        return lambda *args, **meta: NoLaunch


FIRST_LAUNCH = LeanKernel.first_launch


FIRST_CALLS = []


def first_launch(self, key, grid, args, meta):
    FIRST_CALLS.append(self)
    if self.tuned is not None:  # the autotuner's choice: its first config
        self.tuned.best_config = self.tuned.configs[0]
    kernel, self.kernel = self.kernel, NoCompile()
    try:
        return FIRST_LAUNCH(self, key, grid, args, meta)
    finally:
        self.kernel = kernel


def bind_runtime(self):
    self.runtime = (lambda: 0, lambda device: 0, triton.knobs.runtime)
    return self.runtime


def launches_as_no_ops():
    """LeanKernel's cached path, with launchers that do nothing (see the docstring)."""
    assert not stepkernels.runtime.core.INTERPRET, "run it as a script, without a GPU"
    LeanKernel.first_launch = first_launch
    LeanKernel.bind_runtime = bind_runtime
    arguments.classes_in_range = lambda *args, **kwargs: None  # a GPU skips it too
    for module in (cross_entropy, linear_cross_entropy):  # their repeats' check
        module.classes_in_range = arguments.classes_in_range


ROWS, WIDTH, HEADS = 64, 256, (1, 4, 64, 64)
TINY = (2, 8, (1, 1, 2, 8))  # torch's stand-in for a CUDA call: next to no computation
DTYPE = torch.float16
CPU = torch.device("cpu")
OPS = {  # chapter 08's table of calls (lessons/calls.py), and chapter 07's kernel
    **calls.OPERATIONS,
    "matmul_tma": (  # which matmul takes on Hopper (not here)
        lambda t: matmul_hopper.matmul_tma(t["x"], t["w"].mT),
        lambda t: torch.mm(t["x"], t["w"].mT),
        None,
    ),
}
calls.OPERATIONS.update(OPS)  # make_call and make_floor find matmul_tma too


def call(label, ours=True, tiny=False):
    """The call ``label`` ("softmax", "softmax fwd+bwd"...), ours or torch's; ``tiny``: on
    2 x 8 fp32 (heads 1 x 1 x 2 x 8)."""
    torch.manual_seed(0)
    shape, dtype = (TINY, torch.float32) if tiny else ((ROWS, WIDTH, HEADS), DTYPE)
    return calls.make_call(label, ours, *shape, CPU, dtype)


def no_launch(kernel, grid, args, tail, compiled):
    """The floor's empty kernel, compiled: here the launcher that does nothing."""
    return compiled


def floor(label):
    torch.manual_seed(0)
    return calls.make_floor(label, ROWS, WIDTH, HEADS, CPU, DTYPE, no_launch)


def cpu_us(fn, calls, batches=10):
    """µs per call: the fastest of ``batches`` batches of calls issued back to back, in this
    process's CPU time (the machine is shared: wall time counts the others' turns too)."""
    for _ in range(5):
        fn()
    per_batch, times = max(1, calls // batches), []
    for _ in range(batches):
        start = time.process_time()
        for _ in range(per_batch):
            fn()
        times.append((time.process_time() - start) / per_batch)
    return min(times) * 1e6


def mine_path(fn) -> bool:
    """Did every kernel ``fn`` launches take LeanKernel's cached path?"""
    FIRST_CALLS.clear()
    fn()
    return not FIRST_CALLS


def profiled(fn, calls):
    fn()
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    return profiler


def python_calls(fn, calls=50) -> float:
    """Python function calls (and calls of C functions from Python) per call of ``fn``:
    unlike a time on a shared machine, the same from run to run."""
    return pstats.Stats(profiled(fn, calls)).total_calls / calls


def profile(fn, calls, top):
    text = io.StringIO()
    stats = pstats.Stats(profiled(fn, calls), stream=text)
    stats.sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(f"    {line}" for line in lines[start : start + top + 1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--only", default="", help="ops, comma-separated")
    parser.add_argument("--profile", action="store_true", help="cProfile each call")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--no-torch", action="store_true", help="time ours alone")
    options = parser.parse_args()
    launches_as_no_ops()
    names = [n for n in options.only.split(",") if n] or list(OPS)
    print(
        f"µs of CPU per call, {ROWS} x {WIDTH} fp16 (attention 1 x 4 x {ROWS} x 64), "
        f"torch {torch.__version__}, triton {triton.__version__}, launches as no-ops; "
        f"fastest of 10 batches of {options.calls // 10} (torch: of 2 of "
        f"{options.calls // 40})"
    )
    header = (
        f"{'op':<28} {'ours':>7} {'floor':>7} {'torch':>8} {'torch tiny':>11} "
        f"{'ours/floor':>10} {'calls':>6} {'floor calls':>11}"
    )
    print(header)
    for name in names:
        for label in calls.labels([name]).values():
            try:
                ours_call = call(label)
                mine = cpu_us(ours_call, options.calls)
                floor_call = floor(label)
                least = cpu_us(floor_call, options.calls)
            except RuntimeError as error:  # a kernel launched through Triton's own path
                print(f"{label:<28} not timed: {str(error)[:60]}")
                continue
            on_cpu = tiny = float("nan")
            if not options.no_torch:
                on_cpu = cpu_us(call(label, ours=False), options.calls // 20, 2)
                tiny = cpu_us(call(label, ours=False, tiny=True), options.calls)
            lean = "" if mine_path(ours_call) else " (not lean)"
            print(
                f"{label:<28} {mine:7.1f} {least:7.1f} {on_cpu:8.1f} {tiny:11.1f} "
                f"{mine / least:9.2f}x {python_calls(ours_call):6.0f} "
                f"{python_calls(floor_call):11.0f}{lean}",
                flush=True,
            )
            if options.profile:
                print(profile(ours_call, 200, options.top), flush=True)


if __name__ == "__main__":
    main()
