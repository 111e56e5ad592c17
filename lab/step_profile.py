"""Where one training step's time goes: kernels by total time, launches, step time (GPU).

One training step of chapter 12's GPT, as ``python -m stepkernels.train`` runs it (the same
``Trainer``: autocast, gradient clipping, the optimizer it makes), for PyTorch's layers and
ours, eager and replayed from a CUDA graph, under ``torch.profiler``. For each provider and
shape it prints the step's time (timed outside the profiler, the GPU synchronized), the
kernels the GPU ran a step, the launch calls the CPU made a step (a replayed graph is one), and
the 25 kernel groups (kernels of one name) that take the most GPU time, with how many of each
run a step and their share of the step. It writes the same table as a CSV, a row per kernel
group per provider and shape, plus an "(other kernels)" row; chapter 15 shows it.

    python lab/step_profile.py                              # the Shakespeare model
    python lab/step_profile.py --shape shakespeare --shape gpt2-small
    python lab/step_profile.py --shape toy --csv /tmp/profile.csv   # a CPU: checks the script
    python lab/step_profile.py --ablate      # also ours replayed without each fusion of ch. 15

``--ablate`` adds three providers: ours replayed from a CUDA graph with PyTorch's fused AdamW
instead of ``FusedAdamW``, and with the residual addition apart from the norm (PyTorch's
addition, then chapter 03's ``layer_norm``) instead of ``add_layer_norm``: what each fusion
gives the whole step; and ours keeping the MLP's pre-activation from the forward instead of
recomputing it in the backward (as PyTorch's layers keep it; no change without dropout's
fused path, so Shakespeare's dropout layers are as before): what the recompute costs.

Shapes: ``shakespeare`` (nanoGPT's: 6 layers, 6 heads, 384 wide, context 256, batch 64),
``gpt2-small`` (12 layers, 12 heads, 768 wide, context 1,024, batch 8), ``toy`` (1 layer of 16,
for the interpreter). The CSV goes by default to the GPU's results folder
(``src/stepkernels/results/<gpu>/training-step-profile.csv``), beside the recorded benchmarks.

Without a GPU the kernels run under Triton's interpreter, which the profiler does not see:
the table then lists the CPU operators of PyTorch (not kernels) and only eager steps run.
``tests/test_step_profile.py`` runs it so at the toy size. Interpreter timings are never results.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
import contextlib
import csv
import dataclasses
import gc
from pathlib import Path
import sys
import time

from stepkernels.lessons import bench
from stepkernels.models import gpt, train
from stepkernels.models.config import preset
from stepkernels.models.data import load_shakespeare
from stepkernels.runtime.core import ON_GPU
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

SHAPES = {
    "shakespeare": dict(preset="shakespeare", changes={}),
    "gpt2-small": dict(preset="gpt2-small", changes=dict(batch_size=8, grad_accum=1)),
    "toy": dict(
        preset="tiny",
        changes=dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=2),
    ),
}
PROVIDERS = {  # name: (use_triton, step)
    "torch": (False, "eager"),
    "torch + CUDA graph": (False, "graph"),
    "triton": (True, "eager"),
    "triton + CUDA graph": (True, "graph"),
}
# Ours replayed without one of chapter 15's fusions, or keeping the pre-activation
# (--ablate): provider -> what is changed.
ABLATIONS = {
    "triton + CUDA graph, PyTorch's AdamW": "adamw",
    "triton + CUDA graph, add then norm": "add_norm",
    "triton + CUDA graph, pre-activation kept": "keep_z",
}
TOP = 25
# The CPU's calls that start work on the GPU (a replayed graph is one call).
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)
FIELDS = [
    "shape",
    "provider",
    "device",
    "rank",
    "kernel",
    "count_per_step",
    "us_per_step",
    "share_of_step",
    "step_ms",
    "tokens_per_s",
    "kernels_per_step",
    "launch_calls_per_step",
]


def config_of(shape: str, use_triton: bool, step: str):
    chosen = SHAPES[shape]
    quiet = dict(out_dir="", checkpoint=False, eval_interval=0, sample_tokens=0)
    quiet.update(max_steps=10_000)
    dtype = "bfloat16" if ON_GPU else "float32"
    return preset(
        chosen["preset"],
        **chosen["changes"],
        **quiet,
        use_triton=use_triton,
        step=step,
        dtype=dtype,
    )


def synchronize():
    if ON_GPU:
        torch.cuda.synchronize()


def step_ms(trainer, steps: int) -> float:
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.run_step()
    synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def kernel_events(prof):
    """(name, µs) of every GPU kernel, copy and fill; on a CPU, of every top-level operator."""
    events = prof.events()
    if ON_GPU:
        return [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA]
    return [(e.name, e.time_range.elapsed_us()) for e in events if e.cpu_parent is None and e.name.startswith("aten::")]


def launch_calls(prof) -> int:
    return sum(1 for e in prof.events() if e.name in LAUNCH_CALLS)


class AddThenNorm(gpt.TritonLayers):
    """Our layers with the residual addition apart: PyTorch's addition, then our norm."""

    def add_norm(self, x, residual, norm):
        x = x if residual is None else x + residual
        return x, self.norm(x, norm)


class KeptPreactivation(gpt.TritonLayers):
    """Our layers with the MLP's pre-activation kept from the forward (chapter 05's
    ``recompute=False``: one product a layer fewer, 4C values a token more held), as
    PyTorch's layers keep it. Dropout's path (p > 0) is unchanged."""

    def linear(self, x, layer, activation=None, p=0.0, seed=None):
        bias = getattr(layer, "bias", None)
        if activation is None or (p > 0 and bias is not None):
            return super().linear(x, layer, activation, p, seed)
        dtype = gpt.compute_dtype(x)
        weight = self.cast(layer.weight, dtype)
        bias = None if bias is None else self.cast(bias, dtype)
        return gpt.linear(x.to(dtype), weight, bias, activation, recompute=False)


