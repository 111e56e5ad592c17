"""Training on two GPUs: GPT-2 small's shape on 1 and 2 GPUs, through the command itself.

Run on a machine with 2 GPUs from the repository root (``PYTHONPATH=src``, data prepared by
``make data`` or ``$STEPKERNELS_DATA``)::

    python lab/data_parallel.py [--steps 300] [--out runs/data-parallel] [--record]

Every run has the same global batch (32 sequences of 1,024 tokens a step), seed and schedule,
``--config gpt2-small`` in bf16 on our kernels:

* ``1 GPU, grad-accum 2``: one process, two micro-batches of 16 a step, eager;
* ``1 GPU, grad-accum 2, CUDA graph``: the same, the whole step replayed from a CUDA graph;
* ``2 GPUs, DDP`` and ``2 GPUs, FSDP2``: ``torchrun --nproc-per-node 2``, 16 sequences a GPU,
  the step eager (the command does not record a graph across processes);
* ``2 GPUs, DDP, resumed on 1 GPU``: DDP's checkpoint continued for 50 steps on one GPU;
* ``2 GPUs, DDP, torch.compile`` (``--compiled``, run after the others, into the same
  ``--out``): DDP with the step compiled in each process; a failure leaves it out.

Each run writes its ``log.jsonl`` (and a checkpoint) into ``--out/<run>/``; the script prints
each command, then a table: tokens/s once warm, MFU, peak memory of rank 0, and the
validation loss at the end. ``--record`` writes ``gpt-data-parallel.csv`` (tokens/s by run)
and ``gpt-data-parallel-loss.csv`` (validation loss by tokens seen, by run) into
``src/stepkernels/results/<gpu>/``, which chapter 12 shows. ``--smoke``: the same runs of
the tiny preset on the CPU (gloo, Triton's interpreter), to check the script; it records
nothing.

``--tunings ddp|fsdp|all`` measures the wrappers' tunings (``distributed.TUNINGS``; issue
44: DDP at 1.63x one GPU against a target of 1.85x, FSDP2 at 0.37x DDP against 0.9x) one at a
time, through ``STEPKERNELS_PARALLEL_TUNING``, into ``--out``/tunings/: the one-GPU eager
run (the ratio's reference, measured in the same session), then for DDP and FSDP2 each with
every tuning off (``none``, the recorded runs' wrappers), all on (``default``), and all on
but one (``default,-NAME``), and FSDP2 with every block kept gathered (``keep-gathered``).
It prints a table with each run's tokens/s against the one-GPU run, against the kind's
``none`` and against its ``default``; it records nothing (one session's A/B, read as
such). The commands for the next session on an nvidia-h200-x2 (two H200s, NV18), from the
repository root, ~20 minutes of device time for ``all`` at --steps 150::

    make data || true   # or STEPKERNELS_DATA pointing at prepared data
    PYTHONPATH=src timeout 580 python lab/data_parallel.py --tunings ddp --steps 150 \
        --time-limit-s 60 --out runs/dp 2>&1 | tee lab/data_parallel_tunings_ddp.log
    PYTHONPATH=src timeout 580 python lab/data_parallel.py --tunings fsdp --steps 150 \
        --time-limit-s 60 --out runs/dp 2>&1 | tee lab/data_parallel_tunings_fsdp.log
    PYTHONPATH=src python lab/data_parallel.py --tunings all --table --out runs/dp

(each call runs the one-GPU reference again: the ratios are to the same call's run. A call
cut by the 10-minute limit goes on where it stopped with ``--skip-done`` added.) A single
run by hand, e.g. FSDP2 without the mixed-precision gather::

    STEPKERNELS_PARALLEL_TUNING=default,-mixed-precision PYTHONPATH=src \
        torchrun --standalone --nproc-per-node 2 -m stepkernels.train --config gpt2-small \
        --batch-size 32 --parallel fsdp --max-steps 150 --log-interval 12 \
        --eval-interval 0 --sample-tokens 0 --out-dir runs/dp/by-hand --overwrite

Its ``log.jsonl``'s start event lists the tunings asked for (``tuning``).
"""

import argparse
import json
import os
from pathlib import Path
import re
import shutil
import subprocess
import sys

TOKENS = 32 * 1024  # a step's tokens: 32 sequences of 1,024
TIMING = (
    "the training command's log.jsonl: tokens/s once warm (the steps after the first log "
    "interval over their wall time, evaluations excluded), rank 0's; validation loss at each "
    "evaluation (10 batches)"
)
RESUMED = "2 GPUs, DDP, resumed on 1 GPU"
RUNS = {  # name: (processes, options beside the common ones)
    "1 GPU, grad-accum 2": (1, ["--grad-accum", "2", "--step", "eager"]),
    "1 GPU, grad-accum 2, CUDA graph": (1, ["--grad-accum", "2", "--step", "graph"]),
    "2 GPUs, DDP": (2, ["--parallel", "ddp"]),
    "2 GPUs, FSDP2": (2, ["--parallel", "fsdp"]),
}
# Run last, and a failure does not stop the script: the step compiled in each process, the
# faster path across processes where the whole-step graph is not recorded.
COMPILED = {"2 GPUs, DDP, torch.compile": (2, ["--parallel", "ddp", "--step", "compile"])}


