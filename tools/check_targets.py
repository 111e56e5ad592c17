"""Every kernel launch of the package, compiled offline for the GPUs learners have.

    python tools/check_targets.py                   # the table: kernels by architecture
    python tools/check_targets.py --profiles sm86   # some profiles only
    python tools/check_targets.py --launches        # every launch, not one row a kernel
    python tools/check_targets.py --jobs 4          # compiles at once (default: CPUs)

For each device profile (``runtime/device.py``: sm80, sm86, sm89, sm90), a Python under
Triton's interpreter with ``STEPKERNELS_DEVICE_PROFILE`` set runs every public operation over
the shapes and dtypes of ``tools/target_exercises.py``, forward and backward, so that the launch rules
choose as on that GPU. Each kernel launch is recorded (the kernel, its constexprs,
``num_warps``, ``num_stages`` and ``maxnreg``, each argument's dtype and 16-byte alignment
and each integer's specialization) instead of run; an autotuned kernel records every
config its autotuner would time on that GPU. Then each distinct launch is compiled by
Triton for that target (``GPUTarget("cuda", 80, 32)``...) in a Python without the
interpreter, with the ``ptxas`` of Triton's wheel, and its shared memory
(``metadata.shared``) and registers (``cuobjdump``) are held against the target's limits:
the profile's shared memory a program, 255 registers a thread, and registers x threads
within the 64K registers of an SM. Launches whose rule estimates their shared memory
(``ESTIMATES``) must come out at or under the estimate.

Results are kept in ``build/targets/`` by a key of the kernel's source hash (Triton's, with
the functions it calls), signature, constants, options, target and Triton's backend (its
``ptxas``): only launches that changed compile again. Triton compiles for a target the same
way on any machine, so the figures are those this Triton gives on that GPU. Measured on a
2-core machine shared with other work (load 6 to 10), 915 launches: cold, a little over an
hour (915 compiled, four processes at a time, up to 250 s each for attention's backward);
warm, ``pytest tests/test_targets.py`` in 52 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import os
from pathlib import Path
import re
import subprocess
import sys
import tempfile
import time

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "targets"
TARGETS = {"sm80": 80, "sm86": 86, "sm89": 89, "sm90": 90}  # profile -> compute capability
# Module-level values that only let the interpreter run the kernels, and theirs on a GPU:
# waits of 2 polls where programs run one after another (runtime/waiting.py, ops/softmax,
# ops/long_rows and ops/cross_entropy's MAX_POLLS; cross_entropy's in-place WAIT).
GPU_VALUES = {"MAX_POLLS": (2, 100_000), "WAIT": (2, 2**31 - 1)}
KB = 1024
# PTX that only sm_90 runs: tensor-memory copies (TMA) and warp-group products.
HOPPER_INSTRUCTIONS = ("cp.async.bulk.tensor", "wgmma.mma_async")


# -- Recording launches under the interpreter -------------------------------------------


def _specialization(value, specialize=True):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, specialize, True)


def _representative(value):
    """A stand-in for a runtime scalar that Triton specializes the same way (width, 16 |
    value, value == 1), so that launches differing only in sizes record as one."""
    for stand_in in (1, 16, 17, 2**32, 2**32 + 1, 2**63, 2**63 + 1, 1.5, True, False):
        if type(stand_in) is type(value) and all(
            _specialization(stand_in, s) == _specialization(value, s) for s in (True, False)
        ):
            return stand_in
    return value


def _described(value, constexpr: bool):
    """``value``, a kernel argument, as JSON that ``_rebuilt`` turns into a stand-in."""
    import torch
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return {"tensor": dtype, "offset": value.data_ptr() % 16}
    if isinstance(value, TensorDescriptor):
        return {"descriptor": _described(value.base, False), "block": list(value.block_shape),
                "padding": value.padding}  # fmt: skip
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if type(value) is tuple:
        return {"tuple": [_described(v, constexpr) for v in value]}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value if constexpr else _representative(value)
    raise TypeError(
        f"cannot record a launch argument of type {type(value).__name__}: teach "
        "tools/check_targets.py's _described and _rebuilt to stand it in"
    )


def _rebuilt(value):
    """A stand-in for a described argument: what Triton's binder specializes alike."""
    import torch
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        dtype = getattr(torch, value["tensor"])
        storage = torch.empty(64, dtype=torch.uint8)  # 64-byte aligned on the CPU
        return storage[value["offset"] :].view(dtype) if value["offset"] else storage.view(dtype)
    if "descriptor" in value:
        base, block = _rebuilt(value["descriptor"]), value["block"]
        strides = [1]
        for size in reversed(block[1:]):
            strides.insert(0, strides[0] * max(size, 16))
        return TensorDescriptor(base, list(block), strides, list(block), value["padding"])
    if "tl_dtype" in value:
        return getattr(tl, value["tl_dtype"])
    if "tuple" in value:
        return tuple(_rebuilt(v) for v in value["tuple"])
    raise ValueError(f"unknown described argument {value}")


