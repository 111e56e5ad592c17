r"""Timing, recording and plotting for the chapters' benchmarks, in one place.

On a GPU, ``run(benchmark)`` measures every provider at every size (GPU time of CUDA-graph
replays, L2 flushed), plots the rates against the hardware limit and prints a summary; with
``STEPKERNELS_RECORD=1`` (``make bench``) it also writes them to the results folder. Without a
GPU it calls every provider once at a small size, so the code runs, and shows the results
recorded on a GPU instead: interpreter timings are never shown.

Importing this module changes nothing: every setting a measurement needs (Inductor's compile
threads, dynamo's recompile limit, fp32 matmul precision) is set for the measurement and
restored after it, also on error.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import csv
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


def choose(gpu, cpu):
    """The full-size value on a GPU, the small one under the interpreter."""
    return gpu if ON_GPU else cpu


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
    value = ("GPU time of CUDA-graph replays" if bench.gpu_time
             else "the call from Python")  # fmt: skip
    how = (
        "a point's providers in 5 turns"
        if bench.in_turns
        else "each provider alone, 5 turns"
    )
    return (
        f"{value} (do_bench, L2 flushed), {how} of 40 ms, median of all samples; "
        "cpu_us: CPU time of one call issued back to back"
    )


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
        "gpu": torch.cuda.get_device_name(),
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
        "sm_clock_mhz": {"median": statistics.median(clock), "min": min(clock),
                         "max": max(clock), "max_possible": max(max_clock)},
        "power_w": {"median": statistics.median(power), "max": max(power)},
        "temperature_c": {"median": statistics.median(temperature),
                          "max": max(temperature)},
        "clock_event_reasons": sorted({hex(r) for r in reasons if r}),
    }  # fmt: skip


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
    command = ["nvidia-smi", f"--query-gpu={GPU_STATE_QUERY}", "--format=csv,noheader,nounits",
               f"--loop-ms={interval_ms}", f"--id=GPU-{uuid}"]  # fmt: skip
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
                print(f"  {provider} at {bench.x_name}={x}: skipped, {error}")
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
        print(f"  {providers[0]} at {bench.x_name}={x}: out of GPU memory, skipped")
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
        writer.writerow(["benchmark", "provider", "dtype", "x_name", "x", "value",
                         "unit", "call_value", "cpu_us"])  # fmt: skip
        for p in points:
            optional = ["" if v is None else f"{v:.6g}" for v in (p.call, p.cpu_us)]
            writer.writerow([bench.name, p.provider, p.dtype, bench.x_name, p.x,
                             f"{p.value:.6g}", bench.unit, *optional])  # fmt: skip
    env_path = folder / "environment.json"
    recorded = json.loads(env_path.read_text()) if env_path.exists() else {}
    benchmarks = {**recorded.get("benchmarks", {}), bench.name: env}
    env_path.write_text(
        json.dumps({**env, "benchmarks": dict(sorted(benchmarks.items()))}, indent=1)
        + "\n"
    )
    return path


def recorded_gpu_dir(results_dir: Path | None = None) -> Path | None:
    """The results folder to show without a GPU: $STEPKERNELS_RESULTS_GPU, else the newest recording."""
    folders = [
        p.parent
        for p in (results_dir or default_results_dir()).glob("*/environment.json")
    ]
    wanted = os.environ.get("STEPKERNELS_RESULTS_GPU")
    if wanted:
        folders = [f for f in folders if f.name == wanted]
    newest_first = sorted(
        folders,
        key=lambda f: (
            json.loads((f / "environment.json").read_text())["date"],
            f.name,
        ),
    )
    return newest_first[-1] if newest_first else None


def load_recorded(
    name: str, results_dir: Path | None = None
) -> tuple[list[Point], dict] | None:
    folder = recorded_gpu_dir(results_dir)
    if folder is None or not (folder / f"{name}.csv").exists():
        return None
    env = json.loads((folder / "environment.json").read_text())
    return read_points(folder / f"{name}.csv"), env["benchmarks"].get(name, env)


def read_points(path: Path) -> list[Point]:
    """The points of a recording; call and CPU time only where it has them (recordings
    before 2026-11-23's second run timed the GPU alone)."""
    optional = lambda text: float(text) if text else None
    with path.open() as f:
        return [
            Point(r["provider"], r["dtype"], float(r["x"]), float(r["value"]),
                  call=optional(r.get("call_value")), cpu_us=optional(r.get("cpu_us")))
            for r in csv.DictReader(f)
        ]  # fmt: skip


def smoke(bench: Benchmark) -> None:
    """Under the interpreter: call every provider once at a small size, so the code runs."""
    for dtype in bench.dtypes:
        for provider in bench.providers:
            # torch.compile would compile C++ on a CPU: slow, and says nothing here; CUDA
            # graphs need a GPU.
            if "torch.compile" not in provider and "CUDA graph" not in provider:
                make_call(bench, provider, bench.smoke_x, dtype)()


def describe(env: dict) -> str:
    return (
        f"{env['gpu']}, {env['date']} (driver {env['driver']}, CUDA {env['cuda']}, "
        f"torch {env['torch']}, triton {env['triton']})"
    )


def limit_for(unit: str, dtype: str, env: dict) -> float | None:
    """The measured ceiling a point of ``dtype`` is drawn against, or None: CPU time has none,
    and fp8's tensor cores are twice as fast as the fp16 cuBLAS product we measure."""
    if unit == "TFLOP/s" and dtype.startswith("float8"):
        return None
    return env["limits"].get(unit)


def plot(bench: Benchmark, points: list[Point], env: dict, live: bool):
    """One panel per dtype, stacked so that each is legible at page width, with the measured
    ceiling dashed and one legend beside them, off the data."""
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(p.dtype for p in points))
    fig, axes = plt.subplots(
        len(dtypes), 1, figsize=(8.0, 1.2 + 3.0 * len(dtypes)), squeeze=False,
        sharex=True, layout="constrained",
    )  # fmt: skip
    # A recording may hold providers this machine cannot run (a library not installed here).
    providers = list(dict.fromkeys([*bench.providers, *(p.provider for p in points)]))
    colors = provider_colors(providers, bench.colors)
    categories = bench.x_labels
    for ax, dtype in zip(axes[:, 0], dtypes, strict=True):
        limit = limit_for(bench.unit, dtype, env)
        drawn = [p for p in providers if any(q.provider == p for q in points)]
        for index, provider in enumerate(drawn):
            mine = sorted(
                (p for p in points if p.provider == provider and p.dtype == dtype),
                key=lambda p: p.x,
            )
            if not mine:
                continue
            values = [p.value for p in mine]
            if categories:  # one bar per provider in each category, no lines between
                width = 0.8 / len(drawn)
                xs = [
                    list(categories).index(p.x) + (index - (len(drawn) - 1) / 2) * width
                    for p in mine
                ]
                ax.bar(xs, values, width, label=provider, color=colors[provider])
                called = [
                    (x, p.call)
                    for x, p in zip(xs, mine, strict=True)
                    if p.call is not None
                ]
                if called:  # the call's rate: a black tick on each bar
                    ax.scatter(
                        *zip(*called, strict=True),
                        marker="_",
                        s=120,
                        color="black",
                        zorder=3,
                    )
                continue
            xs = [p.x for p in mine]
            ax.plot(
                xs, values, marker="o", ms=3, label=provider, color=colors[provider]
            )
            called = [(p.x, p.call) for p in mine if p.call is not None]
            if called:  # the same call made from Python: dotted, in the same color
                ax.plot(
                    *zip(*called, strict=True), ls=":", lw=1.5, color=colors[provider]
                )
            if live and mine[0].low is not None:
                lows, highs = [p.low for p in mine], [p.high for p in mine]
                ax.fill_between(xs, lows, highs, alpha=0.2, color=colors[provider])
        if limit is not None:
            ax.axhline(limit, ls="--", lw=1, color="0.35")
            ax.annotate(
                f"{LIMIT_NAME[bench.unit]} {limit:,.0f} {bench.unit} (measured)",
                (0.01, limit), xycoords=("axes fraction", "data"), va="bottom",
                fontsize=8, color="0.35",
            )  # fmt: skip
        if categories:
            ax.set_xticks(range(len(categories)), [str(v) for v in categories.values()])
        elif bench.x_log2:
            ax.set_xscale("log", base=2)
        top = max([limit or 0, *(p.value for p in points if p.dtype == dtype)])
        ax.set(ylim=(0, 1.15 * top), ylabel=f"{dtype}\n{bench.unit}")
        ax.grid(alpha=0.3, axis="y" if categories else "both")
    axes[-1, 0].set_xlabel(bench.x_name)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if any(p.call is not None for p in points):
        from matplotlib.lines import Line2D

        bars = bool(categories)
        handles += [
            Line2D([], [], color="0.3", ls="-", lw=6 if bars else 1.5),
            Line2D([], [], color="black", ls="" if bars else ":", marker="_" if bars else "",
                   ms=12),
        ]  # fmt: skip
        labels += ["GPU time (CUDA graph)", "called from Python"]
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    how = "measured now" if live else "recorded"
    title = f"{bench.name}: {how} on {describe(env)}"
    fig.suptitle(textwrap.fill(title, 72), fontsize=9)
    return fig