# --tunings: (processes, options, STEPKERNELS_PARALLEL_TUNING) by run, for ddp and fsdp
DDP_TUNINGS = ("bucket-view", "static-graph", "bucket-cap")
FSDP_TUNINGS = ("mixed-precision", "last-block", "prefetch", "fused-adamw", "local-clip")
REFERENCE = "1 GPU, grad-accum 2"


def tuning_runs(which: str) -> dict:
    runs = {REFERENCE: (1, RUNS[REFERENCE][1], None)}
    for kind, name, tunings in (("ddp", "DDP", DDP_TUNINGS), ("fsdp", "FSDP2", FSDP_TUNINGS)):
        if which not in (kind, "all"):
            continue
        options = ["--parallel", kind]
        runs[f"2 GPUs, {name}, none"] = (2, options, "none")
        runs[f"2 GPUs, {name}, default"] = (2, options, "default")
        for tuning in tunings:
            runs[f"2 GPUs, {name}, default -{tuning}"] = (2, options, f"default,-{tuning}")
        if kind == "fsdp":
            runs[f"2 GPUs, {name}, default +keep-gathered"] = (2, options, "default,keep-gathered")
    return runs


def run_tunings(args) -> None:
    for run, (processes, options, tuning) in tuning_runs(args.tunings).items():
        out = args.out / "tunings" / folder_name(run)
        if args.skip_done and (out / "log.jsonl").is_file() and summary(out) is not None:
            print(f"\n=== {run}: done before, in {out}", flush=True)
            continue
        full = command(processes, [*common(args), *options, "--overwrite"])
        execute(run, [*full, "--out-dir", str(out)], args, required=False, tuning=tuning)


def tuning_table(args) -> None:
    runs = {}
    for run in tuning_runs(args.tunings):
        log = args.out / "tunings" / folder_name(run) / "log.jsonl"
        found = summary(log.parent) if log.is_file() else None
        if found is not None and found["tokens_per_s"]:
            runs[run] = found
    reference = runs.get(REFERENCE, {}).get("tokens_per_s")
    print(f"\n{'run':>40} | tokens/s | x 1 GPU | x none | x default | peak GiB | val loss")
    for run, s in runs.items():
        rate = s["tokens_per_s"]
        kind = run.split(", ")[1] if run != REFERENCE else None
        ratios = [
            rate / reference if reference else None,
            *(
                rate / runs[base]["tokens_per_s"] if base in runs else None
                for base in (f"2 GPUs, {kind}, none", f"2 GPUs, {kind}, default")
            ),
        ]
        shown = [f"{r:.3f}" if r is not None and kind else "-" for r in ratios]
        if not kind:
            shown[0] = "1.000"
        peak = s["peak_memory_gib"]
        peak = f"{peak:.2f}" if peak is not None else "-"
        print(
            f"{run:>40} | {rate:>8,.0f} | {shown[0]:>7} | {shown[1]:>6} | {shown[2]:>9} | "
            f"{peak:>8} | {s['evals'][-1][1]:.4f}"
        )


def folder_name(run: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", run.lower()).strip("-")


def command(processes: int, options: list[str]) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "stepkernels.train", *options]
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    return [sys.executable, *launch, str(processes), "-m", "stepkernels.train", *options]


