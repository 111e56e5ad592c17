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
    assert "360.0 µs of CPU per call" in out and "% of" not in out


def test_results_table_shows_cpu_time_without_a_share(tmp_path):
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "tools" / "results_table.py")
    results_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_table)
    points = [bench.Point("triton", "float32", 2**10, 364.0), bench.Point("triton", "float32", 2**12, 300.0)]
    bench.record(copy_benchmark(unit=bench.CPU_UNIT), points, FAKE_ENV, results_dir=tmp_path)
    markdown = results_table.results_markdown(tmp_path)
    assert "| float32 | triton | 364 | 300 |" in markdown


def test_summary_states_the_share_of_the_limit(capsys):
    bench.summarize(copy_benchmark(), POINTS, FAKE_ENV)
    assert "90.0% of 3,000" in capsys.readouterr().out


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
    lines = capsys.readouterr().out.splitlines()
    assert ["triton", "2,700.0", "GB/s", "90.0%", "of", "3,000"] in [line.split() for line in lines]


def test_readme_results_table_is_up_to_date():
    table = subprocess.run(
        [sys.executable, "tools/results_table.py", "README.md", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert table.returncode == 0, table.stderr


def test_results_table_reads_recordings(tmp_path):
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "tools" / "results_table.py")
    results_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_table)
    bench.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    markdown = results_table.results_markdown(tmp_path)
    assert "### Some GPU 80GB" in markdown
    assert "| float32 | triton | 1,500 (50%) | 2,700 (90%) |" in markdown


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
    bench.summarize(copy_benchmark(), POINTS, FAKE_ENV, live=False)
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "copy, float32, at 4,096 (elements), recorded 2026-11-22 on Some GPU 80GB:"


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
    assert line == ("float32: triton at or above every peer at 1 of 2 points; 1,500 to 2,700 GB/s, "
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
    assert "broken at elements=1024: skipped" in capsys.readouterr().out
