"""Issue 19's scoreboard: which recorded points of chapters 02-06 meet the performance target.

Run anywhere from the repository root (``PYTHONPATH=src``; it reads the recordings only)::

    python lab/performance_standing.py [--all]

A point is one (benchmark, dtype, size) from 2^24 elements (M x N for the row-wise kernels) or
2,048³ (products: M N K of at least that). It meets the target when our best provider (any
whose name starts with "triton") is at or above every peer recorded with it (every other
provider but the copy) and, for a memory-bound benchmark (GB/s), at or above 90% of the copy
of the same bytes (the ``copy (same bytes)`` provider at that point, or where a benchmark has
none, the recorded copy bandwidth). ``--all`` prints every point, not only the short ones.
``--since REVISION`` first lists each point that was short in the recordings at that git
revision, its figure then and now (issue 19's before and after: ``--since 3eb52a3``, the
scoreboard's first run, before any of the issue's changes).
"""

import argparse
import csv
import io
import json
from pathlib import Path
import re
import subprocess

from stepkernels.lessons import bench

BENCHMARKS = [
    "softmax-forward", "softmax-forward-backward", "layer-norm-forward", "layer-norm-backward",
    "matmul-square", "fused-linear-forward", "fused-linear-forward-backward",
    "fused-linear-activations", "fused-linear-activations-forward-backward",
    "dropout-forward", "dropout-forward-backward", "bias-gelu-dropout-forward",
    "bias-gelu-dropout-forward-backward",
]  # fmt: skip
COPY_SHARE = 0.9


def counted(x_name: str, x: float) -> bool:
    """Whether a point is as large as the target asks."""
    rows = re.search(r"M = (\d+)", x_name)
    if x_name.startswith("M = N = K"):
        return x >= 2048
    if x_name.startswith(("in_features", "activation")):  # M = N = 4,096, K >= 1,024
        return True
    return x * (int(rows.group(1)) if rows else 1) >= 2**24


def standing(read) -> dict:
    """Each counted point's (ours, our provider, problems), from ``read(file name)``, the text
    of a file of the recordings' folder."""
    env = json.loads(read("environment.json"))["benchmarks"]
    points = {}
    for name in BENCHMARKS:
        rows = list(csv.DictReader(io.StringIO(read(f"{name}.csv"))))
        values = {(r["provider"], r["dtype"], float(r["x"])): float(r["value"]) for r in rows}
        for dtype, x in dict.fromkeys((d, x) for _, d, x in values):
            here = {pr: v for (pr, d, xx), v in values.items() if (d, xx) == (dtype, x)}
            ours = {pr: v for pr, v in here.items() if pr.startswith("triton")}
            peers = {pr: v for pr, v in here.items()
                     if not pr.startswith("triton") and pr != bench.COPY_PROVIDER}  # fmt: skip
            if not ours or not counted(rows[0]["x_name"], x):
                continue
            best_ours, best_name = max((v, pr) for pr, v in ours.items())
            best_peer, peer = max(((v, pr) for pr, v in peers.items()), default=(0, "-"))
            problems = []
            if best_ours < best_peer:
                problems.append(f"behind {peer} ({best_peer:,.0f})")
            if rows[0]["unit"] == "GB/s":
                copy = here.get(bench.COPY_PROVIDER, env[name]["limits"]["GB/s"])
                if best_ours < COPY_SHARE * copy:
                    problems.append(f"{best_ours / copy:.0%} of the copy ({copy:,.0f})")
            points[name, dtype, x] = (best_ours, best_name, problems)
    return points


def git_reader(revision: str, folder: Path):
    """``read`` for ``standing``: the recordings as they were at ``revision``."""
    relative = folder.resolve().relative_to(Path.cwd().resolve())

    def read(file_name: str) -> str:
        command = ["git", "show", f"{revision}:{(relative / file_name).as_posix()}"]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="print every point")
    parser.add_argument("--since", metavar="REVISION",
                        help="each point short at REVISION (git), then and now")  # fmt: skip
    args = parser.parse_args()
    folder = bench.recorded_gpu_dir()
    now = standing(lambda file_name: (folder / file_name).read_text())
    if args.since:
        then = standing(git_reader(args.since, folder))
        short_then = [key for key, (_, _, problems) in then.items() if problems]
        for key in short_then:
            (before, _, was), (after, who, now_problems) = then[key], now[key]
            status = "; ".join(now_problems) or "meets the target"
            print(f"{', '.join(map(label, key))}: {before:,.0f} ({'; '.join(was)}) -> "
                  f"{who} {after:,.0f}: {status}")  # fmt: skip
        met = sum(not now[key][2] for key in short_then)
        print(f"{met} of the {len(short_then)} points short at {args.since} now meet the target; "
              f"{sum(not p for _, _, p in then.values())} of {len(then)} met it then")  # fmt: skip
    for key, (value, who, problems) in now.items():
        if problems or (args.all and not args.since):
            status = "; ".join(problems) or "meets the target"
            print(f"{', '.join(map(label, key))}: {who} {value:,.0f}: {status}")
    print(f"{sum(not p for _, _, p in now.values())} of {len(now)} points meet the target")


def label(part) -> str:
    return f"{part:,.0f}" if isinstance(part, float) else part


if __name__ == "__main__":
    main()
