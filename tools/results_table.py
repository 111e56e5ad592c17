"""Write the recorded results out of src/stepkernels/results/: a short headline table in the
README, and every benchmark's table on the gallery's page docs/results.rst.

    python tools/results_table.py README.md           # rewrite both (make results-table)
    python tools/results_table.py README.md --check   # fail if either is out of date

The headline sits in the README between the markers <!-- results:begin --> and
<!-- results:end -->; the page is written whole. Neither is edited by hand.
"""

from dataclasses import dataclass
import json
from pathlib import Path
import re
import sys

from stepkernels.lessons import bench

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results.rst"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
COLUMNS = 5  # sizes shown per benchmark, spread evenly over its sweep


@dataclass
class Key:
    """A chapter's key benchmark for the headline: ours against the fastest peer at the
    largest size recorded in ``dtype``. Peers are the other providers but our variants
    ("triton ..."), the copy of the same bytes and ``references``."""

    chapter: str
    benchmark: str
    dtype: str
    ours: str = "triton"
    references: tuple = ()


KEYS = [
    Key("01", "vector-add", "float32"),
    Key("02", "softmax-forward-backward", "float16"),
    Key("03", "layer-norm-backward", "float16", ours="triton (two-stage)"),
    Key("04", "matmul-square", "float16"),
    Key("05", "fused-linear-forward-backward", "float16"),
    Key("06", "bias-gelu-dropout-forward-backward", "float16"),
    Key("07", "matmul-fp8", "float8_e4m3fn"),
    Key("08", "training-step", "bfloat16", ours="triton + CUDA graph"),
    Key("09", "cross-entropy-forward-backward", "bfloat16"),
    Key("10", "linear-cross-entropy", "bfloat16"),
    Key("11", "attention-forward-d128-causal", "bfloat16"),
    Key(
        "12", "gpt-training-throughput", "bfloat16", ours="triton + CUDA graph", references=("products alone (cuBLAS)",)
    ),
    Key("13", "layer-norm-long-rows", "float16"),
    Key("14", "rotary-forward-backward", "bfloat16"),
    Key("15", "add-layer-norm-backward", "float32"),
]


def recordings(results_dir: Path) -> list[tuple[dict, Path]]:
    """Each GPU's environment.json and folder, by folder name."""
    return [(json.loads(path.read_text()), path.parent) for path in sorted(results_dir.glob("*/environment.json"))]


def short_axis(x_name: str) -> str:
    """The axis's name without what follows its first top-level comma or semicolon:
    "V (vocabulary), 8,192 tokens" -> "V (vocabulary)"."""
    depth = 0
    for i, char in enumerate(x_name):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char in ",;" and depth == 0:
            return x_name[:i]
    return x_name


def key_row(key: Key, env: dict, folder: Path) -> str | None:
    """The headline's row for ``key``, or None where it is not recorded on this GPU."""
    path = folder / f"{key.benchmark}.csv"
    if not path.exists():
        return None
    points, axis = bench.read_recording(path)
    points = [p for p in points if p.dtype == key.dtype]
    ours = [p for p in points if p.provider == key.ours]
    if not ours:
        return None
    x = max(p.x for p in ours)
    at = {p.provider: p for p in points if p.x == x}
    mine, unit = at[key.ours], axis["unit"]
    peers = [
        p
        for p in at
        if p != key.ours and not p.startswith("triton") and p != bench.COPY_PROVIDER and p not in key.references
    ]
    best = max(peers, key=lambda p: at[p].value, default=None)
    peer = "" if best is None else f"{best} {bench.value_text(at[best].value)}"
    ratio = "" if best is None else f"{mine.value / at[best].value:.2f}x"
    size = f"{short_axis(axis['x_name'])}: {bench.size_text(x)}"
    return (
        f"| {key.chapter} | {key.benchmark}, {key.dtype} | {size} | "
        f"{bench.value_text(mine.value)} {unit} | {peer} | {ratio} |"
    )


def headline_markdown(results_dir: Path | None = None) -> str:
    """The README's headline: per GPU, each chapter's key benchmark at its largest size."""
    results_dir = results_dir or bench.default_results_dir()
    lines = []
    for env, folder in recordings(results_dir):
        rows = [row for key in KEYS if (row := key_row(key, env, folder))]
        if not rows:
            continue
        dates = sorted({entry["date"] for entry in env["benchmarks"].values()})
        when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        lines += [
            f"**{env['gpu']}**, recorded {when} by `make bench`: each chapter's key benchmark "
            "at its largest size, ours against the fastest peer there, as the chapter plots it "
            "(the page below says how each was timed; the chapters say why where we trail).",
            "",
            "| chapter | benchmark | size | ours | fastest peer | ours / peer |",
            "|---|---|---|---:|---:|---:|",
            *rows,
            "",
        ]
    return "\n".join(lines) if lines else "No results recorded yet: run `make bench` on a GPU.\n"


