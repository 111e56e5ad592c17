"""Where a training step's host and GPU time go on several processes (issue 44): run under
torchrun, the command's own ``Trainer`` (DDP or FSDP2, the tunings of
``STEPKERNELS_PARALLEL_TUNING``) takes warm-up steps, then times steps, then profiles two.

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 lab/parallel_profile.py \\
        --config gpt2-small --batch-size 32 --parallel fsdp [--trace runs/fsdp.json]

The options are ``python -m stepkernels.train``'s (``--step eager``, no files written).
Rank 0 prints the step's wall time (the GPU synchronized at both ends of the timed steps),
then from the profile a step's host time in the ranges the wrappers mark (FSDP2's
``FSDP::*``, DDP's reducer, the optimizer's step), the 20 operators of most host time
(self), and the 15 GPU kernels of most time. ``--trace``: rank 0's Chrome trace. On a CPU
(gloo, Triton's interpreter) it checks the script; its times are no results.
"""

import argparse
from collections import defaultdict
import dataclasses
import time

from stepkernels.models import data as datasets
from stepkernels.models import distributed, train
from stepkernels.runtime.core import ON_GPU
import torch
from torch.profiler import ProfilerActivity, profile


def synchronize():
    if ON_GPU:
        torch.cuda.synchronize()


def main() -> None:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--warmup", type=int, default=5, help="steps before timing")
    first.add_argument("--timed", type=int, default=10, help="steps timed")
    first.add_argument("--trace", help="write rank 0's Chrome trace here")
    ours, rest = first.parse_known_args()
    cfg = train.parse_config([*rest, "--step", "eager", "--out-dir", "", "--no-checkpoint"])
    cfg = dataclasses.replace(cfg, max_steps=10**9)
    launch = distributed.launch_from_environment()
    parallel = distributed.start(cfg.parallel, launch)
    try:
        data = datasets.load_shakespeare(cfg.data_dir or None, prepare=False)
        trainer = train.Trainer(cfg, data, None, parallel)
        say = print if parallel.main else (lambda *args, **kwargs: None)
        say(*trainer.describe(), sep="\n")
        say(f"tuning: {','.join(sorted(parallel.tuning)) or 'none'}")
        for _ in range(ours.warmup):
            trainer.run_step()
        synchronize()
        start = time.perf_counter()
        for _ in range(ours.timed):
            trainer.run_step()
        synchronize()
        seconds = (time.perf_counter() - start) / ours.timed
        tokens = cfg.batch_size * cfg.block_size
        say(f"step: {1e3 * seconds:.1f} ms wall, {tokens / seconds:,.0f} tokens/s (rank 0)")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                trainer.run_step()
            synchronize()
        if parallel.main:
            report(prof, steps=2)
            if ours.trace:
                prof.export_chrome_trace(ours.trace)
                print(f"trace: {ours.trace}")
    finally:
        distributed.stop(parallel)


def report(prof, steps: int) -> None:
    events = prof.key_averages()
    ranges = defaultdict(float)
    for e in events:
        name = e.key
        if name.startswith(("FSDP::", "DistributedDataParallel", "Optimizer.step")):
            ranges[name] += e.cpu_time_total / steps
    print("\nhost time a step in the wrappers' ranges (inclusive, ms):")
    for name, us in sorted(ranges.items(), key=lambda kv: -kv[1])[:20]:
        print(f"{name:>60}: {us / 1e3:8.2f}")
    print("\noperators of most host time (self, ms a step, calls a step):")
    by_self = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
    for e in by_self:
        print(f"{e.key[:60]:>60}: {e.self_cpu_time_total / 1e3 / steps:8.2f} {e.count // steps:>6}")
    if ON_GPU:
        print("\nGPU kernels of most time (ms a step, launches a step):")
        kernels = [e for e in events if e.self_device_time_total > 0]
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
            print(f"{e.key[:60]:>60}: {e.self_device_time_total / 1e3 / steps:8.2f} {e.count // steps:>6}")


if __name__ == "__main__":
    main()