def summarize(
    bench: Benchmark, points: list[Point], env: dict, live: bool = True
) -> None:
    """Print each provider's rate at the headline size and its share of the hardware limit,
    saying whether the figures were measured now or recorded."""
    if bench.headline_x is None:
        return
    how = "measured now" if live else f"recorded {env['date']} on {env['gpu']}"
    for dtype in dict.fromkeys(p.dtype for p in points):
        limit = limit_for(bench.unit, dtype, env)
        print(
            f"{bench.name}, {dtype}, at {bench.headline_x:,} ({bench.x_name}), {how}:"
        )
        width = max(14, *(len(p.provider) for p in points))
        rate = 10 + len(bench.unit)  # "12,345.6 GB/s"
        if any(p.call is not None for p in points):
            print(f"  {'':<{width}} {'GPU time':>{rate}}  {'':<16} "
                  f"{'called from Python':>{max(rate, 18)}}  CPU per call")  # fmt: skip
        elif any(p.cpu_us is not None for p in points):
            print(f"  {'':<{width}} {'called from Python':>{rate}}  {'':<16} CPU per call")  # fmt: skip
        for p in points:
            if p.dtype == dtype and p.x == bench.headline_x:
                share = (
                    "" if limit is None else f"{p.value / limit:6.1%} of {limit:,.0f}"
                )
                value = f"{p.value:,.1f} {bench.unit}"
                line = f"  {p.provider:<{width}} {value:>{rate}}  {share:<16}"
                if p.call is not None:
                    called = f"{p.call:,.1f} {bench.unit}"
                    line += f" {called:>{max(rate, 18)}}  {p.cpu_us:7.1f} µs"
                elif p.cpu_us is not None:  # the value is the call from Python
                    line += f" {p.cpu_us:7.1f} µs"
                print(line.rstrip())


