import contextlib
import csv
import importlib.util
import json
import os
from pathlib import Path
import subprocess
import sys
from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
from stepkernels.lessons import bench
from stepkernels.runtime.core import INTERPRET, ON_GPU
import torch

ROOT = Path(__file__).resolve().parent.parent

FAKE_ENV = {
    "gpu": "Some GPU 80GB",
    "driver": "1.2.3",
    "cuda": "13.0",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "date": "2026-11-22",
    "command": "make bench",
    "limits": {"GB/s": 3000.0, "TFLOP/s": 700.0},
}


def copy_benchmark(**overrides):
    fields = dict(
        name="copy",
        x_name="elements",
        x_values=[2**10, 2**12],
        providers=["triton", "torch"],
        make=lambda provider, n, dtype: lambda: torch.ones(n, dtype=dtype).clone(),
        work=lambda n, dtype: 2 * n * dtype.itemsize,
        smoke_x=16,
        headline_x=2**12,
    )
    return bench.Benchmark(**{**fields, **overrides})


POINTS = [
    bench.Point("triton", "float32", 2**10, 1500.0),
    bench.Point("torch", "float32", 2**10, 1400.0),
    bench.Point("triton", "float32", 2**12, 2700.0),
    bench.Point("torch", "float32", 2**12, 2600.0),
]


def test_record_writes_exactly_the_agreed_columns(tmp_path):
    path = bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    assert path == tmp_path / "some-gpu-80gb" / "copy.csv"
    with path.open() as f:
        rows = list(csv.reader(f))
    header = ["benchmark", "provider", "dtype", "x_name", "x", "value", "unit", "call_value", "cpu_us"]
    assert rows[0] == header
    assert rows[1] == ["copy", "triton", "float32", "elements", "1024", "1500", "GB/s", "", ""]
    env = json.loads((path.parent / "environment.json").read_text())
    assert env["gpu"] == "Some GPU 80GB" and env["benchmarks"]["copy"]["triton"] == "3.6.0"


def test_recorded_points_come_back_as_written(tmp_path):
    bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    points, env = bench.load_recorded("copy", results_dir=tmp_path)
    assert [(p.provider, p.x, p.value) for p in points] == [(p.provider, p.x, p.value) for p in POINTS]
    assert env["date"] == "2026-11-22"
    assert bench.load_recorded("missing", results_dir=tmp_path) is None


def test_newest_recording_is_shown(tmp_path, monkeypatch):
    bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    bench.record(copy_benchmark(), POINTS, {**FAKE_ENV, "gpu": "Other GPU", "date": "2026-12-01"}, results_dir=tmp_path)
    assert bench.recorded_gpu_dir(tmp_path).name == "other-gpu"
    monkeypatch.setenv("STEPKERNELS_RESULTS_GPU", "some-gpu-80gb")
    assert bench.recorded_gpu_dir(tmp_path).name == "some-gpu-80gb"


def test_a_benchmark_recorded_on_one_gpu_only_is_still_shown(tmp_path):
    """A later recording of other benchmarks on another GPU does not hide this one: each
    benchmark is shown from the GPU that recorded it last."""
    bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    later = {**FAKE_ENV, "gpu": "Other GPU", "date": "2026-12-01"}
    other = copy_benchmark(name="other")
    bench.record(other, POINTS, later, results_dir=tmp_path)
    assert bench.recorded_gpu_dir(tmp_path).name == "other-gpu"
    points, env = bench.load_recorded("copy", results_dir=tmp_path)
    assert env["gpu"] == "Some GPU 80GB" and len(points) == len(POINTS)
    bench.record(copy_benchmark(), POINTS, later, results_dir=tmp_path)
    assert bench.load_recorded("copy", results_dir=tmp_path)[1]["gpu"] == "Other GPU"


def test_plot_says_recorded_and_draws_the_limit():
    fig = bench.plot(copy_benchmark(), POINTS, FAKE_ENV, live=False)
    assert "recorded on Some GPU 80GB" in fig._suptitle.get_text()
    (ax,) = fig.axes
    assert any(list(line.get_ydata()) == [3000.0, 3000.0] for line in ax.get_lines())


def test_cpu_time_benchmarks_plot_and_summarize_without_a_limit(capsys):
    cpu_bench = copy_benchmark(unit=bench.CPU_UNIT)
    points = [bench.Point("triton", "float32", 2**12, 360.0), bench.Point("torch", "float32", 2**12, 120.0)]
    fig = bench.plot(cpu_bench, points, FAKE_ENV, live=True)
    (ax,) = fig.axes
    assert all(len(line.get_xdata()) != 2 or line.get_ydata()[0] != line.get_ydata()[1] for line in ax.get_lines())
    assert ax.get_ylabel() == f"float32\n{bench.CPU_UNIT}"
    bench.summarize(cpu_bench, points, FAKE_ENV)
    out = capsys.readouterr().out
    assert "triton 360 µs of CPU per call; torch 120" in out and "% of" not in out


def results_table_tool():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "tools" / "results_table.py")
    results_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_table)
    return results_table