def common(args, steps: int | None = None) -> list[str]:
    if args.smoke:  # the tiny preset: 4 sequences of 16 a step, on the CPU
        shape = ["--config", "tiny", "--batch-size", "4", "--eval-batches", "1"]
    else:
        shape = ["--config", "gpt2-small", "--batch-size", "32", "--eval-batches", "10"]
    return [
        *shape,
        *("--max-steps", str(steps or args.steps), "--eval-interval", str(args.steps // 2)),
        *("--log-interval", str(max(1, args.steps // 12)), "--sample-tokens", "0"),
        *("--time-limit-s", str(args.time_limit_s)),
    ]


def run_all(args) -> None:
    if args.compiled:  # the compiled run alone, beside the others already in --out
        for run, (processes, options) in COMPILED.items():
            out = args.out / folder_name(run)
            full = command(processes, [*common(args), *options, "--overwrite"])
            execute(run, [*full, "--out-dir", str(out)], args, required=False)
        return
    for run, (processes, options) in RUNS.items():
        if args.smoke and "CUDA graph" in run:
            continue  # no graphs on a CPU
        out = args.out / folder_name(run)
        full = command(processes, [*common(args), *options, "--overwrite"])
        execute(run, [*full, "--out-dir", str(out)], args)
    # DDP's checkpoint, continued on one GPU with the same global batch.
    resumed = args.out / folder_name(RESUMED)
    shutil.rmtree(resumed, ignore_errors=True)
    shutil.copytree(args.out / folder_name("2 GPUs, DDP"), resumed)
    steps = args.steps + max(2, args.steps // 6)
    options = [*common(args, steps), "--grad-accum", "2", "--resume"]
    execute(RESUMED, [*command(1, options), "--out-dir", str(resumed)], args)


def execute(run: str, argv: list[str], args, required: bool = True, tuning: str | None = None) -> None:
    env = dict(os.environ)
    env.pop("STEPKERNELS_PARALLEL_TUNING", None)
    if tuning is not None:
        env["STEPKERNELS_PARALLEL_TUNING"] = tuning
    shown = f"STEPKERNELS_PARALLEL_TUNING={tuning} " if tuning is not None else ""
    print(f"\n=== {run}\n$ {shown}{' '.join(argv)}", flush=True)
    try:
        done = subprocess.run(argv, timeout=args.time_limit_s + 600, env=env)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess(argv, "timed out")
    if done.returncode and required:
        sys.exit(f"{run}: exit status {done.returncode}")
    if done.returncode:
        print(f"{run}: exit status {done.returncode}; left out", flush=True)


def summary(out: Path) -> dict:
    """A run's log: its evaluations, and its last start's and end's figures."""
    events = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    ends = [e for e in events if e["event"] == "end"]
    if not ends:
        return None  # stopped before its end: left out
    end = ends[-1]
    logs = [e for e in events if e["event"] == "log"]
    evals = [e for e in events if e["event"] == "eval"]
    return {
        "tokens_per_s": end["tokens_per_s"],
        "mfu": logs[-1]["mfu"] if logs else None,
        "peak_memory_gib": end["peak_memory_gib"],
        "steps": end["step"],
        "evals": [(e["tokens"], e["val_loss"]) for e in evals],
    }


def table(args) -> dict:
    runs = {}
    for run in [*RUNS, RESUMED, *COMPILED]:
        if (args.out / folder_name(run) / "log.jsonl").is_file():
            found = summary(args.out / folder_name(run))
            if found is not None:
                runs[run] = found
    print(f"\n{'run':>32} | steps | tokens/s | MFU   | peak GiB | val loss")
    for run, s in runs.items():
        rate = f"{s['tokens_per_s']:>8,.0f}" if s["tokens_per_s"] else f"{'-':>8}"
        mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "-"
        peak = f"{s['peak_memory_gib']:.2f}" if s["peak_memory_gib"] is not None else "-"
        print(f"{run:>32} | {s['steps']:>5} | {rate} | {mfu:>5} | {peak:>8} | {s['evals'][-1][1]:.4f}")
    return runs


def record(runs: dict) -> None:
    """The recordings chapter 12 shows, with this machine's environment."""
    from stepkernels.lessons import bench
    import torch

    env = bench.environment()
    env["gpus"] = torch.cuda.device_count()
    env["timing"] = TIMING
    speed = bench.Benchmark(
        name="gpt-data-parallel",
        x_name="tokens per step (32 sequences of 1,024, GPT-2 small's shape)",
        x_values=[TOKENS],
        providers=[*RUNS, *COMPILED],
        make=None,
        work=None,
        unit="tokens/s",
        dtypes=(torch.bfloat16,),
    )
    points = [
        bench.Point(run, "bfloat16", TOKENS, s["tokens_per_s"])
        for run, s in runs.items()
        if run != RESUMED and s["tokens_per_s"]
    ]
    print(bench.record(speed, points, env))
    loss = bench.Benchmark(
        name="gpt-data-parallel-loss",
        x_name="tokens seen",
        x_values=sorted({tokens for s in runs.values() for tokens, _ in s["evals"]}),
        providers=list(runs),
        make=None,
        work=None,
        unit="validation loss",
        dtypes=(torch.bfloat16,),
    )
    points = [bench.Point(run, "bfloat16", tokens, value) for run, s in runs.items() for tokens, value in s["evals"]]
    print(bench.record(loss, points, env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--time-limit-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path("runs/data-parallel"))
    parser.add_argument("--record", action="store_true", help="write the recordings")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on a CPU")
    parser.add_argument("--table", action="store_true", help="only the table of --out")
    parser.add_argument("--compiled", action="store_true", help="only the compiled run, beside the others")
    parser.add_argument("--tunings", choices=("ddp", "fsdp", "all"), help="A/B the wrappers' tunings (records nothing)")
    parser.add_argument(
        "--skip-done", action="store_true", help="with --tunings: leave out the runs --out holds finished"
    )
    args = parser.parse_args()
    if (args.smoke or args.tunings) and args.record:
        parser.error("--smoke and --tunings record nothing: the CPU's numbers are no results, the A/B one session's")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.tunings:
        if not args.table:
            run_tunings(args)
        tuning_table(args)
        return
    if not args.table:
        run_all(args)
    runs = table(args)
    if args.record:
        record(runs)


if __name__ == "__main__":
    main()