@dataclass
class Results:
    """What ``run`` measured or loaded, for a chapter to quote: figures reach the page through
    code, so a new recording cannot make the prose wrong."""

    bench: Benchmark
    points: list[Point]
    env: dict
    live: bool

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
        head = f"{self.bench.name}, {name}, at {x:,} ({self.bench.x_name}), {self.how}:"
        return "\n  ".join([head, *parts])

    def providers(self) -> list[str]:
        """Every provider with a point, in order: a recording may hold peers not installed."""
        return list(dict.fromkeys(p.provider for p in self.points))

    def standing(self, ours: str, limit: str | None = None, peers=None) -> list[str]:
        """One line per dtype: at how many x ``ours`` is at or above every peer (``peers``,
        or every other provider recorded but ``limit``), its range of values, and its share
        of the ``limit`` provider."""
        peers = peers or [p for p in self.providers() if p not in (ours, limit)]
        lines = []
        for dtype in dict.fromkeys(p.dtype for p in self.points):
            xs = sorted(
                {p.x for p in self.points if (p.provider, p.dtype) == (ours, dtype)}
            )
            mine = [self.value(ours, x, dtype) for x in xs]
            best = [max((self.value(p, x, dtype) for p in peers if self.point(p, x, dtype)),
                        default=-math.inf) for x in xs]  # fmt: skip
            ahead = sum(m >= b for m, b in zip(mine, best, strict=True))
            line = (f"{dtype}: {ours} at or above every peer at {ahead} of {len(xs)} points; "
                    f"{min(mine):,.0f} to {max(mine):,.0f} {self.bench.unit}")  # fmt: skip
            if limit:
                shares = [
                    m / self.value(limit, x, dtype)
                    for m, x in zip(mine, xs, strict=True)
                ]
                line += f", {min(shares):.0%} to {max(shares):.0%} of {limit}"
            lines.append(line)
        return lines

    @property
    def how(self) -> str:
        return "measured now" if self.live else f"recorded on {describe(self.env)}"


