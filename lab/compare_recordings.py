"""Two recordings of the same benchmarks side by side: how far each point moved between runs.

    PYTHONPATH=src python lab/compare_recordings.py OTHER_FOLDER NAME [NAME...]

OTHER_FOLDER holds a second recording's CSVs (``make bench`` with ``STEPKERNELS_RESULTS``
pointing elsewhere); each NAME's points from 2^24 elements or 2,048³ (issue 19's sizes) are
printed next to the package's recording, with the median and largest change.
"""

import csv
from pathlib import Path
import statistics
import sys

from performance_standing import counted
from stepkernels.lessons import bench


def points(path: Path) -> dict:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {(r["provider"], r["dtype"], float(r["x"])): (float(r["value"]), r["x_name"])
            for r in rows}  # fmt: skip


def main() -> None:
    other, names = Path(sys.argv[1]), sys.argv[2:]
    for name in names:
        kept, again = points(bench.recorded_gpu_dir() / f"{name}.csv"), points(other / f"{name}.csv")
        changes = []
        print(name, "(recorded, again, change)")
        for key, (value, x_name) in kept.items():
            if key in again and counted(x_name, key[2]):
                change = again[key][0] / value - 1
                changes.append(abs(change))
                print(f"  {key[1]:9} {key[2]:>7,.0f} {key[0]:20} {value:8.1f} {again[key][0]:8.1f} {change:+.1%}")
        print(f"  median change {statistics.median(changes):.1%}, largest {max(changes):.1%}")


if __name__ == "__main__":
    main()