def _constexpr_names(fn) -> set:
    import inspect

    from triton.runtime.jit import _normalize_ty

    annotations = inspect.get_annotations(fn)
    return {name for name, kind in annotations.items() if _normalize_ty(kind) == "constexpr"}


def choose_as_on_a_gpu() -> None:
    """Kernels are recorded, not run: the choices the operations make only so that the
    interpreter can run them are made as on a GPU. Where ``ON_GPU`` or ``INTERPRET`` decides
    (attention's 16 x 16 tiles, layer norm's few programs, cross-entropy's 16-byte groups,
    which read past a tensor's ends, bf16 tiles upcast for the interpreter's ``tl.dot``) and
    the waits' polls (``GPU_VALUES``). What reads the device profile (tiles, stages, SMs,
    features) chooses as on the profile's GPU anyway."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("stepkernels.ops."):
            continue
        for flag, value in (("ON_GPU", True), ("INTERPRET", False)):
            if hasattr(module, flag):
                setattr(module, flag, value)
        for constant, (interpreted, on_gpu) in GPU_VALUES.items():
            if hasattr(module, constant):
                assert getattr(module, constant) == interpreted, f"{name}.{constant} changed"
                setattr(module, constant, on_gpu)


def recorded_launches() -> list[dict]:
    """The distinct launches of the exercises in this Python (under the interpreter, with
    the profile set), each as {"kernel": "module:name", "args": [...], "kwargs": {...}}."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction

    launches = {}

    def keep(self, *args, grid, warmup, **kwargs):
        # Runtime arguments stand in by their specialization; constexprs and options
        # (num_warps...) keep their values.
        runtime = set(self.arg_names) - _constexpr_names(self.fn)
        launch = {
            "kernel": f"{self.fn.__module__}:{self.fn.__qualname__}",
            "args": [_described(a, n not in runtime)
                     for a, n in zip(args, self.arg_names, strict=False)],
            "kwargs": {k: _described(v, k not in runtime) for k, v in sorted(kwargs.items())},
        }  # fmt: skip
        launches.setdefault(json.dumps(launch, sort_keys=True), launch)

    def tune(self, *args, **kwargs):
        """Every config the autotuner would time for these arguments on the GPU."""
        configs = getattr(self.configs, "every", self.configs)
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        if self.early_config_prune:
            configs = self.early_config_prune(configs, self.nargs, **kwargs)
        for config in configs:
            self.fn.run(*args, **{**kwargs, **config.all_kwargs()})
        self.nargs = None

    import stepkernels  # noqa: F401  (every operation's module, to choose as on a GPU)
    import target_exercises  # tools/target_exercises.py: one exercise an operation

    choose_as_on_a_gpu()
    with _patched(InterpretedFunction, "run", keep), _patched(Autotuner, "run", tune):
        target_exercises.run()
    return list(launches.values())


