r"""Timing, recording and plotting for the chapters' benchmarks, in one place.

On a GPU, ``run(benchmark)`` measures, plots the rates against the hardware limit and prints a
short headline (``Results.table()`` has every provider). By default a run is quick: each
benchmark measures its largest size (every category of a benchmark of categories), every
provider but those of ``RECORDED_IN_QUICK_RUNS``, in its ``quick_dtypes``, drawn over the
curves recorded on a GPU. With ``STEPKERNELS_FULL=1``, or
``STEPKERNELS_RECORD=1`` (``make bench``, which also writes the results folder), it measures
every size (GPU time of CUDA-graph replays, L2 flushed). Without a GPU it calls every provider
once at a small size, so the code runs, and shows the results recorded on a GPU instead:
interpreter timings are never shown.

Importing this module changes nothing: every setting a measurement needs (Inductor's compile
threads, dynamo's recompile limit, fp32 matmul precision) is set for the measurement and
restored after it, also on error.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
import contextlib
import csv
import dataclasses
from dataclasses import dataclass
import datetime
import functools
import json
import math
import os
from pathlib import Path
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
from stepkernels.runtime.graphs import capture, side_stream  # noqa: F401  (chapters call bench.capture)
import torch
import triton
import triton.language as tl

# Where make bench records, and where a reader's plots come from: the package's own copy.
PACKAGE_RESULTS = Path(__file__).resolve().parent.parent / "results"


def default_results_dir() -> Path:
    """$STEPKERNELS_RESULTS, else the results shipped inside the package."""
    return Path(os.environ.get("STEPKERNELS_RESULTS", PACKAGE_RESULTS))


def choose(gpu, cpu, full=None):
    """The full-size value on a GPU, the small one under the interpreter.

    ``full``, where given, is what a GPU takes under STEPKERNELS_FULL=1 or ``make bench``
    (``full_sweep()``): a check's every case, say, where ``gpu`` names the few a learner's
    quick run checks (the rest are in tests/)."""
    if not ON_GPU:
        return cpu
    return full if full is not None and full_sweep() else gpu


# ----------------------------------------------------------------------- benchmarks
@dataclass
class Benchmark:
    """One sweep: every provider at every x, for each dtype.

    ``make(provider, x, dtype)`` builds the inputs and returns the zero-argument call to time;
    ``work(x, dtype)`` counts the compulsory bytes (unit GB/s) or FLOPs (unit TFLOP/s) of one
    call, which turns a time into a rate.
    """

    name: str
    x_name: str
    x_values: list
    providers: list
    make: Callable
    work: Callable
    unit: str = "GB/s"
    dtypes: tuple = (torch.float32,)
    smoke_x: object = None
    headline_x: object = None
    x_log2: bool = True
    # Colors for this benchmark's own providers (the shared ones are in STYLE).
    colors: dict | None = None
    # torch.get_float32_matmul_precision while measuring ("high": tf32 for every provider).
    float32_matmul_precision: str | None = None
    # For categories (activations, say): x value -> label, drawn as bars, not a line.
    x_labels: dict | None = None
    # Also time each call as a user makes it: do_bench of the Python call, and its CPU cost.
    user_timing: bool = True
    # False: the value itself is the call from Python (do_bench of the call), for calls a
    # CUDA graph cannot capture or that replay one themselves (chapter 08's training steps).
    gpu_time: bool = True
    # Providers whose calls a CUDA graph cannot capture (a synchronization inside, say): their
    # value is the call from Python, in a benchmark whose others' is GPU time.
    uncapturable: tuple = ()
    # False: each provider is made, timed and dropped before the next is made, rather than all
    # made, then timed in turns: for calls that should not live side by side (models compiled
    # in "reduce-overhead" mode: each compile's dynamo.reset() drops the CUDA-graph trees of
    # the model before, which turns would call again).
    in_turns: bool = True
    # The provider the headline speaks for: None, "triton" or the first "triton ..." one.
    ours: str | None = None
    # The dtypes a quick run measures (None: every one): each dtype compiles its own kernels,
    # seconds each; () leaves the benchmark to its recording in a quick run (measured only
    # where nothing is recorded).
    quick_dtypes: tuple | None = None
    # Providers drawn as references, not peers (a limit measured as a provider, say); the
    # copy of the same bytes always is one.
    references: tuple = ()


@dataclass
class Point:
    provider: str
    dtype: str
    x: float
    value: float
    low: float | None = None
    high: float | None = None
    call: float | None = None  # the rate of the call from Python (do_bench, L2 flushed)
    cpu_us: float | None = None  # CPU time of one call, issued back to back


UNIT_SCALE = {"GB/s": 1e9, "TFLOP/s": 1e12}
# A benchmark in this unit times the CPU side of each call (``cpu_us``) instead of the GPU.
CPU_UNIT = "µs of CPU per call"
# A benchmark in this unit measures memory: the allocator's peak during one call, beyond what
# was allocated before it (the inputs), outputs and gradients included.
MEMORY_UNIT = "GiB of peak memory"
LIMIT_NAME = {"GB/s": "copy bandwidth", "TFLOP/s": "cuBLAS fp16 matmul at 4096³"}
STYLE = {
    "triton": "tab:blue",
    "torch": "tab:red",
    "torch.compile": "tab:orange",
    "naive": "tab:gray",
    "copy (same bytes)": "black",
}
# For the other providers of a plot (variants of a kernel, other libraries), in order.
OTHER_COLORS = (
    "tab:green",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
)


def provider_colors(providers: list, chosen: dict | None = None) -> dict:
    """A distinct color for each provider: ``chosen`` ones, the fixed ones above, then
    OTHER_COLORS in turn."""
    fixed = {**STYLE, **(chosen or {})}
    taken = {fixed[p] for p in providers if p in fixed}
    others = iter([color for color in OTHER_COLORS if color not in taken])
    return {p: fixed[p] if p in fixed else next(others, None) for p in providers}


_limits: dict = {}


@contextlib.contextmanager
def measurement_settings(bench: Benchmark):
    """The settings a measurement needs, restored afterwards, also on error.

    Inductor compiles in a pool of worker processes that it starts afresh after each
    compilation, taking every CPU core for seconds: a GPU timing taken meanwhile measures a
    starved CPU, so we compile in this process. Dynamo keeps at most 8 compiled versions of a
    function before it silently runs eager PyTorch: a benchmark of many cases raises that.
    """
    import torch._dynamo.config
    import torch._inductor.config

    precision = torch.get_float32_matmul_precision()
    try:
        if bench.float32_matmul_precision:
            torch.set_float32_matmul_precision(bench.float32_matmul_precision)
        with (
            torch._inductor.config.patch(compile_threads=1),
            torch._dynamo.config.patch(recompile_limit=64),
        ):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def compile_static(fn: Callable) -> Callable:
    """A fresh ``torch.compile`` of ``fn`` for static shapes, to benchmark one shape.

    Resetting dynamo first keeps each shape's compilation separate: without it, the ninth
    shape would hit dynamo's recompilation limit and silently run eager PyTorch instead.
    """
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def measure_ms(fn: Callable) -> tuple[float, float, float]:
    """Median, 20% and 80% quantile of the GPU time of ``fn`` in ms.

    do_bench times replays of ``fn``'s CUDA graph, flushing L2 before each one; the CPU cost
    of calling ``fn`` from Python is left out (``cpu_us`` measures it).
    """
    if torch.cuda.current_stream() == torch.cuda.default_stream():
        with side_stream():  # after the work that made fn's inputs
            return measure_ms(fn)
    graph = capture(fn)
    median, q20, q80 = triton.testing.do_bench(graph.replay, quantiles=[0.5, 0.2, 0.8])
    return median, q20, q80


def per_time(work: float, ms: float, unit: str) -> float:
    """``work`` (bytes or FLOPs) done in ``ms`` milliseconds, in ``unit`` (GB/s, TFLOP/s)."""
    return work / UNIT_SCALE[unit] / (ms * 1e-3)


def rate(work: float, fn: Callable, unit: str = "GB/s") -> float:
    """``work`` per GPU time of ``fn``, in ``unit``, as benchmarks count it."""
    return per_time(work, measure_ms(fn)[0], unit)


def call_ms(fn: Callable) -> float:
    """Median time of ``fn`` called from Python, as a user calls it (do_bench, L2 flushed):
    the GPU's time, or the CPU's where launching the work takes longer than doing it."""
    return triton.testing.do_bench(fn)


def cpu_us(fn: Callable, calls: int = 200, batches: int = 5) -> float:
    """CPU time of one call of ``fn`` in µs: Python, launchers, autograd. The calls are
    issued back to back in ``batches``, the GPU drained before each; the median batch
    counts, so that a pause of the host (another process, a collection) does not."""
    fn()
    per_batch, times = max(1, calls // batches), []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        times.append((time.perf_counter() - start) / per_batch)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def cpu_calls(ms: float) -> int:
    """Calls for ``cpu_us`` of a call whose GPU time is ``ms``: 100, fewer for calls over a
    millisecond (the CPU's part of those is small, and 100 would cost seconds), at least 10."""
    return 100 if ms < 1.0 else max(10, int(100 / ms))


def peak_memory_gib(fn: Callable) -> float:
    """GiB that one call of ``fn`` allocates at its peak beyond what is allocated before it
    (CUDA caching allocator statistics), after a first call has compiled and tuned."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    del result
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def hardware_limits() -> dict:
    """Measure this GPU's ceilings once: device-to-device copy bandwidth and cuBLAS fp16 4096³."""
    if not _limits:
        src = torch.empty(2**28, dtype=torch.float32, device=DEVICE).normal_()
        dst = torch.empty_like(src)
        # Plain calls, not a CUDA graph: in a graph this copy becomes a copy-engine node,
        # slower (2.4 TB/s on our H100) than the kernel an ordinary call runs (3.0 TB/s).
        copy_ms = triton.testing.do_bench(lambda: dst.copy_(src))
        _limits["GB/s"] = per_time(2 * src.numel() * 4, copy_ms, "GB/s")
        del src, dst
        a, b = (
            torch.randn(4096, 4096, dtype=torch.float16, device=DEVICE)
            for _ in range(2)
        )
        matmul_ms = triton.testing.do_bench(lambda: a @ b)
        _limits["TFLOP/s"] = per_time(2 * 4096**3, matmul_ms, "TFLOP/s")
    return dict(_limits)


# The copy bandwidth above is measured on 2 GiB. A kernel that moves tens of megabytes
# spends a few microseconds filling and draining the GPU, which a large copy hides: the rate
# it can reach is lower. ``copy_of(nbytes)`` is a plain Triton copy of the same bytes, timed
# like any provider: what a simple streaming kernel reaches at that size (a reference, not a
# bound: a kernel with other tiles can beat it by a few percent).
COPY_BLOCK, COPY_WARPS = 4096, 8
COPY_PROVIDER = "copy (same bytes)"


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < n_elements
    values = tl.load(src_ptr + offsets, mask=in_bounds)
    tl.store(dst_ptr + offsets, values, mask=in_bounds)


def copy_of(nbytes: int, block: int = COPY_BLOCK, warps: int = COPY_WARPS) -> Callable:
    """A call that reads ``nbytes / 2`` bytes and writes as many (int32 words)."""
    n_elements = max(1, nbytes // 8)
    src = torch.ones(n_elements, dtype=torch.int32, device=DEVICE)
    dst = torch.empty_like(src)
    grid = (triton.cdiv(n_elements, block),)
    return lambda: copy_kernel[grid](src, dst, n_elements, block, num_warps=warps)


TIMING = (
    "GPU time of CUDA-graph replays (do_bench, L2 flushed), a point's providers in 5 turns "
    "of 40 ms, median of all replays; call_value: do_bench of the call from Python; cpu_us: "
    "CPU time of one call issued back to back"
)


def timing_of(bench: Benchmark) -> str:
    """How ``bench``'s values were taken, for its recording's ``timing`` key."""
    if bench.gpu_time and bench.in_turns:
        return TIMING
    value = (
        "GPU time of CUDA-graph replays" if bench.gpu_time else "the call from Python"
    )
    how = (
        "a point's providers in 5 turns"
        if bench.in_turns
        else "each provider alone, 5 turns"
    )
    return (
        f"{value} (do_bench, L2 flushed), {how} of 40 ms, median of all samples; "
        "cpu_us: CPU time of one call issued back to back"
    )


def gpu_name() -> str:
    """The name of the GPU that measures (torch's name for it)."""
    return torch.cuda.get_device_name()


def environment() -> dict:
    """What a reader needs to reproduce a measurement on this machine."""
    try:
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = (
            subprocess.run(smi, capture_output=True, text=True, timeout=30)
            .stdout.split("\n")[0]
            .strip()
        )
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return {
        "gpu": gpu_name(),
        "driver": driver or "unknown",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "command": os.environ.get(
            "STEPKERNELS_COMMAND", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
        ),
        "limits": hardware_limits(),
        "timing": TIMING,
    }


# Sampled while a benchmark runs, so that a slow point can be told from a throttled GPU.
GPU_STATE_QUERY = (
    "clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
)


def gpu_state_summary(lines: list[str]) -> dict:
    """SM clock, power and temperature over nvidia-smi's CSV samples (GPU_STATE_QUERY, no
    units) taken while the GPU was busy (clock-event bit 0x1, idle, clear): median and
    extremes, and every clock-event reason seen (``nvidia-smi -q`` names the bits: 0x4
    software power cap, 0x20 and 0x40 thermal slowdown, 0x80 power brake, ...)."""
    rows = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            row = [float(f) for f in fields[:4]] + [int(fields[4], 16)]
        except (ValueError, IndexError):  # a header, [N/A] or a cut line
            continue
        rows += [row] if not row[4] & 0x1 else []
    if not rows:
        return {}
    clock, max_clock, power, temperature, reasons = zip(*rows, strict=True)
    return {
        "busy_samples": len(rows),
        "sm_clock_mhz": {
            "median": statistics.median(clock),
            "min": min(clock),
            "max": max(clock),
            "max_possible": max(max_clock),
        },
        "power_w": {"median": statistics.median(power), "max": max(power)},
        "temperature_c": {
            "median": statistics.median(temperature),
            "max": max(temperature),
        },
        "clock_event_reasons": sorted({hex(r) for r in reasons if r}),
    }


@contextlib.contextmanager
def gpu_state(interval_ms: int = 100):
    """Sample the GPU's state with nvidia-smi while the block runs; the dict it yields is
    filled by ``gpu_state_summary`` on exit (it stays empty without a GPU or nvidia-smi)."""
    state: dict = {}
    if not ON_GPU:
        yield state
        return
    # --id: this process's GPU among several
    uuid = torch.cuda.get_device_properties(DEVICE).uuid
    command = [
        "nvidia-smi",
        f"--query-gpu={GPU_STATE_QUERY}",
        "--format=csv,noheader,nounits",
        f"--loop-ms={interval_ms}",
        f"--id=GPU-{uuid}",
    ]
    with tempfile.TemporaryFile("w+") as log:
        try:  # to a file: a pipe left unread would fill and stall nvidia-smi
            sampler = subprocess.Popen(command, stdout=log, stderr=subprocess.DEVNULL)
        except OSError:
            sampler = None
        try:
            yield state
        finally:
            if sampler is not None:
                sampler.terminate()
                sampler.wait(timeout=30)
                log.seek(0)
                state.update(gpu_state_summary(log.read().splitlines()))


def gpu_slug(gpu_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def gpu_results_dir(gpu_name: str, results_dir: Path | None = None) -> Path:
    """The folder of one GPU's recordings (made if missing): results/<gpu slug>/."""
    folder = (results_dir or default_results_dir()) / gpu_slug(gpu_name)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def make_call(bench: Benchmark, provider: str, x, dtype) -> Callable:
    """The call to time: ``bench.make``'s, or for ``COPY_PROVIDER`` a copy of the bytes that
    ``bench.work`` counts, so that a benchmark gets its size's reference by listing it."""
    if provider == COPY_PROVIDER:
        return copy_of(int(bench.work(x, dtype)))
    return bench.make(provider, x, dtype)


def measure(bench: Benchmark) -> list[Point]:
    # Inputs, warm-up and capture all on one side stream: autograd runs a backward on the
    # stream of its forward, so a forward made here is captured with its backward.
    with measurement_settings(bench), side_stream():
        return measure_on_stream(bench)


def measure_on_stream(bench: Benchmark) -> list[Point]:
    points = []
    for dtype in bench.dtypes:
        for x in bench.x_values:
            if bench.unit in (CPU_UNIT, MEMORY_UNIT):
                for provider in bench.providers:
                    measured = cpu_us if bench.unit == CPU_UNIT else peak_memory_gib
                    value = measured(make_call(bench, provider, x, dtype))
                    points.append(Point(provider, dtype_name(dtype), x, value))
                    torch.cuda.empty_cache()
                continue
            try:
                if bench.in_turns:
                    points += timed_in_turn(bench, x, dtype, bench.providers)
                    continue
            except torch.OutOfMemoryError:
                pass  # out of the handler first: its traceback holds the inputs
            for provider in bench.providers:  # not all at once: each on its own
                points += timed_in_turn(bench, x, dtype, [provider])
    return points


# A point's providers are timed in turn, ROUNDS times ROUND_MS each, rather than one after
# the other: under the H100's power cap the clock moves by 5-15% over seconds, and turns
# give every provider, the copy of the same bytes included, the same share of its moves.
ROUNDS, ROUND_MS = 5, 40


@dataclass
class Prepared:
    call: Callable  # the call, as a user makes it; it also keeps the inputs alive
    timer: Callable  # what the rounds time: the call's CUDA graph replayed, or the call
    captured: bool
    call_ms: float | None = None
    cpu_us: float | None = None


def prepare(bench: Benchmark, provider: str, x, dtype) -> Prepared:
    """Build the provider's call at (x, dtype), capture it, and time it as called from Python
    now, before the next provider's ``compile_static`` resets dynamo (which would make a
    compiled call compile again)."""
    fn = make_call(bench, provider, x, dtype)
    captured = bench.gpu_time and provider not in bench.uncapturable
    if captured:
        prepared = Prepared(fn, capture(fn).replay, True)
    else:
        fn()  # compile and capture before timing
        prepared = Prepared(fn, fn, False)
    if bench.user_timing and provider != COPY_PROVIDER:
        if captured:
            prepared.call_ms = call_ms(fn)
        estimate = prepared.call_ms or triton.testing.do_bench(fn, warmup=5, rep=20)
        prepared.cpu_us = cpu_us(fn, cpu_calls(estimate))
    return prepared


def timed_in_turn(bench: Benchmark, x, dtype, providers: list) -> list[Point]:
    """The points of ``providers`` at (x, dtype): each is prepared, then their GPU times are
    taken in ROUNDS turns. Raises OutOfMemoryError if several do not fit at once."""
    prepared = {}
    try:
        for provider in providers:
            try:
                prepared[provider] = prepare(bench, provider, x, dtype)
            except torch.OutOfMemoryError:  # a RuntimeError too, but not one to skip
                raise
            except RuntimeError as error:  # a call a CUDA graph cannot capture
                print(f"  {provider} at {x_text(bench, x)}: skipped, {error}")
        samples = {provider: [] for provider in prepared}
        for _ in range(ROUNDS):
            for provider, p in prepared.items():
                samples[provider] += triton.testing.do_bench(
                    p.timer, warmup=ROUND_MS // 4, rep=ROUND_MS, return_mode="all"
                )
        points, work = [], bench.work(x, dtype)
        for provider, p in prepared.items():
            q20, median, q80 = quantiles(samples[provider], (0.2, 0.5, 0.8))
            value, low, high = (
                per_time(work, t, bench.unit) for t in (median, q80, q20)
            )
            call = p.call_ms
            if bench.user_timing and bench.gpu_time and not p.captured:
                call = median  # uncapturable: its value is the call already
            call = None if call is None else per_time(work, call, bench.unit)
            points.append(
                Point(provider, dtype_name(dtype), x, value, low, high, call, p.cpu_us)
            )
        return points
    except torch.OutOfMemoryError:
        if len(providers) > 1:
            raise
        print(f"  {providers[0]} at {x_text(bench, x)}: out of GPU memory, skipped")
        return []
    finally:
        prepared.clear()
        torch.cuda.empty_cache()


def quantiles(samples: list[float], qs: tuple) -> list[float]:
    """The ``qs`` quantiles of ``samples``, interpolated between the nearest two, as
    ``torch.quantile`` (and do_bench's ``quantiles``) take them."""
    as_tensor = functools.partial(torch.tensor, dtype=torch.float64)
    return torch.quantile(as_tensor(samples), as_tensor(qs)).tolist()


def record(
    bench: Benchmark, points: list[Point], env: dict, results_dir: Path | None = None
) -> Path:
    """Write the points as results/<gpu>/<benchmark>.csv and note the environment they ran in."""
    folder = gpu_results_dir(env["gpu"], results_dir)
    path = folder / f"{bench.name}.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(
            [
                "benchmark",
                "provider",
                "dtype",
                "x_name",
                "x",
                "value",
                "unit",
                "call_value",
                "cpu_us",
            ]
        )
        for p in points:
            optional = ["" if v is None else f"{v:.6g}" for v in (p.call, p.cpu_us)]
            writer.writerow(
                [
                    bench.name,
                    p.provider,
                    p.dtype,
                    bench.x_name,
                    p.x,
                    f"{p.value:.6g}",
                    bench.unit,
                    *optional,
                ]
            )
    env_path = folder / "environment.json"
    recorded = json.loads(env_path.read_text()) if env_path.exists() else {}
    entry = env
    if bench.x_labels:  # the categories' names, for tables read without the chapter
        labels = {str(x): str(label) for x, label in bench.x_labels.items()}
        entry = {**env, "x_labels": labels}
    benchmarks = {**recorded.get("benchmarks", {}), bench.name: entry}
    env_path.write_text(
        json.dumps({**env, "benchmarks": dict(sorted(benchmarks.items()))}, indent=1)
        + "\n"
    )
    return path


def recorded_gpu_dir(
    results_dir: Path | None = None, holding: str | None = None
) -> Path | None:
    """The results folder to show without a GPU: $STEPKERNELS_RESULTS_GPU, else the newest
    recording. ``holding``: of the folders that hold that file (``name.csv``, a profile, a
    sample), the one that recorded it last, so that a benchmark recorded on one GPU only
    is still shown when another GPU recorded something later."""
    folders = [
        p.parent
        for p in (results_dir or default_results_dir()).glob("*/environment.json")
    ]
    wanted = os.environ.get("STEPKERNELS_RESULTS_GPU")
    if wanted:
        folders = [f for f in folders if f.name == wanted]
    if holding is not None:
        folders = [f for f in folders if (f / holding).exists()]

    def recorded_on(folder: Path) -> str:
        env = json.loads((folder / "environment.json").read_text())
        name = None if holding is None else holding.removesuffix(".csv")
        return env.get("benchmarks", {}).get(name, env)["date"]

    newest_first = sorted(folders, key=lambda f: (recorded_on(f), f.name))
    return newest_first[-1] if newest_first else None


def load_recorded(
    name: str, results_dir: Path | None = None, gpu: str | None = None
) -> tuple[list[Point], dict] | None:
    """The points recorded for the benchmark ``name`` and the environment they ran in, with
    the recording's own axis added (``x_name`` and ``unit`` from its CSV); None if nothing is
    recorded. ``gpu``: that GPU's recording where there is one, else the one shown."""
    root = results_dir or default_results_dir()
    own = None if gpu is None else root / gpu_slug(gpu)
    if own is not None and (own / f"{name}.csv").exists():
        folder = own
    else:
        folder = recorded_gpu_dir(results_dir, holding=f"{name}.csv")
    if folder is None or not (folder / f"{name}.csv").exists():
        return None
    env = json.loads((folder / "environment.json").read_text())
    points, axis = read_recording(folder / f"{name}.csv")
    return points, {**env["benchmarks"].get(name, env), **axis}


def is_recording(path: Path) -> bool:
    """Whether a CSV of a results folder is a benchmark that ``make bench`` recorded (its
    columns provider, dtype, x ...), not another table kept beside them (a step's profile)."""
    with path.open() as f:
        header = f.readline().strip().split(",")
    return {"provider", "dtype", "x"} <= set(header)


def read_recording(path: Path) -> tuple[list[Point], dict]:
    """The points of a recording, and its axis: ``x_name`` and ``unit`` as recorded. Call
    and CPU time only where it has them (recordings before 2026-11-23's second run timed the
    GPU alone)."""
    optional = lambda text: float(text) if text else None
    with path.open() as f:
        rows = list(csv.DictReader(f))
    points = [
        Point(
            r["provider"],
            r["dtype"],
            float(r["x"]),
            float(r["value"]),
            call=optional(r.get("call_value")),
            cpu_us=optional(r.get("cpu_us")),
        )
        for r in rows
    ]
    axis = {"x_name": rows[0]["x_name"], "unit": rows[0]["unit"]} if rows else {}
    return points, axis


def read_points(path: Path) -> list[Point]:
    """The points of a recording (``read_recording`` without the axis)."""
    return read_recording(path)[0]


def as_number(x: float) -> int | float:
    """A recorded x value as the chapter wrote it: 1024, not 1024.0."""
    return int(x) if float(x).is_integer() else x


def as_recorded(bench: Benchmark, env: dict) -> Benchmark:
    """``bench`` as its recording ``env`` (from ``load_recorded``) names it: the axis and unit
    of the recorded CSV, the categories' names where recorded. A chapter's own label can
    differ (one built from the sizes it runs under the interpreter, say), and a plot of
    recorded points must not carry it."""
    changes = {key: env[key] for key in ("x_name", "unit") if key in env}
    if "x_labels" in env:
        changes["x_labels"] = {
            as_number(float(x)): name for x, name in env["x_labels"].items()
        }
    return dataclasses.replace(bench, **changes) if changes else bench


def shown_path(path: Path) -> str:
    """``path`` as a page may print it: from the package's folder (stepkernels/...) or the
    working folder, never the absolute path of the machine that built the page."""
    path = Path(path).resolve()
    for base in (PACKAGE_RESULTS.parent.parent, Path.cwd()):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return f".../{path.parent.name}/{path.name}"


def smoke(bench: Benchmark) -> None:
    """Under the interpreter: call every provider once at a small size, so the code runs."""
    for dtype in bench.dtypes:
        for provider in bench.providers:
            # torch.compile would compile C++ on a CPU: slow, and says nothing here; CUDA
            # graphs need a GPU.
            if "torch.compile" not in provider and "CUDA graph" not in provider:
                make_call(bench, provider, bench.smoke_x, dtype)()


def versions(env: dict) -> str:
    """The software a measurement ran with."""
    return (
        f"driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
        f"triton {env['triton']}"
    )


def describe(env: dict) -> str:
    """The GPU, the date and the software of a measurement, in one line."""
    return f"{env['gpu']}, {env['date']} ({versions(env)})"


# The software versions last printed by a summary: a block of output names them once.
# ``tutorial.announce()`` forgets them at the start of a chapter.
_versions_printed: list = [None]


def forget_environment_line() -> None:
    """Let the next summary print its software again (a new chapter begins)."""
    _versions_printed[0] = None


def environment_line(env: dict) -> str | None:
    """The versions of ``env`` for a summary to print, or None where the last summary printed
    the same ones."""
    line = versions(env)
    if _versions_printed[0] == line:
        return None
    _versions_printed[0] = line
    return line


def limit_for(unit: str, dtype: str, env: dict) -> float | None:
    """The measured ceiling a point of ``dtype`` is drawn against, or None: CPU time has none,
    and fp8's tensor cores are twice as fast as the fp16 cuBLAS product we measure."""
    if unit == "TFLOP/s" and dtype.startswith("float8"):
        return None
    return env["limits"].get(unit)


# Units where less is better: the headline's best peer is the least.
LOWER_IS_BETTER = (CPU_UNIT, MEMORY_UNIT)


def size_text(x: float) -> str:
    """A size as a reader writes it: 4,096; 2^16 for powers of two from 2^14; 0.5."""
    x = int(x) if float(x).is_integer() else x
    if isinstance(x, int) and x >= 2**14 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return f"{x:,}"


def x_text(bench: Benchmark, x) -> str:
    """How a reader names the point ``x``: its category's name, or its size and axis."""
    if bench.x_labels and x in bench.x_labels:
        return str(bench.x_labels[x])
    return f"{size_text(x)} ({bench.x_name})"


def value_text(value: float) -> str:
    """A value with the digits that matter: 1.80M; 2,700; 33.4; 2.17."""
    if value >= 1e6:
        return f"{value / 1e6:,.2f}M"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def ours_of(bench: Benchmark, providers: list) -> str:
    """The provider a headline speaks for: ``bench.ours``, else "triton", else the first whose
    name starts with it, else the first."""
    for candidate in (bench.ours, "triton"):
        if candidate in providers:
            return candidate
    return next((p for p in providers if p.startswith("triton")), providers[0])


def peers_of(bench: Benchmark, providers: list, ours: str) -> list:
    """The providers ``ours`` is compared with: not our own variants ("triton ..."), not the
    copy of the same bytes, not the benchmark's references."""
    return [
        p
        for p in providers
        if p != ours
        and not p.startswith("triton")
        and p != COPY_PROVIDER
        and p not in bench.references
    ]


def names_text(names: list) -> str:
    """torch; torch and liger_kernel; torch, torch.compile and liger_kernel."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def headline(
    bench: Benchmark, at: dict, env: dict, recorded: dict | None = None
) -> list[str]:
    """The lines that say how ``ours`` does at one point (``at``: provider -> Point), naming
    what it is compared with: its value and share of the limit, then its ratio to the best
    peer among those named (for CPU time and memory, where less is better, every peer's
    value instead: a ratio to a near-zero value says nothing); with ``recorded`` (provider
    -> Point), the recorded values beside those a quick run measured now."""
    ours = ours_of(bench, list(at))
    unit, mine = bench.unit, at[ours]
    then = lambda p: (
        ""
        if recorded is None or p not in recorded
        else f" ({value_text(recorded[p].value)} recorded)"
    )
    line = f"{ours} {value_text(mine.value)} {unit}{then(ours)}"
    limit = limit_for(unit, mine.dtype, env)
    if limit:
        whose = "this GPU's" if recorded is not None else "the"
        share = f"{mine.value / limit:.0%} of {whose} {LIMIT_NAME[unit]}"
        line += f", {share} ({limit:,.0f} {unit})"
    peers = peers_of(bench, list(at), ours)
    shown = [ours]
    if peers and unit in LOWER_IS_BETTER:
        line += "; " + ", ".join(
            f"{p} {value_text(at[p].value)}{then(p)}" for p in peers
        )
    elif peers and max(at[p].value for p in peers) > 0:
        best = max(peers, key=lambda p: at[p].value)
        shown.append(best)
        among = f", the fastest of {names_text(peers)}" if len(peers) > 1 else ""
        line += (
            f"; {mine.value / at[best].value:.2f}x {best}'s "
            f"{value_text(at[best].value)}{then(best)}{among}"
        )
    lines = [line]
    called = []
    for name in shown:
        p = at[name]
        if p.call is not None and p.cpu_us is not None:
            called.append(
                f"{name} {value_text(p.call)} {unit} ({p.cpu_us:,.0f} µs of CPU)"
            )
        elif p.cpu_us is not None and unit not in LOWER_IS_BETTER:
            called.append(f"{name} {p.cpu_us:,.0f} µs of CPU")
    if called:
        lines.append("called from Python: " + ", ".join(called))
    return lines


SUMMARY_WIDTH = 100  # characters: a page's output box and a notebook's


def summarize(
    bench: Benchmark,
    points: list[Point],
    env: dict,
    live: bool = True,
    measured: list[Point] | None = None,
    measured_env: dict | None = None,
) -> None:
    """Print a short headline: where the figures come from (the software once a block), then
    per dtype how ours does at the headline size against the best peer, whose rivals it
    names, and the limit. A quick run's ``measured`` points are compared at their size with
    the recording ``points``. Every provider: ``Results.table()``."""
    bench = bench if live else as_recorded(bench, env)
    if measured:
        head = (
            f"{bench.name}: measured now on {measured_env['gpu']}, beside the recording "
            f"on {env['gpu']}, {env['date']}"
        )
        shown, source = measured, measured_env
    elif bench.headline_x is not None:
        how = "measured now on" if live else "recorded on"
        head = f"{bench.name}: {how} {env['gpu']}, {env['date']}"
        shown, source = points, env
    else:
        return
    print(textwrap.fill(head, SUMMARY_WIDTH, subsequent_indent="    "))
    if software := environment_line(source):
        print(f"  ({software})")
    for dtype in dict.fromkeys(p.dtype for p in shown):
        mine = [p for p in shown if p.dtype == dtype]
        x = max(p.x for p in mine) if measured else bench.headline_x
        at = {p.provider: p for p in mine if p.x == x}
        if not at:
            continue
        recorded = None
        if measured:
            recorded = {p.provider: p for p in points if (p.dtype, p.x) == (dtype, x)}
        lines = headline(bench, at, source, recorded)
        where = (
            f'"{bench.x_labels[x]}"'
            if bench.x_labels and x in bench.x_labels
            else f"at {x_text(bench, x)}"
        )
        print(
            textwrap.fill(
                f"{dtype}, {where}: {lines[0]}",
                SUMMARY_WIDTH,
                initial_indent="  ",
                subsequent_indent="      ",
            )
        )
        for line in lines[1:]:
            print(
                textwrap.fill(
                    line,
                    SUMMARY_WIDTH,
                    initial_indent="    ",
                    subsequent_indent="      ",
                )
            )


def tick_text(value: float, step: float, top: float) -> str:
    """A tick label that needs no offset or exponent above the axis: 0.25; 3,000; 250k; 1.5M,
    with the decimals the ticks' ``step`` needs, in the scale that ``top`` (the axis's
    largest tick) sets."""
    scale, suffix = 1.0, ""
    for threshold, size, name in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if top >= threshold:
            scale, suffix = size, name
            break
    if value == 0:
        return "0"
    digits = 3
    for places in range(3):
        scaled = step / scale * 10**places
        if math.isclose(scaled, round(scaled), rel_tol=1e-6, abs_tol=1e-9):
            digits = places
            break
    return f"{value / scale:,.{digits}f}{suffix}"


def readable_ticks():
    """A matplotlib formatter writing every tick with ``tick_text``."""
    from matplotlib.ticker import Formatter

    class ReadableTicks(Formatter):
        ticks: list = []

        def set_locs(self, locs):  # every tick, before any is formatted
            self.ticks = sorted(locs)

        def __call__(self, value, pos=None):
            ticks = self.ticks or [value]
            steps = [b - a for a, b in zip(ticks, ticks[1:], strict=False) if b > a]
            step = min(steps, default=abs(value) or 1.0)
            return tick_text(value, step, max(abs(v) for v in ticks))

    return ReadableTicks()


def wrap_label(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, broken after spaces, dots,
    underscores, commas or slashes (a single longer word keeps its line)."""
    lines, line = [], ""
    for piece in re.split(r"(?<=[ ._,/])", text):
        if line and len((line + piece).rstrip()) > width:
            lines.append(line.rstrip())
            line = piece.lstrip()
        else:
            line += piece
    return "\n".join([*lines, line.rstrip()])


def series(points: list[Point], provider: str, dtype: str) -> list[Point]:
    """The points of ``provider`` in ``dtype``, in the order of x."""
    mine = (p for p in points if (p.provider, p.dtype) == (provider, dtype))
    return sorted(mine, key=lambda p: p.x)


def lying_under(xs: list, values: list, drawn: dict, tolerance: float) -> str | None:
    """The provider among ``drawn`` (provider -> (xs, values)) whose line this one would
    hide: the same x values, every value within ``tolerance``."""
    for other, (other_xs, other_values) in drawn.items():
        pairs = zip(values, other_values, strict=True) if other_xs == xs else None
        if pairs is not None and all(abs(a - b) <= tolerance for a, b in pairs):
            return other
    return None


def draw_limit(ax, unit: str, limit: float, measured_now: bool, recorded: bool) -> None:
    """The measured ceiling, dashed and named above it at the left; measured now beside a
    recording, dash-dotted and named below it, so that two close ceilings keep apart."""
    where = "measured now" if measured_now else "recorded" if recorded else "measured"
    color = "black" if measured_now else "0.35"
    ax.axhline(limit, lw=1, ls="-." if measured_now else "--", color=color)
    ax.annotate(
        f"{LIMIT_NAME[unit]} {limit:,.0f} {unit} ({where})",
        (0.01, limit),
        xycoords=("axes fraction", "data"),
        va="top" if measured_now else "bottom",
        fontsize=8,
        color=color,
    )


def dodged(xs: list, index: int, count: int, log2: bool) -> list:
    """``xs`` moved aside by the ``index``-th of ``count`` small steps, so that markers of
    several providers at one x sit side by side, none hidden under another."""
    step = index - (count - 1) / 2
    return [x * 2 ** (0.06 * step) if log2 else x * (1 + 0.01 * step) for x in xs]


FIGURE_WIDTH = 8.0  # inches: a page's column and a notebook's output, at 100 dpi
AXIS_WIDTH = 6.8  # inches of it left to the axes beside the y labels
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
# Lines closer than this share of the axis's height at every point look like one.
SAME_LINE = 0.006
FADED = 0.45  # the alpha of recorded lines beneath points measured now


def plot(
    bench: Benchmark,
    points: list[Point],
    env: dict,
    live: bool,
    measured: list[Point] | None = None,
    measured_env: dict | None = None,
):
    """One panel per dtype, stacked so that each is legible at page width, with the measured
    ceiling dashed, the title above and one legend below. Each provider has its color and
    marker; a line lying on another's is dashed and hollow over it, and named so in the
    legend. Recorded points are labelled as their recording names them (its axis, not the
    chapter's). A quick run's ``measured`` points (in ``measured_env``) are large markers
    over the faded lines of ``points``, then the recording."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    import matplotlib.pyplot as plt

    measured = measured or []
    live_x_name = bench.x_name
    bench = bench if live else as_recorded(bench, env)
    shown = [*points, *measured]
    dtypes = list(dict.fromkeys(p.dtype for p in shown))
    fig, axes = plt.subplots(
        len(dtypes),
        1,
        figsize=(FIGURE_WIDTH, 1.7 + 2.9 * len(dtypes)),
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    # A recording may hold providers this machine cannot run (a library not installed here).
    providers = list(dict.fromkeys([*bench.providers, *(p.provider for p in shown)]))
    drawn = [p for p in providers if any(q.provider == p for q in shown)]
    colors = provider_colors(providers, bench.colors)
    markers = {p: MARKERS[i % len(MARKERS)] for i, p in enumerate(drawn)}
    categories, faded = bench.x_labels, bool(measured)
    alpha = FADED if faded else 1.0
    now_style = dict(ls="none", ms=9, mec="black", zorder=4)
    lies_on: dict = {}  # provider -> (the provider whose line it lies on, in which dtypes)
    for ax, dtype in zip(axes[:, 0], dtypes, strict=True):
        limit = limit_for(bench.unit, dtype, env)
        live_limit = limit_for(bench.unit, dtype, measured_env) if faded else None
        values = [p.value for p in shown if p.dtype == dtype]
        top = max([limit or 0, live_limit or 0, *values])
        lines: dict = {}
        for index, provider in enumerate(drawn):
            mine, now = (
                series(points, provider, dtype),
                series(measured, provider, dtype),
            )
            color, marker = colors[provider], markers[provider]
            if categories:  # one bar per provider in each category, no lines between
                width = 0.8 / len(drawn)
                offset = (index - (len(drawn) - 1) / 2) * width
                at = {x: i + offset for i, x in enumerate(categories)}
                mine, now = (
                    [p for p in mine if p.x in at],
                    [p for p in now if p.x in at],
                )
                xs = [at[p.x] for p in mine]
                ax.bar(xs, [p.value for p in mine], width, color=color, alpha=alpha)
                called = [(at[p.x], p.call) for p in mine if p.call is not None]
                if called:  # the call's rate: a black tick on each bar
                    ax.scatter(
                        *zip(*called, strict=True),
                        marker="_",
                        s=120,
                        color="black",
                        zorder=3,
                    )
                if now:
                    ax.plot(
                        [at[p.x] for p in now],
                        [p.value for p in now],
                        marker=marker,
                        mfc=color,
                        **now_style,
                    )
                continue
            if mine:
                xs, ys = [p.x for p in mine], [p.value for p in mine]
                under = lying_under(xs, ys, lines, SAME_LINE * top)
                lines[provider] = (xs, ys)
                style = dict(color=color, marker=marker, ms=4, lw=1.5, alpha=alpha)
                if (
                    under is not None
                ):  # dashed and hollow: the line beneath shows through
                    lies_on.setdefault(provider, (under, []))[1].append(dtype)
                    style.update(ls="--", mfc="none", ms=8)
                ax.plot(xs, ys, **style)
                called = [(p.x, p.call) for p in mine if p.call is not None]
                if called:  # the same call made from Python: dotted, in the same color
                    ax.plot(
                        *zip(*called, strict=True),
                        ls=":",
                        lw=1.5,
                        color=color,
                        alpha=alpha,
                    )
                if live and mine[0].low is not None:
                    lows, highs = [p.low for p in mine], [p.high for p in mine]
                    ax.fill_between(xs, lows, highs, alpha=0.2, color=color)
            if now:  # side by side: one size holds every provider's marker
                xs = dodged([p.x for p in now], index, len(drawn), bench.x_log2)
                ax.plot(
                    xs, [p.value for p in now], marker=marker, mfc=color, **now_style
                )
        if limit is not None:
            draw_limit(ax, bench.unit, limit, measured_now=False, recorded=faded)
        if live_limit is not None:
            draw_limit(ax, bench.unit, live_limit, measured_now=True, recorded=False)
        if categories:  # names wrapped to their category's share of the axis
            characters = max(6, int(AXIS_WIDTH * 72 / (0.55 * 8) / len(categories)))
            names = [wrap_label(str(v), characters) for v in categories.values()]
            ax.set_xticks(range(len(categories)), names, fontsize=8)
        elif bench.x_log2:
            ax.set_xscale("log", base=2)
        ax.set(ylim=(0, 1.15 * top), ylabel=f"{dtype}\n{bench.unit}")
        ax.yaxis.set_major_formatter(readable_ticks())
        ax.grid(alpha=0.3, axis="y" if categories else "both")
    axes[-1, 0].set_xlabel(bench.x_name)
    handles, labels = [], []
    for provider in drawn:
        label, dashed = provider, provider in lies_on
        if dashed:
            under, where = lies_on[provider]
            label += f" (same as {under}"
            label += ")" if len(where) == len(dtypes) else f" in {names_text(where)})"
        if categories:
            handles.append(Patch(color=colors[provider]))
        else:
            handles.append(
                Line2D(
                    [],
                    [],
                    color=colors[provider],
                    marker=markers[provider],
                    ls="--" if dashed else "-",
                    mfc="none" if dashed else None,
                    ms=6 if dashed else 4,
                )
            )
        labels.append(label)
    if any(p.call is not None for p in points):
        bars = bool(categories)
        handles += [
            Line2D([], [], color="0.3", ls="-", lw=6 if bars else 1.5),
            Line2D(
                [],
                [],
                color="black",
                ls="" if bars else ":",
                marker="_" if bars else "",
                ms=12,
            ),
        ]
        labels += ["GPU time (CUDA graph)", "called from Python"]
    if faded:
        recorded = (
            Patch(color="0.3", alpha=FADED)
            if categories
            else Line2D([], [], color="0.3", alpha=FADED)
        )
        handles += [recorded, Line2D([], [], marker="o", mfc="0.6", **now_style)]
        at = "" if live_x_name == bench.x_name else f", at {live_x_name}"
        labels += [
            f"recorded on {env['gpu']}",
            f"measured now on {measured_env['gpu']}{at}",
        ]
    widest = max(map(len, labels))
    columns = max(1, min(len(labels), int(FIGURE_WIDTH / (0.06 * widest + 0.55))))
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=columns,
        fontsize=8,
        frameon=False,
    )
    if faded:
        lines = [
            bench.name,
            f"markers: measured now on {describe(measured_env)}",
            f"lines: recorded on {describe(env)}",
        ]
    else:
        how = "measured now" if live else "recorded"
        lines = [
            f"{bench.name}: {how} on {env['gpu']}, {env['date']}",
            f"({versions(env)})",
        ]
    fig.suptitle("\n".join(textwrap.fill(line, 105) for line in lines), fontsize=9)
    return fig


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (a notebook, whatever its backend)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


# Backends that draw into files: no window to show, and sphinx-gallery's scraper (which
# collects a cell's figures itself) or a test reads the figure.
FILE_BACKENDS = ("agg", "cairo", "pdf", "pgf", "ps", "svg", "template")
_shown_at_exit: list = []


def show() -> None:
    """Show the figures drawn so far where a reader can see them now: in a notebook, as the
    cell's next output (each figure its own output, at full width); in a script run with a
    window, in windows that stay open until closed when the script ends (``plt.show()``).
    Nothing under a backend that draws into files: the gallery (Agg), nbval with Agg, tests."""
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend().lower()
    if backend in FILE_BACKENDS or not plt.get_fignums():
        return
    if "inline" in backend or in_notebook():
        plt.show()
        return
    plt.show(block=False)  # drawn now; the windows wait for the reader at the end
    plt.pause(0.001)
    if not _shown_at_exit:
        _shown_at_exit.append(atexit.register(plt.show))


@dataclass
class Results:
    """What ``run`` measured or loaded, for a chapter to quote: figures reach the page through
    code, so a new recording cannot make the prose wrong. Recorded results carry the
    recording's own labels and sizes (``as_recorded``). After a quick run the points are the
    recording's, complete, and ``measured`` holds the few points measured now."""

    bench: Benchmark
    points: list[Point]
    env: dict
    live: bool
    measured: list[Point] | None = None
    measured_env: dict | None = None

    def __post_init__(self):
        if not self.live:
            self.bench = as_recorded(self.bench, self.env)
            dtypes = [
                getattr(torch, d, None)
                for d in dict.fromkeys(p.dtype for p in self.points)
            ]
            self.bench = dataclasses.replace(
                self.bench,
                x_values=sorted({as_number(p.x) for p in self.points})
                or self.bench.x_values,
                dtypes=tuple(d for d in dtypes if d is not None) or self.bench.dtypes,
            )

    def value(self, provider: str, x, dtype: str | torch.dtype = "float32") -> float:
        """The rate (or CPU time) of ``provider`` at ``x``; NaN where nothing was recorded."""
        point = self.point(provider, x, dtype)
        return float("nan") if point is None else point.value

    def ratio(
        self, provider: str, other: str, x, dtype: str | torch.dtype = "float32"
    ) -> float:
        """``provider``'s value over ``other``'s at ``x``."""
        return self.value(provider, x, dtype) / self.value(other, x, dtype)

    def point(self, provider: str, x, dtype: str | torch.dtype = "float32"):
        """The point of ``provider`` at ``x`` in ``dtype``, or None."""
        dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
        found = [
            p for p in self.points if (p.provider, p.dtype, p.x) == (provider, dtype, x)
        ]
        return found[0] if found else None

    def call(self, provider: str, x, dtype: str | torch.dtype = "float32") -> float:
        """The rate of the call made from Python; NaN where it was not timed."""
        point = self.point(provider, x, dtype)
        return float("nan") if point is None or point.call is None else point.call

    def cpu_us(self, provider: str, x, dtype: str | torch.dtype = "float32") -> float:
        """CPU time of one call in µs; NaN where it was not timed."""
        point = self.point(provider, x, dtype)
        return float("nan") if point is None or point.cpu_us is None else point.cpu_us

    def as_called(self, ours: str, theirs: str, x, dtype="float32") -> str:
        """What a reader's code sees at ``x``: each provider called from Python (do_bench of
        the call) and the CPU time of one call, against the GPU time the plot shows."""
        if self.bench.unit in (CPU_UNIT, MEMORY_UNIT) or math.isnan(
            self.call(ours, x, dtype)
        ):
            return f"{self.bench.name}: no call from Python timed in this recording"
        unit, name = (
            self.bench.unit,
            dtype if isinstance(dtype, str) else dtype_name(dtype),
        )
        parts = [
            f"{p}: {self.call(p, x, dtype):,.0f} {unit} called from Python "
            f"(GPU time {self.value(p, x, dtype):,.0f}), {self.cpu_us(p, x, dtype):.0f} µs "
            "of CPU per call"
            for p in (ours, theirs)
        ]
        head = f"{self.bench.name}, {name}, at {x_text(self.bench, x)}, {self.how}:"
        return "\n  ".join([head, *parts])

    def providers(self) -> list[str]:
        """Every provider with a point, in order: a recording may hold peers not installed."""
        return list(dict.fromkeys(p.provider for p in self.points))

    def standing(self, ours: str, limit: str | None = None, peers=None) -> list[str]:
        """One line per dtype: at how many of the sizes ``ours`` is at or above every peer
        (``peers``, or every other provider but ``limit``), naming them, its range of values,
        and its share of the ``limit`` provider. For CPU time and memory, at or below."""
        peers = peers or [p for p in self.providers() if p not in (ours, limit)]
        lower = self.bench.unit in LOWER_IS_BETTER
        lines = []
        for dtype in dict.fromkeys(p.dtype for p in self.points):
            xs = sorted(
                {p.x for p in self.points if (p.provider, p.dtype) == (ours, dtype)}
            )
            mine = [self.value(ours, x, dtype) for x in xs]
            rivals = [p for p in peers if any(self.point(p, x, dtype) for x in xs)]
            best = [
                (min if lower else max)(
                    (
                        self.value(p, x, dtype)
                        for p in rivals
                        if self.point(p, x, dtype)
                    ),
                    default=math.inf if lower else -math.inf,
                )
                for x in xs
            ]
            ahead = sum(
                (m <= b) if lower else (m >= b) for m, b in zip(mine, best, strict=True)
            )
            side = "at or below" if lower else "at or above"
            noun = "categories" if self.bench.x_labels else "sizes"
            against = names_text(rivals) if rivals else "no peer"
            line = (
                f"{dtype}: {ours} {side} {against} at {ahead} of {len(xs)} {noun}; "
                f"{min(mine):,.0f} to {max(mine):,.0f} {self.bench.unit}"
            )
            if limit:
                shares = [
                    m / self.value(limit, x, dtype)
                    for m, x in zip(mine, xs, strict=True)
                ]
                line += f", {min(shares):.0%} to {max(shares):.0%} of {limit}"
            lines.append(line)
        return lines

    def table(self, x=None) -> str:
        """Every provider at ``x`` (the headline size, else the largest), per dtype: its value,
        its share of the limit, and where timed the call from Python and its CPU time."""
        unit, lines = self.bench.unit, []
        for dtype in dict.fromkeys(p.dtype for p in self.points):
            mine = [p for p in self.points if p.dtype == dtype]
            at = x if x is not None else self.bench.headline_x
            at = at if any(p.x == at for p in mine) else max(p.x for p in mine)
            lines.append(
                f"{self.bench.name}, {dtype}, at {x_text(self.bench, at)}, {self.how}:"
            )
            rows = [p for p in mine if p.x == at]
            width = max(len(p.provider) for p in rows)
            limit = limit_for(unit, dtype, self.env)
            for p in rows:
                line = f"  {p.provider:<{width}}  {value_text(p.value):>9} {unit}"
                if limit:
                    line += f"  {p.value / limit:5.0%} of {limit:,.0f}"
                if p.call is not None:
                    line += f"  called from Python {value_text(p.call):>9}"
                if p.cpu_us is not None and unit != CPU_UNIT:
                    line += f"  {p.cpu_us:8,.1f} µs of CPU per call"
                lines.append(line)
        return "\n".join(lines)

    @property
    def how(self) -> str:
        """Where the points come from, in a few words: a line may carry it."""
        if self.live:
            return f"measured now on {self.env['gpu']}"
        return f"recorded on {self.env['gpu']}, {self.env['date']}"

    @property
    def environment(self) -> str:
        """The GPU, date and software of the points, in full."""
        return describe(self.env)


def selected(name: str) -> bool:
    """Whether a GPU run measures the benchmark ``name``: all, or those in STEPKERNELS_ONLY
    (``make bench ONLY=name,name``)."""
    only = os.environ.get("STEPKERNELS_ONLY")
    return not (ON_GPU and only and name not in only.split(","))


def full_sweep() -> bool:
    """Whether a GPU run measures every size: under ``make bench`` (STEPKERNELS_RECORD=1,
    since a recording is always the full sweep) or with STEPKERNELS_FULL=1. Otherwise a run
    is quick (``quick_x_values``)."""
    return "1" in (
        os.environ.get("STEPKERNELS_RECORD"),
        os.environ.get("STEPKERNELS_FULL"),
    )


# Providers a quick run leaves to the recording: compiling them for each shape and dtype takes
# longer than the rest of a chapter's run (chapter 05's activations compile ten graphs).
RECORDED_IN_QUICK_RUNS = ("torch.compile",)


def quick_providers(bench: Benchmark) -> list:
    """The providers a quick run measures: all but those it leaves to the recording."""
    return [p for p in bench.providers if not p.startswith(RECORDED_IN_QUICK_RUNS)]


def quick_dtypes(bench: Benchmark) -> tuple:
    """The dtypes a quick run measures: ``bench.quick_dtypes``, or every one."""
    return bench.dtypes if bench.quick_dtypes is None else tuple(bench.quick_dtypes)


def quick_x_values(bench: Benchmark) -> list:
    """The x values a quick run measures: the largest size (for every dtype and provider),
    or every category of a benchmark of categories (they are not sizes)."""
    if bench.x_labels or len(bench.x_values) <= 1:
        return list(bench.x_values)
    return [max(bench.x_values)]


def measure_now(
    bench: Benchmark, points_of: Callable | None, quick: Callable | None
) -> Results:
    """A GPU run: the full sweep (recorded under ``make bench``), or a quick one drawn over
    the recording of this GPU (else of the GPU recorded last)."""
    full = full_sweep()
    if points_of is not None:
        how, partial = (points_of, False) if full else (quick, True)
    else:
        timed = (
            bench
            if full
            else dataclasses.replace(
                bench,
                x_values=quick_x_values(bench),
                providers=quick_providers(bench),
                dtypes=quick_dtypes(bench),
            )
        )
        how = functools.partial(measure, timed) if timed.dtypes else None
        partial = (
            list(timed.x_values) != list(bench.x_values)
            or list(timed.providers) != list(bench.providers)
            or list(timed.dtypes) != list(bench.dtypes)
        )
    recorded = load_recorded(bench.name, gpu=gpu_name()) if partial else None
    if partial and recorded is None and (points_of is not None or how is None):
        # nothing recorded to show instead of what a quick run leaves out: measure it all
        how, partial = points_of or functools.partial(measure, bench), False
    if how is None:
        print(
            f"{bench.name}: not measured in a quick run (STEPKERNELS_FULL=1 measures it)"
        )
        return Results(bench, *recorded, live=False)
    with gpu_state() as state:
        points = how()
    env = {**environment(), "gpu_state": state, "timing": timing_of(bench)}
    if not partial:
        if os.environ.get("STEPKERNELS_RECORD") == "1":
            print(f"recorded {shown_path(record(bench, points, env))}")
        return Results(bench, points, env, live=True)
    if recorded is None:
        print(
            f"{bench.name}: nothing recorded to draw these points over; "
            "STEPKERNELS_FULL=1 measures every size"
        )
        return Results(bench, points, env, live=True)
    return Results(bench, *recorded, live=False, measured=points, measured_env=env)


def run(
    bench: Benchmark,
    points_of: Callable | None = None,
    draw: bool = True,
    quick: Callable | None = None,
) -> Results | None:
    """Measure (GPU) or show the recording (no GPU), draw the plot and print the headline.

    Returns the points shown (None when there are none). On a GPU a run is quick unless
    STEPKERNELS_FULL=1 or STEPKERNELS_RECORD=1 (``make bench``, which also writes the results
    folder): it measures ``quick_x_values`` and draws them over the recording. With
    STEPKERNELS_ONLY set to benchmark names, separated by commas, a GPU measures only those.
    ``points_of()``, for what is not one timed call (a training run), measures the points
    instead of ``make``; a quick run calls ``quick()`` instead, and without one shows the
    recording. ``draw=False`` leaves the plot and headline to the chapter.
    """
    if not selected(bench.name):
        print(
            f"{bench.name}: not measured (STEPKERNELS_ONLY={os.environ['STEPKERNELS_ONLY']})"
        )
        return None
    if ON_GPU:
        results = measure_now(bench, points_of, quick)
    else:
        if points_of is None:
            smoke(bench)
        found = load_recorded(bench.name)
        if found is None:
            where = shown_path(default_results_dir())
            print(
                f"No recorded GPU results for {bench.name!r} in {where}: run `make bench` on a GPU."
            )
            return None
        results = Results(bench, *found, live=False)
    if draw:
        plot(
            bench,
            results.points,
            results.env,
            results.live,
            results.measured,
            results.measured_env,
        )
        show()
        summarize(
            bench,
            results.points,
            results.env,
            results.live,
            results.measured,
            results.measured_env,
        )
    return results


def text_file(name: str, text: str | None = None) -> str | None:
    """Text beside the recorded results (a model's sample, say): on a GPU ``text``, also
    recorded under ``make bench``; without one, the recorded text (None if there is none)."""
    if ON_GPU and text is not None:
        if os.environ.get("STEPKERNELS_RECORD") == "1":
            folder = gpu_results_dir(torch.cuda.get_device_name())
            (folder / name).write_text(text + "\n")
        return text
    folder = recorded_gpu_dir(holding=name)
    path = None if folder is None else folder / name
    return path.read_text().rstrip("\n") if path is not None and path.exists() else None
