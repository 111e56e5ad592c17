"""Write the README's results table from the recordings in src/stepkernels/results/.

    python tools/results_table.py README.md           # rewrite the table in place
    python tools/results_table.py README.md --check   # fail if the table is out of date

The table sits between the markers <!-- results:begin --> and <!-- results:end -->.
"""

import csv
import json
from pathlib import Path
import re
import sys

from stepkernels.lessons import bench

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
COLUMNS = 5  # sizes shown per benchmark, spread evenly over its sweep


def x_label(x: float) -> str:
    x = int(x) if float(x).is_integer() else x
    if isinstance(x, int) and x >= 2**14 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return f"{x:,}"


def cell(point: bench.Point, limit: float | None) -> str:
    """The rate (its share of the limit) · the call's rate · CPU µs per call, where timed."""
    value = point.value
    digits = 2 if value < 10 else 0  # GiB of memory, say
    text = f"{value:,.{digits}f}" if limit is None else f"{value:,.0f} ({value / limit:.0%})"
    if point.call is not None:
        text += f" · {point.call:,.0f} · {point.cpu_us:,.0f} µs"
    return text


def benchmark_table(csv_path: Path, env: dict) -> list[str]:
    points = bench.read_points(csv_path)
    with csv_path.open() as f:
        first = next(csv.DictReader(f))
    x_name, unit = first["x_name"], first["unit"]
    dtypes = {p.dtype for p in points}
    # None for CPU time per call, and for fp8, whose tensor cores outrun the fp16 cuBLAS line
    limit = None if any(bench.limit_for(unit, d, env) is None for d in dtypes) else env["limits"].get(unit)
    xs = sorted({p.x for p in points})
    shown = sorted({xs[round(i * (len(xs) - 1) / (COLUMNS - 1))] for i in range(COLUMNS)}) if len(xs) > 1 else xs
    title = f"**{csv_path.stem}**: {unit} by {x_name}"
    if limit is not None:
        title += f"; in brackets, the share of the {bench.LIMIT_NAME[unit]} ({limit:,.0f} {unit})"
    lines = [
        title,
        "",
        "| dtype | provider | " + " | ".join(x_label(x) for x in shown) + " |",
        "|---|---|" + "---:|" * len(shown),
    ]
    rows = dict.fromkeys((p.dtype, p.provider) for p in points)
    for dtype, provider in rows:
        mine = {p.x: p for p in points if p.dtype == dtype and p.provider == provider}
        cells = [cell(mine[x], limit) if x in mine else "" for x in shown]
        lines.append(f"| {dtype} | {provider} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def results_markdown(results_dir: Path | None = None) -> str:
    results_dir = results_dir or bench.default_results_dir()
    lines = []
    for env_path in sorted(results_dir.glob("*/environment.json")):
        env = json.loads(env_path.read_text())
        lines += [f"### {env['gpu']}", ""]
        for csv_path in sorted(env_path.parent.glob("*.csv")):
            recorded = env["benchmarks"].get(csv_path.stem, env)
            lines += [f"Recorded {bench.describe(recorded).split(', ', 1)[1]} by `{recorded['command']}`.", ""]
            lines += benchmark_table(csv_path, recorded)
    return "\n".join(lines) if lines else "No results recorded yet: run `make bench` on a GPU.\n"


def main(readme: str, *flags: str) -> None:
    path = Path(readme)
    text = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        sys.exit(f"{readme} has no {BEGIN} ... {END} markers")
    updated = pattern.sub(lambda _: f"{BEGIN}\n{results_markdown()}{END}", text)
    if "--check" in flags:
        if updated != text:
            sys.exit(f"The results table in {readme} is out of date: run `make results-table`.")
    else:
        path.write_text(updated)


if __name__ == "__main__":
    main(*sys.argv[1:])
