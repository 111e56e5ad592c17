r"""The plumbing every chapter shares: where kernels run, problem sizes, input checks,
timing, plots, and the GPU results recorded in ``results/``.

Import it before ``triton``. Without a GPU it turns on Triton's interpreter, and Triton
reads that setting when it is imported.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# torch.compile's Inductor compiles kernels in a pool of worker processes, which it starts
# afresh after each compilation; while they start they take every CPU core for seconds, and a
# GPU timing taken meanwhile measures a starved CPU. One thread: compile in this process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

# ----------------------------------------------------------------------- where kernels run
HAS_GPU = torch.cuda.is_available()
if not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise ImportError(
            "No GPU here, so Triton must run under its interpreter, which has to be chosen "
            "before triton is imported: import kit before triton, or set TRITON_INTERPRET=1."
        )
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = HAS_GPU and not INTERPRET
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Streaming multiprocessors, for sizing persistent grids; None under the interpreter.
SM_COUNT = (
    torch.cuda.get_device_properties(DEVICE).multi_processor_count if ON_GPU else None
)

import triton  # noqa: E402  (after the interpreter switch above)
import triton.language as tl  # noqa: E402

RESULTS_DIR = Path(
    os.environ.get("KIT_RESULTS", Path(__file__).resolve().parent.parent / "results")
)


def announce() -> None:
    """Print one line saying where this chapter's kernels run."""
    if ON_GPU:
        print(
            f"Running on {torch.cuda.get_device_name()} with torch {torch.__version__} "
            f"and triton {triton.__version__}: full problem sizes, live timings."
        )
    else:
        print(
            "No GPU in use: kernels run under Triton's interpreter on the CPU at reduced size; "
            "the plots show results recorded on a GPU, never interpreter timings."
        )


def choose(gpu, cpu):
    """The full-size value on a GPU, the small one under the interpreter."""
    return gpu if ON_GPU else cpu


def autotune_configs(configs: list) -> list:
    """All configs on a GPU; the first alone under the interpreter, which cannot time kernels."""
    return list(configs) if ON_GPU else list(configs)[:1]


