"""What a repeated call of each public op runs on the host, counted without a GPU.

Two counts per call, both the same from run to run (a time on this shared CPU machine is not):

* ``calls``: Python function calls (and C functions called from Python) of one call, as
  cProfile counts them (its ``total_calls``);
* ``torch ops``: the ATen operators one call dispatches, as a ``TorchDispatchMode`` sees
  them (allocations, views, arithmetic, copies: each a trip through torch's dispatcher that
  costs a GPU call's host some µs), each named with its count; ``torch``: those of torch's
  own call (on 2 x 8 fp32 tensors: its dispatch, next to no computation);
* ``floor``: the Python calls of chapter 08's floor of the call (``lessons/calls.py``'s
  ``make_floor``: our allocations and as many launches, bound, inside one
  ``autograd.Function`` with a backward), what no wrapper launching through Triton avoids.

The package runs as ``lab/call_cost.py`` runs it: without Triton's interpreter, with
launchers that do nothing (see that script's docstring for where this path differs from a
GPU's). Each call is made three times first (the first goes through Triton, the second binds
its launches, where the op binds them), then counted. The calls, their inputs (64 x 256 fp16,
attention 1 x 4 x 64 x 64) and torch's counterparts are chapter 08's (``lessons/calls.py``).

    python lab/call_ops_count.py [--only cross_entropy,linear]
"""

import argparse
import collections
import os
import pstats
import sys

import torch

if __name__ == "__main__":
    if torch.cuda.is_available():
        sys.exit("lab/call_ops_count.py counts the Python path without a GPU")
    os.environ["TRITON_INTERPRET"] = "0"  # LeanKernel's GPU path, not the interpreter's

import call_cost  # noqa: E402  (beside this script, as lab/README.md says)
from stepkernels.lessons import calls  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def torch_ops(fn) -> collections.Counter:
    with OpCounter() as counter:
        fn()
    return counter.ops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="ops, comma-separated")
    options = parser.parse_args()
    call_cost.launches_as_no_ops()
    names = [n for n in options.only.split(",") if n] or list(calls.OPERATIONS)
    print(f"{'call':<30} {'calls':>6} {'floor':>6} {'torch ops':>9} {'torch':>6}  ours' torch ops")
    for name in names:
        for label in calls.labels([name]).values():
            ours = call_cost.call(label)
            for _ in range(3):
                ours()
            lean = call_cost.mine_path(ours)
            theirs = call_cost.call(label, ours=False, tiny=True)
            theirs()
            counted = torch_ops(ours)
            listed = ", ".join(f"{op} {n}" for op, n in sorted(counted.items()))
            python = pstats.Stats(call_cost.profiled(ours, 50)).total_calls / 50
            least = call_cost.floor(label)
            floor = pstats.Stats(call_cost.profiled(least, 50)).total_calls / 50
            print(
                f"{label:<30} {python:6.0f} {floor:6.0f} {counted.total():9d} "
                f"{torch_ops(theirs).total():6d}  {listed}{'' if lean else ' (not lean)'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