SWAPPED = {"add_norm": AddThenNorm, "keep_z": KeptPreactivation}


@contextlib.contextmanager
def undone(fusion: str | None):
    """The GPT's layers changed while inside: without the add + norm fusion ("add_norm"),
    or keeping the MLP's pre-activation ("keep_z")."""
    if fusion not in SWAPPED:
        yield
        return
    original, gpt.TritonLayers = gpt.TritonLayers, SWAPPED[fusion]
    try:
        yield
    finally:
        gpt.TritonLayers = original


def make_trainer(shape, provider, data):
    fusion = ABLATIONS.get(provider)
    use_triton, step = PROVIDERS[provider] if fusion is None else (True, "graph")
    cfg = config_of(shape, use_triton, step)
    trainer = train.Trainer(cfg, data)
    if fusion == "adamw":  # PyTorch's fused AdamW, as its layers train with
        torch_cfg = dataclasses.replace(cfg, use_triton=False)
        trainer.optimizer = train.make_optimizer(trainer.model, torch_cfg)
    return trainer


def profile_provider(shape, provider, data, warmup, timed, profiled):
    """Rows of the table for one provider at one shape."""
    with undone(ABLATIONS.get(provider)):
        return profile_trainer(shape, provider, data, warmup, timed, profiled)


def profile_trainer(shape, provider, data, warmup, timed, profiled):
    trainer = make_trainer(shape, provider, data)
    for _ in range(warmup):  # compiles, autotunes; the graph is recorded at the 4th step
        trainer.run_step()
    ms = step_ms(trainer, timed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            trainer.run_step()
        synchronize()
    groups = defaultdict(lambda: [0, 0.0])  # name: [count, µs]
    events = kernel_events(prof)
    for name, us in events:
        groups[name][0] += 1
        groups[name][1] += us
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])
    top, rest = ranked[:TOP], ranked[TOP:]
    if rest:
        top.append(
            (
                f"(the others: {len(rest)} names)",
                [sum(c for _, (c, _) in rest), sum(u for _, (_, u) in rest)],
            )
        )
    if not top:  # a profiler that sees no kernels of a graph's replays, say: say so
        top = [("(no kernel events recorded)", [0, 0.0])]
    cfg = trainer.cfg
    common = dict(
        shape=shape,
        provider=provider,
        device=torch.cuda.get_device_name() if ON_GPU else "CPU (interpreter)",
        step_ms=round(ms, 4),
        tokens_per_s=round(cfg.batch_size * cfg.block_size / ms * 1e3),
        kernels_per_step=round(len(events) / profiled, 2),
        launch_calls_per_step=round(launch_calls(prof) / profiled, 2),
    )
    rows = [
        dict(
            common,
            rank=rank,
            kernel=name,
            count_per_step=round(count / profiled, 2),
            us_per_step=round(us / profiled, 2),
            share_of_step=round(us / profiled / (ms * 1e3), 5),
        )
        for rank, (name, (count, us)) in enumerate(top, start=1)
    ]
    del trainer
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
    return rows


def print_table(rows):
    head = rows[0]
    print(
        f"\n{head['provider']}, {head['shape']} on {head['device']}: "
        f"{head['step_ms']:.3f} ms a step ({head['tokens_per_s']:,} tokens/s), "
        f"{head['kernels_per_step']:.0f} kernels and "
        f"{head['launch_calls_per_step']:.0f} launch calls a step"
    )
    kind = "kernel" if ON_GPU else "CPU operator (no GPU: not kernels)"
    print(f"  {'share':>6} {'µs/step':>9} {'count':>6}  {kind}")
    for r in rows:
        print(f"  {r['share_of_step']:6.1%} {r['us_per_step']:9.1f} {r['count_per_step']:6.1f}  {r['kernel'][:100]}")


def default_csv() -> Path:
    if not ON_GPU:
        raise SystemExit("no GPU: give --csv PATH (nothing goes to the results folder)")
    folder = bench.gpu_results_dir(torch.cuda.get_device_name())
    return folder / "training-step-profile.csv"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=list(SHAPES))
    parser.add_argument("--provider", action="append", choices=list(PROVIDERS))
    parser.add_argument("--warmup", type=int, default=10 if ON_GPU else 0)
    parser.add_argument("--timed", type=int, default=50 if ON_GPU else 1)
    parser.add_argument("--profiled", type=int, default=5 if ON_GPU else 1)
    parser.add_argument("--csv", type=Path, help="where the table goes")
    parser.add_argument("--ablate", action="store_true", help="also ours without each fusion (a GPU)")
    args = parser.parse_args(argv)
    shapes = args.shape or ["shakespeare"]
    providers = args.provider or [p for p, (_, step) in PROVIDERS.items() if ON_GPU or step == "eager"]
    if not ON_GPU and (args.ablate or any(PROVIDERS[p][1] == "graph" for p in providers)):
        parser.error("--provider, --ablate: CUDA graphs need a GPU")
    providers += list(ABLATIONS) if args.ablate else []
    path = args.csv or default_csv()
    data = load_shakespeare()
    rows = []
    for shape in shapes:
        for provider in providers:
            found = profile_provider(shape, provider, data, args.warmup, args.timed, args.profiled)
            print_table(found)
            rows += found
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