def check_tensor(tensor, name: str, dtypes=None, contiguous: bool = True) -> None:
    """Reject an input the kernels cannot take, saying what to do instead."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != DEVICE.type:
        raise ValueError(
            f"{name} is on {tensor.device}, but kernels here run on {DEVICE.type}: "
            f"move it with {name}.to('{DEVICE.type}')"
        )
    if dtypes is not None and tensor.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; supported: {names}. Convert with {name}.to(...)"
        )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (strides {tuple(tensor.stride())}): pass {name}.contiguous()"
        )


def show_refusals(function_name: str, bad_calls: dict) -> None:
    """Make each call in ``bad_calls`` (case name -> call) and print the error it raises.

    A call that raises no TypeError or ValueError means bad input was accepted: an error.
    """
    width = max(map(len, bad_calls))
    for case, call in bad_calls.items():
        try:
            call()
        except (TypeError, ValueError) as error:
            print(f"{case:>{width}}: {error}")
        else:
            raise AssertionError(f"{function_name} accepted bad input: {case}")


# ----------------------------------------------------------------------- chapters as modules
_quiet_loads = 0


def load_chapter(number: str, quiet: bool = True):
    """Import chapter ``number`` ("04") as a module, to reuse its kernels and wrappers.

    The chapter runs top to bottom. With ``quiet`` its benchmarks are skipped, so are the
    checks it guards with ``loaded_by_another_chapter()``, and what it prints or draws is
    dropped, so that a chapter building on another shows only its own output.
    """
    name = f"chapter_{number}"
    if name in sys.modules:
        return sys.modules[name]
    found = sorted(Path(__file__).resolve().parent.glob(f"{number}-*.py"))
    if not found:
        raise FileNotFoundError(
            f"Chapter {number} builds on chapter {number}'s script, {number}-*.py, which must sit "
            f"beside kit.py ({Path(__file__).resolve().parent}): download it from the gallery."
        )
    spec = importlib.util.spec_from_file_location(name, found[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    global _quiet_loads
    figures_before = _open_figures()
    _quiet_loads += quiet
    try:
        with contextlib.redirect_stdout(io.StringIO() if quiet else sys.stdout):
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        _quiet_loads -= quiet
    if quiet:
        import matplotlib.pyplot as plt

        for figure in _open_figures() - figures_before:
            plt.close(figure)
    return module


def loaded_by_another_chapter() -> bool:
    """True while a quiet ``load_chapter`` runs this chapter for another one. A chapter may
    then skip its slow checks: they ran when it ran itself, and on a GPU they compile dozens
    of kernel variants (chapter 04's take over three minutes)."""
    return _quiet_loads > 0


def _open_figures() -> set:
    if "matplotlib.pyplot" not in sys.modules:
        return set()
    return set(sys.modules["matplotlib.pyplot"].get_fignums())


# ----------------------------------------------------------------------- shared device functions
# The activations that chapters fuse into their kernels (matmul epilogues, the fused dropout
# layer), with their derivatives for the backward. Both take and return fp32. ACTIVATION is a
# compile-time string: each choice compiles to its own kernel, so the branches cost nothing.
ACTIVATIONS = (None, "relu", "leaky_relu", "gelu", "squared_relu")


@triton.jit
def apply_activation(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        return tl.maximum(z, 0.0)
    elif ACTIVATION == "leaky_relu":  # slope 0.01, torch's default
        return tl.where(z > 0, z, 0.01 * z)
    elif ACTIVATION == "gelu":  # the exact form, z * Phi(z), as torch's default
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACTIVATION == "squared_relu":
        relu = tl.maximum(z, 0.0)
        return relu * relu
    else:
        return z


@triton.jit
def activation_derivative(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        return tl.where(z > 0, 1.0, 0.0)
    elif ACTIVATION == "leaky_relu":
        return tl.where(z > 0, 1.0, 0.01)
    elif ACTIVATION == "gelu":  # Phi(z) + z * phi(z)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        return cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACTIVATION == "squared_relu":
        return 2.0 * tl.maximum(z, 0.0)
    else:
        return tl.full(z.shape, 1.0, tl.float32)


def activation_reference(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The same activation in PyTorch, to check kernels against and to benchmark."""
    if activation is None:
        return z
    if activation == "squared_relu":
        return torch.relu(z).square()
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation {activation!r} unknown; choose one of {ACTIVATIONS}"
        )
    return getattr(torch.nn.functional, activation)(z)


# ----------------------------------------------------------------------- pictures
def draw_programs(n_elements: int, block_size: int) -> None:
    """Draw a vector cut into blocks, one program each, with the masked-off tail hatched."""
    import matplotlib.pyplot as plt

    n_programs = -(-n_elements // block_size)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(0.42 * n_programs * block_size + 1, 1.9))
    for index in range(n_programs * block_size):
        program, in_bounds = index // block_size, index < n_elements
        face = colors(program % 10) if in_bounds else "white"
        ax.add_patch(
            plt.Rectangle(
                (index, 0),
                0.94,
                1,
                facecolor=face,
                alpha=0.75,
                edgecolor="0.4",
                hatch=None if in_bounds else "//",
            )
        )
        ax.text(index + 0.47, 0.5, str(index), ha="center", va="center", fontsize=8)
    for program in range(n_programs):
        ax.text(
            (program + 0.5) * block_size,
            1.25,
            f"program_id = {program}",
            ha="center",
            fontsize=9,
        )
    ax.text(
        n_elements, -0.35, "masked off: offsets >= n_elements", fontsize=8, color="0.3"
    )
    ax.set(xlim=(-0.3, n_programs * block_size + 0.3), ylim=(-0.6, 1.6))
    ax.axis("off")
    ax.set_title(
        f"n_elements = {n_elements}, BLOCK_SIZE = {block_size}: "
        f"grid = cdiv({n_elements}, {block_size}) = {n_programs} programs",
        fontsize=9,
    )
    fig.tight_layout()


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


@dataclass
class Point:
    provider: str
    dtype: str
    x: float
    value: float
    low: float | None = None
    high: float | None = None


UNIT_SCALE = {"GB/s": 1e9, "TFLOP/s": 1e12}
# A benchmark in this unit times the CPU side of each call (``cpu_us``) instead of the GPU.
CPU_UNIT = "µs of CPU per call"
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


def provider_colors(providers: list) -> dict:
    """A distinct color for each provider: the fixed ones above, then OTHER_COLORS in turn."""
    taken = {STYLE[p] for p in providers if p in STYLE}
    others = iter([color for color in OTHER_COLORS if color not in taken])
    return {p: STYLE[p] if p in STYLE else next(others, None) for p in providers}


_limits: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def compile_static(fn: Callable) -> Callable:
    """A fresh ``torch.compile`` of ``fn`` for static shapes, to benchmark one shape.

    Resetting dynamo first keeps each shape's compilation separate: without it, the ninth
    shape would hit dynamo's recompilation limit and silently run eager PyTorch instead.
    """
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


@contextlib.contextmanager
def side_stream():
    """Make a new stream current, after the work queued so far. CUDA graphs cannot capture
    the default stream, so whatever is to be captured runs on one of these."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield side


def capture(fn: Callable) -> torch.cuda.CUDAGraph:
    """``fn``'s GPU work recorded as a CUDA graph, replayed without Python (see How we measure).

    Compilation, autotuning and autograd's first-call set-up must not happen while capturing,
    so ``fn`` first runs a few times on a side stream, as PyTorch's CUDA-graph notes ask.
    """
    fn()
    with side_stream() as side:
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        fn()
    return graph


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


def cpu_us(fn: Callable, calls: int = 200) -> float:
    """CPU time of one call of ``fn`` in µs: Python, launchers, autograd; GPU drained first."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


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


TIMING = "GPU time of CUDA-graph replays (do_bench, L2 flushed)"


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
            "KIT_COMMAND", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
        ),
        "limits": hardware_limits(),
        "timing": TIMING,
    }


def gpu_slug(gpu_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def make_call(bench: Benchmark, provider: str, x, dtype) -> Callable:
    """The call to time: ``bench.make``'s, or for ``COPY_PROVIDER`` a copy of the bytes that
    ``bench.work`` counts, so that a benchmark gets its size's reference by listing it."""
    if provider == COPY_PROVIDER:
        return copy_of(int(bench.work(x, dtype)))
    return bench.make(provider, x, dtype)


def measure(bench: Benchmark) -> list[Point]:
    # Inputs, warm-up and capture all on one side stream: autograd runs a backward on the
    # stream of its forward, so a forward made here is captured with its backward.
    with side_stream():
        return measure_on_stream(bench)


def measure_on_stream(bench: Benchmark) -> list[Point]:
    points = []
    for dtype in bench.dtypes:
        for x in bench.x_values:
            for provider in bench.providers:
                if bench.unit == CPU_UNIT:
                    us = cpu_us(make_call(bench, provider, x, dtype))
                    points.append(Point(provider, dtype_name(dtype), x, us))
                    continue
                try:
                    ms, q20, q80 = measure_ms(make_call(bench, provider, x, dtype))
                except torch.OutOfMemoryError:
                    print(
                        f"  {provider} at {bench.x_name}={x}: out of GPU memory, skipped"
                    )
                    continue
                except RuntimeError as error:  # a call a CUDA graph cannot capture
                    print(f"  {provider} at {bench.x_name}={x}: skipped, {error}")
                    continue
                finally:
                    torch.cuda.empty_cache()
                work = bench.work(x, dtype)
                value, low, high = (
                    per_time(work, t, bench.unit) for t in (ms, q80, q20)
                )
                points.append(Point(provider, dtype_name(dtype), x, value, low, high))
    return points


def record(
    bench: Benchmark, points: list[Point], env: dict, results_dir: Path | None = None
) -> Path:
    """Write the points as results/<gpu>/<benchmark>.csv and note the environment they ran in."""
    folder = (results_dir or RESULTS_DIR) / gpu_slug(env["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{bench.name}.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(
            ["benchmark", "provider", "dtype", "x_name", "x", "value", "unit"]
        )
        for p in points:
            writer.writerow(
                [
                    bench.name,
                    p.provider,
                    p.dtype,
                    bench.x_name,
                    p.x,
                    f"{p.value:.6g}",
                    bench.unit,
                ]
            )
    env_path = folder / "environment.json"
    recorded = json.loads(env_path.read_text()) if env_path.exists() else {}
    benchmarks = {**recorded.get("benchmarks", {}), bench.name: env}
    env_path.write_text(
        json.dumps({**env, "benchmarks": dict(sorted(benchmarks.items()))}, indent=1)
        + "\n"
    )
    return path


def recorded_gpu_dir(results_dir: Path | None = None) -> Path | None:
    """The results folder to show without a GPU: $KIT_RESULTS_GPU, else the newest recording."""
    folders = [
        p.parent for p in (results_dir or RESULTS_DIR).glob("*/environment.json")
    ]
    wanted = os.environ.get("KIT_RESULTS_GPU")
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
    with path.open() as f:
        return [
            Point(r["provider"], r["dtype"], float(r["x"]), float(r["value"]))
            for r in csv.DictReader(f)
        ]


def smoke(bench: Benchmark) -> None:
    """Under the interpreter: call every provider once at a small size, so the code runs."""
    for dtype in bench.dtypes:
        for provider in bench.providers:
            if (
                provider != "torch.compile"
            ):  # compiles C++ on a CPU: slow, and says nothing here
                make_call(bench, provider, bench.smoke_x, dtype)()


def describe(env: dict) -> str:
    return (
        f"{env['gpu']}, {env['date']} (driver {env['driver']}, CUDA {env['cuda']}, "
        f"torch {env['torch']}, triton {env['triton']})"
    )


def plot(bench: Benchmark, points: list[Point], env: dict, live: bool):
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(p.dtype for p in points))
    fig, axes = plt.subplots(
        1, len(dtypes), figsize=(6.2 * len(dtypes), 4.2), squeeze=False, sharey=True
    )
    limit = env["limits"].get(bench.unit)  # None: no hardware line (CPU time)
    # A recording may hold providers this machine cannot run (a library not installed here).
    providers = list(dict.fromkeys([*bench.providers, *(p.provider for p in points)]))
    colors = provider_colors(providers)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        for provider in providers:
            mine = sorted(
                (p for p in points if p.provider == provider and p.dtype == dtype),
                key=lambda p: p.x,
            )
            if not mine:
                continue
            xs = [p.x for p in mine]
            ax.plot(
                xs,
                [p.value for p in mine],
                marker="o",
                ms=3,
                label=provider,
                color=colors[provider],
            )
            if live and mine[0].low is not None:
                ax.fill_between(
                    xs,
                    [p.low for p in mine],
                    [p.high for p in mine],
                    alpha=0.2,
                    color=colors[provider],
                )
        if limit is not None:
            ax.axhline(limit, ls="--", lw=1, color="0.35")
            ax.annotate(
                f"{LIMIT_NAME[bench.unit]} {limit:,.0f} {bench.unit} (measured)",
                (0.01, limit),
                xycoords=("axes fraction", "data"),
                va="bottom",
                fontsize=8,
                color="0.35",
            )
        if bench.x_log2:
            ax.set_xscale("log", base=2)
        ax.set(
            title=dtype,
            xlabel=bench.x_name,
            ylim=(0, 1.12 * max(limit or 0, *(p.value for p in points))),
        )
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[0][0].set_ylabel(bench.unit)
    how = "measured now" if live else "recorded"
    title = f"{bench.name}: {how} on {describe(env)}"
    fig.suptitle(textwrap.fill(title, 80 * len(dtypes)), fontsize=9)
    fig.tight_layout()
    return fig


def summarize(bench: Benchmark, points: list[Point], env: dict) -> None:
    """Print each provider's rate at the headline size and its share of the hardware limit."""
    if bench.headline_x is None:
        return
    limit = env["limits"].get(bench.unit)
    for dtype in dict.fromkeys(p.dtype for p in points):
        print(f"{bench.name}, {dtype}, {bench.x_name} = {bench.headline_x:,}:")
        for p in points:
            if p.dtype == dtype and p.x == bench.headline_x:
                share = (
                    "" if limit is None else f"{p.value / limit:6.1%} of {limit:,.0f}"
                )
                print(f"  {p.provider:<14} {p.value:>9,.1f} {bench.unit}  {share}")


def run(bench: Benchmark) -> None:
    """Measure (GPU) or show the recording (no GPU), draw the plot and print the summary.

    With KIT_RECORD=1 (``make bench``) the measurement is also written to results/; with
    KIT_ONLY set to benchmark names, separated by commas, a GPU measures only those. Inside
    a quiet ``load_chapter`` it does nothing.
    """
    if _quiet_loads:
        return
    only = os.environ.get("KIT_ONLY")  # make bench ONLY=name,name: measure just these
    if ON_GPU and only and bench.name not in only.split(","):
        print(f"{bench.name}: not measured (KIT_ONLY={only})")
        return
    if ON_GPU:
        points, env = measure(bench), environment()
        if os.environ.get("KIT_RECORD") == "1":
            print(f"recorded {record(bench, points, env)}")
    else:
        smoke(bench)
        found = load_recorded(bench.name)
        if found is None:
            where = f"{bench.name!r} under {RESULTS_DIR}"
            print(f"No recorded GPU results for {where}: run `make bench` on a GPU.")
            return
        points, env = found
    plot(bench, points, env, live=ON_GPU)
    summarize(bench, points, env)