def table_rows(rst: str) -> list[list[str]]:
    """The rows of the list-tables in ``rst``, each a list of its cells."""
    rows = []
    for line in rst.splitlines():
        if line.startswith("   * - "):
            rows.append([line[7:]])
        elif line.startswith("     - "):
            rows[-1].append(line[7:])
    return rows


def test_results_table_shows_cpu_time_without_a_share(tmp_path):
    points = [bench.Point("triton", "float32", 2**10, 364.0), bench.Point("triton", "float32", 2**12, 300.0)]
    bench.record(copy_benchmark(unit=bench.CPU_UNIT), points, FAKE_ENV, results_dir=tmp_path)
    assert ["float32", "triton", "364", "300"] in table_rows(results_table_tool().results_rst(tmp_path))


def test_summary_states_the_share_of_the_limit_and_names_what_it_compares_with(capsys):
    bench.summarize(copy_benchmark(), POINTS, FAKE_ENV)
    out = " ".join(capsys.readouterr().out.split())
    assert "triton 2,700 GB/s, 90% of the copy bandwidth (3,000 GB/s); 1.04x torch's 2,600" in out


def test_run_without_a_gpu_smoke_runs_providers_and_shows_no_timings(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    calls = []
    smoked = copy_benchmark(make=lambda provider, n, dtype: lambda: calls.append((provider, n)))
    monkeypatch.setenv("STEPKERNELS_RESULTS", str(tmp_path))
    assert bench.run(smoked) is None
    assert calls == [("triton", 16), ("torch", 16)]
    assert "No recorded GPU results for 'copy'" in capsys.readouterr().out
    assert not plt.get_fignums()


def test_run_without_a_gpu_plots_the_recording(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    monkeypatch.setenv("STEPKERNELS_RESULTS", str(tmp_path))
    bench.run(copy_benchmark())
    assert "recorded on Some GPU 80GB" in plt.gcf()._suptitle.get_text()
    out = capsys.readouterr().out
    assert "triton 2,700 GB/s, 90% of the copy bandwidth" in " ".join(out.split())


def test_readme_headline_and_results_page_are_up_to_date():
    table = subprocess.run(
        [sys.executable, "tools/results_table.py", "README.md", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert table.returncode == 0, table.stderr
    assert "   results\n" in (ROOT / "docs" / "index.rst").read_text()  # in the gallery's toctree


def test_results_page_reads_recordings_and_is_valid_restructuredtext(tmp_path):
    docutils_core = pytest.importorskip("docutils.core")
    bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    rst = results_table_tool().results_rst(tmp_path)
    assert "Some GPU 80GB\n-------------" in rst
    assert ["float32", "triton", "1,500 (50%)", "2,700 (90%)"] in table_rows(rst)
    docutils_core.publish_doctree(  # a warning raises: the gallery builds with -W
        rst.replace(":doc:`measuring`", "measuring"), settings_overrides={"halt_level": 2, "report_level": 5}
    )


def test_readme_headline_is_ours_against_the_fastest_peer_at_the_largest_size(tmp_path, monkeypatch):
    tool = results_table_tool()
    monkeypatch.setattr(tool, "KEYS", [tool.Key("01", "copy", "float32")])
    points = POINTS + [
        bench.Point("liger", "float32", 2**12, 3000.0),
        bench.Point("triton (old)", "float32", 2**12, 9e3),
    ]
    bench.record(copy_benchmark(), points, FAKE_ENV, results_dir=tmp_path)
    headline = tool.headline_markdown(tmp_path)
    assert "**Some GPU 80GB**, recorded 2026-11-22 by `make bench`" in headline
    assert "| 01 | copy, float32 | elements: 4,096 | 2,700 GB/s | liger 3,000 | 0.90x |" in headline


def test_every_provider_of_a_plot_gets_its_own_color():
    providers = ["triton", "triton (portable)", "torch", "liger_kernel", "torch.compile"]
    colors = bench.provider_colors(providers)
    assert colors["triton"] == bench.STYLE["triton"] and colors["torch"] == bench.STYLE["torch"]
    assert len(set(colors.values())) == len(providers)
    chosen = bench.provider_colors(providers, {"liger_kernel": bench.OTHER_COLORS[0]})
    assert chosen["liger_kernel"] == bench.OTHER_COLORS[0]
    assert len(set(chosen.values())) == len(providers)


def test_rate_converts_work_per_millisecond_into_the_unit(monkeypatch):
    monkeypatch.setattr(bench, "measure_ms", lambda fn: (0.5, 0.4, 0.6))
    assert bench.rate(3e9, None) == pytest.approx(6000.0)  # 3 GB in 0.5 ms: 6,000 GB/s
    assert bench.rate(2e12, None, "TFLOP/s") == pytest.approx(4000.0)


def test_per_time_is_work_over_seconds_in_the_unit():
    assert bench.per_time(3e9, 0.5, "GB/s") == pytest.approx(6000.0)
    assert bench.per_time(2e12, 0.5, "TFLOP/s") == pytest.approx(4000.0)


def test_run_returns_what_it_shows_for_the_prose_to_quote(tmp_path, monkeypatch):
    if ON_GPU:
        pytest.skip("on a GPU run measures instead")
    bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    monkeypatch.setenv("STEPKERNELS_RESULTS", str(tmp_path))
    results = bench.run(copy_benchmark())
    assert results.value("triton", 2**12) == 2700.0
    assert results.ratio("triton", "torch", 2**12) == pytest.approx(2700 / 2600)
    assert results.value("triton", 2**12, torch.float16) != results.value("triton", 2**12, torch.float16)  # NaN
    assert results.how.startswith("recorded on Some GPU 80GB, 2026-11-22")


def test_measurement_settings_are_restored_even_on_error():
    import torch._dynamo.config
    import torch._inductor.config

    before = (
        torch.get_float32_matmul_precision(),
        torch._dynamo.config.recompile_limit,
        torch._inductor.config.compile_threads,
    )
    with pytest.raises(RuntimeError, match="boom"):
        with bench.measurement_settings(copy_benchmark(float32_matmul_precision="medium")):
            assert torch.get_float32_matmul_precision() == "medium"
            assert torch._dynamo.config.recompile_limit == 64
            assert torch._inductor.config.compile_threads == 1
            raise RuntimeError("boom")
    after = (
        torch.get_float32_matmul_precision(),
        torch._dynamo.config.recompile_limit,
        torch._inductor.config.compile_threads,
    )
    assert after == before


def test_importing_the_package_changes_no_setting_but_the_interpreter_switch():
    """A fresh process: importing every module of the package leaves torch's settings and the
    environment as they were, except TRITON_INTERPRET where there is no GPU."""
    probe = """
import os, torch
before = dict(os.environ), torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled()
import stepkernels, stepkernels.lessons.bench, stepkernels.lessons.tutorial, stepkernels.lessons.figures
after = dict(os.environ), torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled()
changed = {k for k in set(before[0]) | set(after[0]) if before[0].get(k) != after[0].get(k)}
assert changed <= {"TRITON_INTERPRET"}, changed
assert before[1:] == after[1:]
print("unchanged")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ran = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert ran.returncode == 0 and "unchanged" in ran.stdout, ran.stderr


def test_importing_triton_first_without_a_gpu_is_refused_with_advice():
    if ON_GPU or not INTERPRET:
        pytest.skip("only where kernels must be interpreted")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    ran = subprocess.run([sys.executable, "-c", "import triton, stepkernels"], env=env, capture_output=True, text=True)
    assert ran.returncode != 0 and "import stepkernels before triton" in ran.stderr


def test_categories_are_bars_with_their_names_and_fp8_has_no_fp16_limit():
    labels = {0: "none", 1: "gelu"}
    points = [
        bench.Point(p, "float16", x, v) for p, x, v in [("triton", 0, 600.0), ("torch", 0, 620.0), ("triton", 1, 590.0)]
    ]
    fig = bench.plot(copy_benchmark(x_labels=labels, unit="TFLOP/s"), points, FAKE_ENV, live=False)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "gelu"]
    assert len(ax.patches) == 3 and not any(len(line.get_xdata()) > 2 for line in ax.get_lines())
    assert bench.limit_for("TFLOP/s", "float8_e4m3fn", FAKE_ENV) is None
    assert bench.limit_for("TFLOP/s", "float16", FAKE_ENV) == 700.0


def test_summary_says_what_it_shows_and_reads_its_size_plainly(capsys):
    bench.forget_environment_line()
    bench.summarize(copy_benchmark(), POINTS, FAKE_ENV, live=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "copy: recorded on Some GPU 80GB, 2026-11-22"
    assert lines[1] == "  (driver 1.2.3, CUDA 13.0, torch 2.11.0, triton 3.6.0)"
    assert lines[2].startswith("  float32, at 4,096 (elements): triton 2,700 GB/s")


def test_call_and_cpu_times_round_trip_and_older_recordings_have_none(tmp_path):
    timed = [bench.Point("triton", "float32", 2**10, 1500.0, call=400.0, cpu_us=21.5),
             bench.Point("torch", "float32", 2**10, 1400.0, call=900.0, cpu_us=9.0)]  # fmt: skip
    path = bench.record(copy_benchmark(), timed, FAKE_ENV, results_dir=tmp_path)
    points, env = bench.load_recorded("copy", results_dir=tmp_path)
    assert [(p.call, p.cpu_us) for p in points] == [(400.0, 21.5), (900.0, 9.0)]
    results = bench.Results(copy_benchmark(), points, env, live=False)
    assert results.call("triton", 2**10) == 400.0 and results.cpu_us("torch", 2**10) == 9.0
    said = results.as_called("triton", "torch", 2**10)
    assert "400 GB/s called from Python (GPU time 1,500), 22 µs" in said and "torch: 900" in said
    older = path.read_text().replace(",call_value,cpu_us", "").replace(",400,21.5", "")
    path.write_text(older.replace(",900,9", ""))
    points, _ = bench.load_recorded("copy", results_dir=tmp_path)
    assert all(p.call is None and p.cpu_us is None for p in points)
    assert "no call from Python timed" in bench.Results(copy_benchmark(), points, env, False).as_called(
        "triton", "torch", 2**10
    )


def test_standing_counts_the_points_ahead_of_every_peer_and_the_share_of_the_limit():
    points = POINTS + [bench.Point("copy", "float32", 2**10, 3000.0), bench.Point("copy", "float32", 2**12, 3000.0),
                       bench.Point("liger", "float32", 2**12, 2800.0)]  # fmt: skip
    results = bench.Results(copy_benchmark(), points, FAKE_ENV, live=False)
    (line,) = results.standing("triton", limit="copy")
    assert results.standing("triton", "copy", peers=["torch"]) != [line]
    assert line == ("float32: triton at or above torch and liger at 1 of 2 sizes; 1,500 to 2,700 GB/s, "
                    "50% to 90% of copy")  # fmt: skip


def test_gpu_state_keeps_busy_samples_and_names_every_clock_event_reason():
    lines = [
        "1980, 1980, 512.25, 51, 0x0000000000000000",
        "345, 1980, 80.50, 40, 0x0000000000000001",  # idle between launches: left out
        "1755, 1980, 699.90, 63, 0x0000000000000004",  # software power cap
        "1830, 1980, [N/A], 60, 0x0",  # unreadable: left out
        "1830, 1980, 650.0",  # cut off when the sampler stopped
    ]
    state = bench.gpu_state_summary(lines)
    assert state["busy_samples"] == 2
    assert state["sm_clock_mhz"] == {"median": 1867.5, "min": 1755.0, "max": 1980.0, "max_possible": 1980.0}
    assert state["power_w"]["max"] == 699.9 and state["temperature_c"]["max"] == 63.0
    assert state["clock_event_reasons"] == ["0x4"]
    assert bench.gpu_state_summary(["345, 1980, 80.5, 40, 0x1"]) == {}


def test_gpu_state_is_recorded_beside_a_gpu_measurement():
    with bench.gpu_state(interval_ms=20) as state:
        if ON_GPU:
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(200):
                a = a @ a / 64
            torch.cuda.synchronize()
    if not ON_GPU:
        assert state == {}  # nothing to sample without a GPU
    else:
        clock = state["sm_clock_mhz"]
        assert state["busy_samples"] > 0 and 0 < clock["median"] <= clock["max_possible"]


class FakeTimings:
    """Stands in for the GPU in ``bench.measure_on_stream``: each provider's timed call logs
    its name and takes a fixed time, so the order of turns and the values can be checked."""

    def __init__(self, monkeypatch, ms, fits_together=True):
        self.log, self.ms, self.alive = [], ms, set()
        self.fits_together = fits_together

        def make(provider, n, dtype):
            if provider == "broken":
                raise RuntimeError("operation not permitted when stream is capturing")
            if self.alive and not self.fits_together:
                raise torch.OutOfMemoryError("no room beside the others")
            self.alive.add(provider)
            return lambda: self.log.append(provider)

        def do_bench(fn, warmup=25, rep=100, quantiles=None, return_mode="mean"):
            assert return_mode == "all"
            fn()  # a replay logs its provider; the samples spread around its time
            provider = self.log[-1]
            return [self.ms[provider] * f for f in (0.9, 1.0, 1.0, 1.1)]

        self.bench = copy_benchmark(make=make, user_timing=False)
        monkeypatch.setattr(bench, "capture", lambda fn: SimpleNamespace(replay=fn))
        monkeypatch.setattr(bench.triton.testing, "do_bench", do_bench)
        monkeypatch.setattr(bench.torch.cuda, "empty_cache", self.alive.clear)


def test_providers_of_a_point_are_timed_in_turns(monkeypatch):
    fake = FakeTimings(monkeypatch, {"triton": 0.5, "torch": 1.0})
    fake.bench.x_values = [2**10]
    points = bench.measure_on_stream(fake.bench)
    assert fake.log == ["triton", "torch"] * bench.ROUNDS  # alternating, not one then the other
    rates = {p.provider: p for p in points}
    work = 2 * 2**10 * 4
    assert rates["triton"].value == pytest.approx(bench.per_time(work, 0.5, "GB/s"))
    assert rates["torch"].value == pytest.approx(bench.per_time(work, 1.0, "GB/s"))
    assert rates["triton"].low < rates["triton"].value < rates["triton"].high


def test_providers_that_do_not_fit_together_are_timed_one_at_a_time(monkeypatch):
    fake = FakeTimings(monkeypatch, {"triton": 0.5, "torch": 1.0}, fits_together=False)
    fake.bench.x_values = [2**10]
    points = bench.measure_on_stream(fake.bench)
    assert [p.provider for p in points] == ["triton", "torch"]
    assert fake.log == ["triton"] * bench.ROUNDS + ["torch"] * bench.ROUNDS


def test_providers_that_must_not_live_together_are_made_and_timed_one_at_a_time(monkeypatch):
    fake = FakeTimings(monkeypatch, {"triton": 0.5, "torch": 1.0})
    fake.bench.x_values, fake.bench.in_turns = [2**10], False
    made = []
    make = fake.bench.make
    fake.bench.make = lambda provider, *a: made.append(sorted(fake.alive)) or make(provider, *a)
    points = bench.measure_on_stream(fake.bench)
    assert [p.provider for p in points] == ["triton", "torch"]
    assert fake.log == ["triton"] * bench.ROUNDS + ["torch"] * bench.ROUNDS
    assert made == [[], []]  # torch made after triton's call was dropped
    assert "each provider alone" in bench.timing_of(fake.bench)
    assert bench.timing_of(copy_benchmark()) == bench.TIMING  # in turns


def test_a_call_that_cannot_be_captured_is_skipped_and_the_others_measured(monkeypatch, capsys):
    fake = FakeTimings(monkeypatch, {"triton": 0.5, "torch": 1.0})
    fake.bench.x_values, fake.bench.providers = [2**10], ["triton", "broken", "torch"]
    points = bench.measure_on_stream(fake.bench)
    assert [p.provider for p in points] == ["triton", "torch"]
    assert "broken at 1,024 (elements): skipped" in capsys.readouterr().out


# ------------------------------------------------------------------ what a reader sees
RECORDINGS = sorted(p for p in bench.PACKAGE_RESULTS.glob("*/*.csv") if bench.is_recording(p))


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_a_recorded_plot_is_labelled_by_its_recording_not_by_the_live_run(path, monkeypatch):
    """Chapter 13 built its axis label from the size it runs (4,096 values under the
    interpreter) while showing points recorded at 2^26: the label must be the recording's."""
    if ON_GPU:
        pytest.skip("on a GPU run measures instead")
    monkeypatch.setenv("STEPKERNELS_RESULTS_GPU", path.parent.name)
    with path.open() as f:
        x_name = next(csv.DictReader(f))["x_name"]
    live = copy_benchmark(name=path.stem, x_name="a label built from the live run's sizes", providers=[])
    results = bench.run(live)
    assert plt.gcf().axes[-1].get_xlabel() == x_name
    assert results.bench.x_name == x_name
    plt.close("all")


def boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_long_category_names_do_not_collide():
    names = {i: f"{word} {i}: a longer name of its piece" for i, word in enumerate(["torch.empty_like", "a.b.c"] * 4)}
    points = [bench.Point(p, "float16", x, 10.0 + x) for x in names for p in ("triton", "torch", "torch.compile")]
    fig = bench.plot(copy_benchmark(x_labels=names, unit=bench.CPU_UNIT), points, FAKE_ENV, live=False)
    fig.canvas.draw()
    boxes = [label.get_window_extent() for label in fig.axes[0].get_xticklabels()]
    assert len(boxes) == len(names)
    assert not any(boxes_overlap(a, b) for a, b in zip(boxes, boxes[1:], strict=False))


def test_the_title_and_legend_sit_off_each_other_and_off_the_axes():
    providers = ["triton", "triton (portable)", "torch", "torch.compile", "liger_kernel", "copy (same bytes)"]
    points = [bench.Point(p, d, x, 100.0 * (i + 1), call=50.0, cpu_us=9.0)
              for i, p in enumerate(providers) for d in ("float16", "float32") for x in (2**10, 2**12)]  # fmt: skip
    fig = bench.plot(copy_benchmark(name="a-benchmark-with-a-rather-long-name"), points, FAKE_ENV, live=False)
    fig.canvas.draw()
    title, (legend,) = fig._suptitle.get_window_extent(), fig.legends
    legend = legend.get_window_extent()
    assert not boxes_overlap(title, legend)
    for ax in fig.axes:
        assert not boxes_overlap(ax.get_window_extent(), legend)
        assert not boxes_overlap(ax.get_window_extent(), title)
    figure = fig.bbox
    assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 and figure.y0 <= legend.y0


def test_a_line_lying_on_another_is_dashed_over_it_and_named_in_the_legend():
    """Chapter 09's memory plot drew torch.compile's line exactly over ours."""
    points = [
        bench.Point(p, "bfloat16", x, v) for p in ("triton", "torch.compile") for x, v in ((2**10, 1.0), (2**12, 2.0))
    ]
    points += [bench.Point("torch", "bfloat16", x, 3.0 * x / 2**10) for x in (2**10, 2**12)]
    fig = bench.plot(copy_benchmark(unit=bench.MEMORY_UNIT), points, FAKE_ENV, live=False)
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels == ["triton", "torch", "torch.compile (same as triton)"]
    lines = {tuple(line.get_ydata()): line for line in fig.axes[0].get_lines()}
    ours, theirs = [line for line in fig.axes[0].get_lines() if list(line.get_ydata()) == [1.0, 2.0]]
    assert ours.get_linestyle() == "-" and theirs.get_linestyle() == "--"
    assert ours.get_marker() != theirs.get_marker() and len(lines) == 2


def test_large_rates_read_without_an_offset_or_exponent():
    """Chapter 12's throughput axis showed 1e6 above its ticks."""
    points = [bench.Point(p, "bfloat16", 16384, v) for p, v in (("torch", 1.23e6), ("triton", 1.8e6), ("limit", 7.3e6))]
    fig = bench.plot(copy_benchmark(unit="tokens/s", x_labels={16384: "a model"}), points, FAKE_ENV, live=False)
    fig.canvas.draw()
    (ax,) = fig.axes
    assert ax.yaxis.get_offset_text().get_text() == ""
    ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert "0" in ticks and all(t == "0" or t.endswith("M") for t in ticks), ticks
    assert bench.tick_text(2.0e6, 5e5, 8e6) == "2.0M"
    assert bench.tick_text(3000, 500, 3500) == "3,000"
    assert bench.tick_text(0.25, 0.25, 1.0) == "0.25"
    assert bench.tick_text(250e3, 50e3, 300e3) == "250k"


def test_category_names_wrap_at_spaces_and_dots():
    assert bench.wrap_label("autograd.grad, Python backward", 15) == "autograd.grad,\nPython backward"
    assert bench.wrap_label("autograd.Function.apply", 12) == "autograd.\nFunction.\napply"
    assert bench.wrap_label("short", 12) == "short"


def test_show_draws_for_a_reader_and_never_blocks_the_gallery_or_tests(monkeypatch):
    import matplotlib

    calls = []
    monkeypatch.setattr(plt, "show", lambda **kwargs: calls.append(("show", kwargs)))
    monkeypatch.setattr(plt, "pause", lambda seconds: calls.append(("pause", seconds)))
    monkeypatch.setattr(bench.atexit, "register", lambda fn: calls.append(("at exit", fn)) or fn)
    monkeypatch.setattr(bench, "_shown_at_exit", [])
    plt.figure()
    for backend, expected in [
        ("agg", []),  # the gallery and nbval under Agg: the scraper takes the figures
        ("module://matplotlib_inline.backend_inline", [("show", {})]),  # a notebook: an output now
        ("tkagg", [("show", {"block": False}), ("pause", 0.001), ("at exit", plt.show)]),  # a script
        ("qtagg", [("show", {"block": False}), ("pause", 0.001)]),  # the windows wait once, at exit
    ]:
        monkeypatch.setattr(matplotlib, "get_backend", lambda backend=backend: backend)
        calls.clear()
        bench.show()
        assert calls == expected, backend
    plt.close("all")


def test_the_gallery_scraper_shows_a_cells_figures_one_under_another_at_full_width(tmp_path):
    pytest.importorskip("sphinx_gallery")
    from stepkernels.lessons import tutorial

    def scrape(file_conf):
        plt.figure(), plt.figure()
        paths = iter([tmp_path / "one.png", tmp_path / "two.png"])
        block_vars = {"image_path_iterator": paths, "file_conf": file_conf, "example_globals": {}}
        conf = {"image_srcset": [], "compress_images": [], "matplotlib_animations": (False, None),
                "src_dir": str(tmp_path)}  # fmt: skip
        return tutorial.full_width_figures(None, block_vars, conf)

    rst = scrape({})
    assert rst.count("sphx-glr-single-img") == 2 and "sphx-glr-multi-img" not in rst
    assert scrape({"multi_image": "multi"}).count("sphx-glr-multi-img") == 2  # a file may ask for thumbnails


def test_each_block_names_its_software_once_and_lines_name_only_gpu_and_date(capsys, tmp_path):
    bench.forget_environment_line()
    for _ in range(2):
        bench.summarize(copy_benchmark(), POINTS, FAKE_ENV, live=False)
    out = capsys.readouterr().out
    assert out.count("driver 1.2.3") == 1 and out.count("recorded on Some GPU 80GB, 2026-11-22") == 2
    results = bench.Results(copy_benchmark(), POINTS, FAKE_ENV, live=False)
    assert results.how == "recorded on Some GPU 80GB, 2026-11-22"
    assert "driver 1.2.3" in results.environment


def test_the_full_table_is_there_when_asked(capsys):
    timed = [bench.Point(p.provider, p.dtype, p.x, p.value, call=p.value / 2, cpu_us=12.0) for p in POINTS]
    results = bench.Results(copy_benchmark(), timed, FAKE_ENV, live=False)
    table = results.table()
    assert table.splitlines()[0] == "copy, float32, at 4,096 (elements), recorded on Some GPU 80GB, 2026-11-22:"
    assert "triton" in table.splitlines()[1] and "90% of 3,000" in table and "12.0 µs of CPU per call" in table


def test_categories_are_named_not_numbered_in_summaries_and_recorded_tables(tmp_path, capsys):
    names = {0: "softmax", 1: "layer_norm"}
    points = [bench.Point(p, "float16", x, v) for p, x, v in [("triton", 0, 30.0), ("torch", 0, 7.0),
                                                             ("triton", 1, 40.0), ("torch", 1, 9.0)]]  # fmt: skip
    labelled = copy_benchmark(x_labels=names, unit=bench.CPU_UNIT, headline_x=0)
    bench.summarize(labelled, points, FAKE_ENV)
    assert '  float32, "softmax": triton 30.0' in capsys.readouterr().out.replace("float16", "float32")
    bench.record(labelled, points, FAKE_ENV, results_dir=tmp_path)
    found = bench.load_recorded("copy", results_dir=tmp_path)
    assert bench.as_recorded(copy_benchmark(), found[1]).x_labels == {0: "softmax", 1: "layer_norm"}
    header = table_rows(results_table_tool().results_rst(tmp_path))[0]
    assert header == ["dtype", "provider", "softmax", "layer\\_norm"]


def test_no_page_shows_an_absolute_path_of_the_machine_that_built_it(tmp_path, monkeypatch, capsys):
    if ON_GPU:
        pytest.skip("on a GPU run measures instead")
    monkeypatch.setenv("STEPKERNELS_RESULTS", str(tmp_path))
    bench.run(copy_benchmark(make=lambda provider, n, dtype: lambda: None))
    out = capsys.readouterr().out
    assert "No recorded GPU results for 'copy'" in out and str(tmp_path) not in out
    assert bench.shown_path(bench.PACKAGE_RESULTS / "some-gpu" / "copy.csv") == "stepkernels/results/some-gpu/copy.csv"


# ------------------------------------------------------------ a quick run on a GPU, faked
class FakeGPU:
    """Stands in for a GPU in ``bench.run``: measuring returns, for each x value asked, a
    point per provider at 0.8 times the recorded value, and logs the x values asked."""

    ENV = {**FAKE_ENV, "gpu": "Other GPU 24GB", "date": "2026-12-01", "limits": {"GB/s": 900.0}}

    def __init__(self, monkeypatch, tmp_path, recorded=True):
        self.asked = []
        if recorded:
            bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
        monkeypatch.setenv("STEPKERNELS_RESULTS", str(tmp_path))
        for name in ("STEPKERNELS_RECORD", "STEPKERNELS_FULL", "STEPKERNELS_ONLY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(bench, "ON_GPU", True)
        monkeypatch.setattr(bench, "gpu_name", lambda: self.ENV["gpu"])
        monkeypatch.setattr(bench, "environment", lambda: dict(self.ENV))
        monkeypatch.setattr(bench, "gpu_state", lambda: contextlib.nullcontext({}))
        monkeypatch.setattr(bench, "measure", self.measure)

    def measure(self, benchmark):
        self.asked.append(list(benchmark.x_values))
        value = {p.x: p.value for p in POINTS if p.provider == "triton"}
        return [bench.Point(p, "float32", x, 0.8 * value[x]) for x in benchmark.x_values for p in benchmark.providers]


def test_a_quick_run_measures_the_largest_size_over_the_recording(monkeypatch, tmp_path, capsys):
    gpu = FakeGPU(monkeypatch, tmp_path)
    results = bench.run(copy_benchmark())
    assert gpu.asked == [[2**12]]
    assert results.points == bench.load_recorded("copy")[0] and not results.live  # the prose quotes the recording
    assert [(p.provider, p.x, p.value) for p in results.measured] == [
        ("triton", 2**12, 2160.0),
        ("torch", 2**12, 2160.0),
    ]
    fig = plt.gcf()
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert "recorded on Some GPU 80GB" in labels and "measured now on Other GPU 24GB" in labels
    assert "markers: measured now on Other GPU 24GB" in fig._suptitle.get_text()
    out = " ".join(capsys.readouterr().out.split())
    assert "copy: measured now on Other GPU 24GB, beside the recording on Some GPU 80GB" in out
    assert "triton 2,160 GB/s (2,700 recorded), 240% of this GPU's copy bandwidth (900 GB/s)" in out
    assert not list(tmp_path.glob("other-gpu-24gb/*"))  # a quick run records nothing
    plt.close("all")


@pytest.mark.parametrize("setting", [None, "STEPKERNELS_FULL", "STEPKERNELS_RECORD"])
def test_choose_takes_the_full_cases_only_when_the_full_sweep_is_asked(setting, monkeypatch):
    """A chapter's checks: a few cases in a quick GPU run, all of them under STEPKERNELS_FULL=1
    or make bench, the CPU's under the interpreter whatever is set."""
    for name in ("STEPKERNELS_RECORD", "STEPKERNELS_FULL"):
        monkeypatch.delenv(name, raising=False)
    if setting:
        monkeypatch.setenv(setting, "1")
    monkeypatch.setattr(bench, "ON_GPU", True)
    assert bench.choose(gpu="few", cpu="small", full="all") == ("all" if setting else "few")
    assert bench.choose(gpu="few", cpu="small") == "few"  # no full: the GPU's value
    monkeypatch.setattr(bench, "ON_GPU", False)
    assert bench.choose(gpu="few", cpu="small", full="all") == "small"


@pytest.mark.parametrize("setting", ["STEPKERNELS_FULL", "STEPKERNELS_RECORD"])
def test_the_full_sweep_runs_when_asked_and_a_recording_is_always_one(setting, monkeypatch, tmp_path):
    gpu = FakeGPU(monkeypatch, tmp_path)
    monkeypatch.setenv(setting, "1")
    results = bench.run(copy_benchmark())
    assert gpu.asked == [[2**10, 2**12]] and results.live and results.measured is None
    written = tmp_path / "other-gpu-24gb" / "copy.csv"
    assert written.exists() == (setting == "STEPKERNELS_RECORD")
    if written.exists():
        assert {p.x for p in bench.read_points(written)} == {2**10, 2**12}
    plt.close("all")


def test_a_quick_run_without_a_recording_measures_the_quick_points_and_says_so(monkeypatch, tmp_path, capsys):
    gpu = FakeGPU(monkeypatch, tmp_path, recorded=False)
    results = bench.run(copy_benchmark())
    assert gpu.asked == [[2**12]] and results.live and "STEPKERNELS_FULL=1" in capsys.readouterr().out
    plt.close("all")


def test_a_quick_run_leaves_torch_compile_to_the_recording(monkeypatch, tmp_path):
    gpu = FakeGPU(monkeypatch, tmp_path)
    measured = []
    monkeypatch.setattr(bench, "measure", lambda b: measured.append(list(b.providers)) or gpu.measure(b))
    results = bench.run(copy_benchmark(providers=["triton", "torch", "torch.compile"]), draw=False)
    assert measured == [["triton", "torch"]] and not results.live
    monkeypatch.setenv("STEPKERNELS_FULL", "1")
    bench.run(copy_benchmark(providers=["triton", "torch", "torch.compile"]), draw=False)
    assert measured[-1] == ["triton", "torch", "torch.compile"]  # the full sweep measures it


def test_a_quick_run_measures_only_the_quick_dtypes(monkeypatch, tmp_path):
    gpu = FakeGPU(monkeypatch, tmp_path)
    asked = []
    monkeypatch.setattr(bench, "measure", lambda b: asked.append(b.dtypes) or gpu.measure(b))
    two = copy_benchmark(name="two", dtypes=(torch.float32, torch.float16), quick_dtypes=(torch.float32,))
    halves = [bench.Point(p.provider, "float16", p.x, p.value / 2) for p in POINTS]
    bench.record(two, POINTS + halves, FAKE_ENV, results_dir=tmp_path)
    results = bench.run(two)  # drawn: both dtypes recorded, fp32 measured over them
    assert asked == [(torch.float32,)] and not results.live
    assert {p.dtype for p in results.measured} == {"float32"}
    assert {p.dtype for p in results.points} == {"float32", "float16"}
    assert len(plt.gcf().axes) >= 2  # a panel for each recorded dtype
    plt.close("all")
    monkeypatch.setenv("STEPKERNELS_FULL", "1")
    assert bench.run(two, draw=False).live and asked[-1] == (torch.float32, torch.float16)


def test_a_quick_run_without_quick_dtypes_shows_the_recording_or_measures_all(monkeypatch, tmp_path, capsys):
    """quick_dtypes=(): a quick run measures nothing where a recording exists (a chapter's
    benchmarks whose kernels nothing else compiles), and every size where none does."""
    gpu = FakeGPU(monkeypatch, tmp_path)
    results = bench.run(copy_benchmark(quick_dtypes=()), draw=False)
    assert gpu.asked == [] and not results.live and results.measured is None
    assert results.points == bench.load_recorded("copy")[0]
    assert "copy: not measured in a quick run (STEPKERNELS_FULL=1 measures it)" in capsys.readouterr().out
    results = bench.run(copy_benchmark(name="unrecorded", quick_dtypes=()), draw=False)
    assert gpu.asked == [[2**10, 2**12]] and results.live


def test_which_x_values_a_quick_run_measures():
    assert bench.quick_x_values(copy_benchmark(x_values=[2**16, 2**10, 2**12])) == [2**16]
    assert bench.quick_x_values(copy_benchmark(x_values=[0, 1, 2], x_labels={0: "a", 1: "b", 2: "c"})) == [0, 1, 2]
    assert bench.quick_x_values(copy_benchmark(x_values=[4096])) == [4096]


def test_a_quick_run_of_a_measurement_not_timed_by_bench(monkeypatch, tmp_path):
    """``points_of`` (a training run, say) runs in a quick run only through ``quick``; without it
    the recording shows, unless there is none."""
    FakeGPU(monkeypatch, tmp_path)
    ran = []
    full = lambda: ran.append("full") or POINTS
    short = lambda: ran.append("quick") or POINTS[2:]
    shown = bench.run(copy_benchmark(), full, draw=False)
    assert ran == [] and not shown.live and shown.points == bench.load_recorded("copy")[0]
    shown = bench.run(copy_benchmark(), full, draw=False, quick=short)
    assert ran == ["quick"] and shown.measured == POINTS[2:]
    assert bench.run(copy_benchmark(name="unrecorded"), full, draw=False, quick=short).live and ran[-1] == "full"
    monkeypatch.setenv("STEPKERNELS_FULL", "1")
    assert bench.run(copy_benchmark(), full, draw=False, quick=short).live and ran[-1] == "full"