@contextlib.contextmanager
def _patched(owner, name, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def record(profile: str) -> list[dict]:
    """The launches of the exercises as chosen for ``profile``, from a fresh Python."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "STEPKERNELS_DEVICE_PROFILE": profile}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "launches.json"
        command = [sys.executable, __file__, "--record", str(out)]
        _run(command, env)
        return json.loads(out.read_text())


def _run(command, env):
    env = {**env, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{done.stderr[-4000:]}")
    return done


# -- Compiling them for a target, without a GPU -----------------------------------------


def _jit_function(path: str):
    import importlib

    import triton

    module_name, _, name = path.partition(":")
    kernel = importlib.import_module(module_name)
    for part in name.split("."):
        kernel = getattr(kernel, part)
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = getattr(kernel, "kernel", None) or kernel.fn
    return kernel


def _source(launch: dict, capability: int):
    """(Triton's source object, options, key) of a recorded launch for ``capability``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = _jit_function(launch["kernel"])
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    args = [_rebuilt(a) for a in launch["args"]]
    kwargs = {k: _rebuilt(v) for k, v in launch["kwargs"].items()}
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource(jit, signature, constexprs, attrs)
    key = hashlib.sha256(f"{source.hash()}-{backend.hash()}-{options.hash()}".encode()).hexdigest()
    return source, target, options, key


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, local memory a thread in bytes: spills) from ``cuobjdump``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", text)
    return int(found.group(1)), int(found.group(2))


def _compiled(job: tuple) -> dict:
    """Compile one launch (in a worker), or read its result from the cache."""
    launch, capability, estimate = job
    import triton

    started = time.perf_counter()
    source, target, options, key = _source(launch, capability)
    cached = CACHE / f"{key}.json"
    result = json.loads(cached.read_text()) if cached.exists() else {}
    if "error" not in result and "hopper" not in result:  # none, or from before "hopper"
        try:
            compiled = triton.compile(source, target=target, options=options.__dict__)
            registers, spilled = _resources(compiled.asm["cubin"])
            result = {"shared": compiled.metadata.shared, "registers": registers,
                      "spilled": spilled, "num_warps": compiled.metadata.num_warps,
                      "hopper": sorted(i for i in HOPPER_INSTRUCTIONS
                                       if i in compiled.asm["ptx"])}  # fmt: skip
        except Exception as error:  # a launch that does not compile is a finding too
            result = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
        result["seconds"] = round(time.perf_counter() - started, 1)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.part")  # whole, for runs side by side
        partial.write_text(json.dumps(result))
        os.replace(partial, cached)
        result["compiled"] = True
    return {**launch, **result, "key": key, "estimate": estimate}


def _estimate(launch: dict):
    """The shared memory the launch rule expected this launch to take, where it says."""
    rule = ESTIMATES.get(launch["kernel"])
    if rule is None:
        return None
    kwargs = {k: _rebuilt(v) for k, v in launch["kwargs"].items()}
    tensors = [a for a in launch["args"] if isinstance(a, dict)]
    itemsize = _rebuilt(tensors[0]).element_size() if "tensor" in tensors[0] else None
    if "descriptor" in tensors[0]:
        itemsize = _rebuilt(tensors[0]["descriptor"]).element_size()
    return rule(kwargs, itemsize)


def _attention_estimate(kernel: str):
    def estimate(kwargs, itemsize):
        from stepkernels.ops import attention, attention_launches

        launch = attention.Launch(kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs.get("num_warps", 4),
                                  kwargs.get("num_stages", 1))  # fmt: skip
        return attention_launches.shared_bytes(launch, kernel, kwargs["HEAD_DIM"], itemsize)

    return estimate


ESTIMATES = {
    f"stepkernels.ops.attention:attention_{kernel}_kernel": _attention_estimate(kernel)
    for kernel in ("forward", "key_grads", "query_grad")
}


def compile_all(launches: list[dict], profile: str, jobs: int) -> list[dict]:
    """(In a Python without the interpreter, ``profile`` set) every launch compiled."""
    import stepkernels  # noqa: F401  (before forking: each worker inherits the imports)

    capability = TARGETS[profile]
    work = [(launch, capability, _estimate(launch)) for launch in launches]
    if jobs <= 1:
        return [_compiled(job) for job in work]
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return list(pool.map(_compiled, work))


def compile_launches(launches: list[dict], profile: str, jobs: int) -> list[dict]:
    """``launches`` compiled for ``profile``'s GPU, from a fresh Python without the
    interpreter (and with ``profile`` set, as module-level choices read it)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "STEPKERNELS_DEVICE_PROFILE": profile}
    with tempfile.TemporaryDirectory() as folder:
        job_file, out = Path(folder) / "launches.json", Path(folder) / "results.json"
        job_file.write_text(json.dumps(launches))
        env["TRITON_CACHE_DIR"] = str(Path(folder) / "triton")  # ours is in build/targets
        _run([sys.executable, __file__, "--compile", profile, str(job_file), str(out),
              "--jobs", str(jobs)], env)  # fmt: skip
        return json.loads(out.read_text())


# -- Holding them against the limits ----------------------------------------------------


def problems(result: dict, profile: str) -> list[str]:
    """What is wrong with a compiled launch on ``profile``'s GPU (nothing: [])."""
    from stepkernels.runtime.device import PROFILES

    if "error" in result:
        return [f"does not compile: {result['error'][:300]}"]
    limits, found = PROFILES[profile], []
    threads = 32 * result["num_warps"]
    if result["shared"] > limits.shared_memory:
        found.append(f"shared memory {result['shared']} B > {limits.shared_memory} B")
    if result["registers"] > limits.max_registers_per_thread:
        found.append(f"{result['registers']} registers a thread > 255")
    if result["registers"] * threads > limits.registers:
        found.append(f"{result['registers']} registers x {threads} threads > 64K")
    if TARGETS[profile] < 90 and result.get("hopper"):
        found.append(f"sm_90 instructions on sm_{TARGETS[profile]}: {', '.join(result['hopper'])}")
    if result["estimate"] is not None and result["shared"] > result["estimate"]:
        found.append(f"shared memory {result['shared']} B > the rule's estimate "
                     f"{result['estimate']} B")  # fmt: skip
    return found


def check(profiles=tuple(TARGETS), jobs: int | None = None) -> dict[str, list[dict]]:
    """Every launch of the exercises, recorded and compiled for each profile's GPU: the
    profiles side by side, their compiles shared among ``jobs`` processes (default: one a
    CPU)."""
    each = max(1, (jobs or os.cpu_count() or 1) // len(profiles))
    with concurrent.futures.ThreadPoolExecutor(len(profiles)) as pool:
        done = pool.map(lambda p: compile_launches(record(p), p, each), profiles)
        return dict(zip(profiles, done, strict=True))


def package_kernels() -> set[str]:
    """Every kernel of the package's operations and runtime ("module:name"): the Triton
    functions whose names end in ``_kernel``, Triton's convention for what a grid launches
    (device functions are called from kernels, and compiled with them)."""
    import importlib
    import inspect
    import pkgutil

    import stepkernels

    found = set()
    for wing in ("ops", "runtime"):
        package = importlib.import_module(f"stepkernels.{wing}")
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for value in vars(module).values():
                for _ in range(4):  # lean, heuristics and autotuners wrap the function
                    if inspect.isfunction(value):
                        break
                    value = getattr(value, "kernel", None) or getattr(value, "fn", None)
                kernel = inspect.isfunction(value) and value.__name__.endswith("_kernel")
                if kernel and value.__module__ == module.__name__:
                    found.add(f"{value.__module__}:{value.__qualname__}")
    assert stepkernels  # imported first: it chooses the interpreter where there is no GPU
    return found


def kernel_name(result: dict) -> str:
    return result["kernel"].rpartition(":")[2]


def launch_summary(result: dict) -> str:
    constants = {k: v for k, v in result["kwargs"].items() if not isinstance(v, dict)}
    dtypes = sorted({a.get("tensor") or a.get("descriptor", {}).get("tensor")
                     for a in result["args"] if isinstance(a, dict)} - {None})  # fmt: skip
    text = ", ".join(f"{k}={v}" for k, v in constants.items())
    return f"{kernel_name(result)}({'/'.join(dtypes)}; {text})"


def table(results: dict[str, list[dict]]) -> str:
    """Kernels by architecture: the most shared memory (KB) and registers of any launch,
    and how many launches spill, per target."""
    profiles = list(results)
    kernels = sorted({kernel_name(r) for rs in results.values() for r in rs})
    header = ["kernel", *[f"{p} ({TARGETS[p] // 10}.{TARGETS[p] % 10})" for p in profiles]]
    rows = []
    for kernel in kernels:
        row = [kernel]
        for profile in profiles:
            mine = [r for r in results[profile] if kernel_name(r) == kernel]
            good = [r for r in mine if "error" not in r]
            if not mine:
                row.append("-")
                continue
            shared = max(r["shared"] for r in good) / KB if good else 0
            registers = max(r["registers"] for r in good) if good else 0
            spills = sum(r["spilled"] > 0 for r in good)
            bad = sum(bool(problems(r, profile)) for r in mine)
            cell = f"{len(mine)}: {shared:.0f} KB, {registers} reg"
            cell += f", {spills} spill" if spills else ""
            cell += f", {bad} OVER" if bad else ""
            row.append(cell)
        rows.append(row)
    limits = ["limits", *[_limits(p) for p in profiles]]
    widths = [max(len(str(r[i])) for r in [header, limits, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows), line(limits)])


def _limits(profile: str) -> str:
    from stepkernels.runtime.device import PROFILES

    device = PROFILES[profile]
    return f"{device.shared_memory // KB} KB, 255 reg ({device.examples})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--launches", action="store_true", help="one line a launch")
    parser.add_argument("--record", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--compile", nargs=3, metavar=("PROFILE", "IN", "OUT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.record:  # a worker: this Python interprets, with the profile set
        Path(args.record).write_text(json.dumps(recorded_launches()))
        return
    if args.compile:
        profile, job_file, out = args.compile
        results = compile_all(json.loads(Path(job_file).read_text()), profile, args.jobs or 1)
        Path(out).write_text(json.dumps(results))
        return
    started = time.perf_counter()
    results = check(tuple(args.profiles), args.jobs)
    compiled = sum(r.get("compiled", False) for rs in results.values() for r in rs)
    print(table(results))
    print(f"\nEach cell: launches, then the most shared memory and registers a thread of any "
          f"of them, and how many spill (local memory) or break a limit. "
          f"{sum(map(len, results.values()))} launches; "
          f"{compiled} compiled now, the rest from {CACHE.relative_to(ROOT)}; "
          f"{time.perf_counter() - started:.0f} s.")  # fmt: skip
    for profile, profile_results in results.items():
        for result in profile_results:
            found = problems(result, profile)
            if found or args.launches:
                status = "; ".join(found) if found else "ok"
                shared = result.get("shared", "?")
                print(f"{profile} {launch_summary(result)}: {shared} B, "
                      f"{result.get('registers', '?')} reg, {status}")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's package, as in the workers
    if "--record" in sys.argv:
        os.environ["TRITON_INTERPRET"] = "1"
    main()