def cell(point: bench.Point, limit: float | None) -> str:
    """The rate (its share of the limit) · the call's rate · CPU µs per call, where timed."""
    value = point.value
    digits = 2 if value < 10 else 0  # GiB of memory, say
    text = f"{value:,.{digits}f}" if limit is None else f"{value:,.0f} ({value / limit:.0%})"
    if point.call is not None:
        text += f" · {point.call:,.0f} · {point.cpu_us:,.0f} µs"
    return text


def rst_text(text: str) -> str:
    """``text`` as reStructuredText reads it literally."""
    return re.sub(r"([\\`*|_])", r"\\\1", text)


def benchmark_section(csv_path: Path, env: dict) -> list[str]:
    """A benchmark's subsection: what it measures, when, and a table of every provider at up
    to COLUMNS sizes spread over its sweep (every category of a benchmark of categories)."""
    points, axis = bench.read_recording(csv_path)
    x_name, unit = axis["x_name"], axis["unit"]
    names = env.get("x_labels", {})
    dtypes = {p.dtype for p in points}
    # None for CPU time per call, and for fp8, whose tensor cores outrun the fp16 cuBLAS line
    limit = None if any(bench.limit_for(unit, d, env) is None for d in dtypes) else env["limits"].get(unit)
    xs = sorted({p.x for p in points})
    if len(xs) > COLUMNS and not names:
        xs = sorted({xs[round(i * (len(xs) - 1) / (COLUMNS - 1))] for i in range(COLUMNS)})
    header = [names.get(str(int(x)) if float(x).is_integer() else str(x), bench.size_text(x)) for x in xs]
    about = f"{unit} by {x_name}"
    if limit is not None:
        about += f"; in brackets, the share of the {bench.LIMIT_NAME[unit]} ({limit:,.0f} {unit})"
    recorded = f"Recorded {env['date']} ({bench.versions(env)}) by ``{env['command']}``."
    title = rst_text(csv_path.stem)
    lines = [title, "~" * len(title), "", f"{rst_text(about)}. {recorded}", ""]
    lines += [".. list-table::", "   :header-rows: 1", "", "   * - dtype", "     - provider"]
    lines += [f"     - {rst_text(h)}" for h in header]
    for dtype, provider in dict.fromkeys((p.dtype, p.provider) for p in points):
        mine = {p.x: p for p in points if p.dtype == dtype and p.provider == provider}
        lines += [f"   * - {dtype}", f"     - {rst_text(provider)}"]
        lines += [f"     - {cell(mine[x], limit) if x in mine else '–'}" for x in xs]
    return [*lines, ""]


INTRODUCTION = """\
..
   Generated from src/stepkernels/results/ by make results-table (tools/results_table.py):
   not edited by hand.

Recorded results
================

Every benchmark recorded on a GPU by ``make bench``, the numbers the chapters' plots show
where no GPU is present. A chapter run on a GPU measures a few points of each benchmark (its
largest size) and draws them over these curves; ``STEPKERNELS_FULL=1`` measures every size,
and ``make bench`` records them. :doc:`measuring` explains how each number is taken.

Rates are medians of ``triton.testing.do_bench`` with the L2 cache flushed: of CUDA-graph
replays (the GPU time of a call) for the softmax, layer-norm, matmul and dropout benchmarks,
of calls from Python for the vector-add ones, recorded before that change. Recordings from
2026-11-26 on time a point's providers in turns, so that the power cap's drift falls on all
alike. Where a recording also timed the call from Python, a cell reads ``GPU-time rate (share
of the limit) · rate of the call from Python · µs of CPU per call``. The ``copy (same bytes)``
rows are a plain Triton copy of the bytes each benchmark counts: a reference at that size.
Logs of the experiments behind the chapters' launch choices are in the repository's ``lab/``.
"""


def results_rst(results_dir: Path | None = None) -> str:
    """The page docs/results.rst: every recorded benchmark, per GPU."""
    results_dir = results_dir or bench.default_results_dir()
    lines = [INTRODUCTION]
    found = recordings(results_dir)
    for env, folder in found:
        lines += [rst_text(env["gpu"]), "-" * len(rst_text(env["gpu"])), ""]
        for csv_path in sorted(folder.glob("*.csv")):
            if not bench.is_recording(csv_path):  # a lab script's table (a step's profile)
                continue
            lines += benchmark_section(csv_path, env["benchmarks"].get(csv_path.stem, env))
    if not found:
        lines += ["No results recorded yet: run ``make bench`` on a GPU.", ""]
    return "\n".join(lines)


def main(readme: str, *flags: str) -> None:
    path = Path(readme)
    text = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        sys.exit(f"{readme} has no {BEGIN} ... {END} markers")
    updated = pattern.sub(lambda _: f"{BEGIN}\n{headline_markdown()}{END}", text)
    page = results_rst()
    if "--check" in flags:
        stale = [
            name
            for name, now, then in (
                (readme, updated, text),
                (str(PAGE.relative_to(ROOT)), page, PAGE.read_text() if PAGE.exists() else ""),
            )
            if now != then
        ]
        if stale:
            sys.exit(f"The results in {' and '.join(stale)} are out of date: run `make results-table`.")
    else:
        path.write_text(updated)
        PAGE.write_text(page)


if __name__ == "__main__":
    main(*sys.argv[1:])