def selected(name: str) -> bool:
    """Whether a GPU run measures the benchmark ``name``: all, or those in STEPKERNELS_ONLY
    (``make bench ONLY=name,name``)."""
    only = os.environ.get("STEPKERNELS_ONLY")
    return not (ON_GPU and only and name not in only.split(","))


def run(
    bench: Benchmark, points_of: Callable | None = None, draw: bool = True
) -> Results | None:
    """Measure (GPU) or show the recording (no GPU), draw the plot and print the summary.

    Returns the points shown (None when there are none). With STEPKERNELS_RECORD=1 (``make
    bench``) the measurement is also written to the results folder; with STEPKERNELS_ONLY set
    to benchmark names, separated by commas, a GPU measures only those. ``points_of()``, for
    what is not one timed call (a training run), measures the points instead of ``make``;
    ``draw=False`` leaves the plot and summary to the chapter.
    """
    if not selected(bench.name):
        print(
            f"{bench.name}: not measured (STEPKERNELS_ONLY={os.environ['STEPKERNELS_ONLY']})"
        )
        return None
    if ON_GPU:
        with gpu_state() as state:
            points = (points_of or functools.partial(measure, bench))()
        env = {**environment(), "gpu_state": state, "timing": timing_of(bench)}
        if os.environ.get("STEPKERNELS_RECORD") == "1":
            print(f"recorded {record(bench, points, env)}")
    else:
        if points_of is None:
            smoke(bench)
        found = load_recorded(bench.name)
        if found is None:
            where = f"{bench.name!r} under {default_results_dir()}"
            print(f"No recorded GPU results for {where}: run `make bench` on a GPU.")
            return None
        points, env = found
    if not draw:
        return Results(bench, points, env, live=ON_GPU)
    plot(bench, points, env, live=ON_GPU)
    summarize(bench, points, env, live=ON_GPU)
    return Results(bench, points, env, live=ON_GPU)


def text_file(name: str, text: str | None = None) -> str | None:
    """Text beside the recorded results (a model's sample, say): on a GPU ``text``, also
    recorded under ``make bench``; without one, the recorded text (None if there is none)."""
    if ON_GPU and text is not None:
        if os.environ.get("STEPKERNELS_RECORD") == "1":
            folder = gpu_results_dir(torch.cuda.get_device_name())
            (folder / name).write_text(text + "\n")
        return text
    folder = recorded_gpu_dir()
    path = None if folder is None else folder / name
    return path.read_text().rstrip("\n") if path is not None and path.exists() else None
