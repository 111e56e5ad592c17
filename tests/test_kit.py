import csv
import importlib.util
import json
import os
import subprocess
import sys

import kit
import matplotlib.pyplot as plt
import pytest
import torch
from conftest import ROOT

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
    return kit.Benchmark(**{**fields, **overrides})


POINTS = [
    kit.Point("triton", "float32", 2**10, 1500.0),
    kit.Point("torch", "float32", 2**10, 1400.0),
    kit.Point("triton", "float32", 2**12, 2700.0),
    kit.Point("torch", "float32", 2**12, 2600.0),
]


def test_without_a_gpu_kernels_run_interpreted_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert kit.INTERPRET and not kit.ON_GPU and kit.DEVICE.type == "cpu"
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert kit.choose(gpu=10**9, cpu=10) == 10
    assert kit.autotune_configs(["a", "b", "c"]) == ["a"]


def test_importing_kit_after_triton_is_refused_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    probe = subprocess.run(
        [sys.executable, "-c", "import triton, kit"], env=env, capture_output=True, text=True, cwd=ROOT / "tutorials"
    )
    assert probe.returncode != 0 and "import kit before triton" in probe.stderr


def test_check_tensor_accepts_a_good_input():
    kit.check_tensor(torch.ones(3, device=kit.DEVICE), "x", (torch.float32,))


def test_record_writes_exactly_the_agreed_columns(tmp_path):
    path = kit.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    assert path == tmp_path / "some-gpu-80gb" / "copy.csv"
    with path.open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["benchmark", "provider", "dtype", "x_name", "x", "value", "unit"]
    assert rows[1] == ["copy", "triton", "float32", "elements", "1024", "1500", "GB/s"]
    env = json.loads((path.parent / "environment.json").read_text())
    assert env["gpu"] == "Some GPU 80GB" and env["benchmarks"]["copy"]["triton"] == "3.6.0"


def test_recorded_points_come_back_as_written(tmp_path):
    kit.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    points, env = kit.load_recorded("copy", results_dir=tmp_path)
    assert [(p.provider, p.x, p.value) for p in points] == [(p.provider, p.x, p.value) for p in POINTS]
    assert env["date"] == "2026-11-22"
    assert kit.load_recorded("missing", results_dir=tmp_path) is None


def test_newest_recording_is_shown(tmp_path, monkeypatch):
    kit.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    kit.record(copy_benchmark(), POINTS, {**FAKE_ENV, "gpu": "Other GPU", "date": "2026-12-01"}, results_dir=tmp_path)
    assert kit.recorded_gpu_dir(tmp_path).name == "other-gpu"
    monkeypatch.setenv("KIT_RESULTS_GPU", "some-gpu-80gb")
    assert kit.recorded_gpu_dir(tmp_path).name == "some-gpu-80gb"


def test_plot_says_recorded_and_draws_the_limit():
    fig = kit.plot(copy_benchmark(), POINTS, FAKE_ENV, live=False)
    assert "recorded on Some GPU 80GB" in fig._suptitle.get_text()
    (ax,) = fig.axes
    assert any(list(line.get_ydata()) == [3000.0, 3000.0] for line in ax.get_lines())


def test_cpu_time_benchmarks_plot_and_summarize_without_a_limit(capsys):
    bench = copy_benchmark(unit=kit.CPU_UNIT)
    points = [kit.Point("triton", "float32", 2**12, 360.0), kit.Point("torch", "float32", 2**12, 120.0)]
    fig = kit.plot(bench, points, FAKE_ENV, live=True)
    (ax,) = fig.axes
    assert all(len(line.get_xdata()) != 2 or line.get_ydata()[0] != line.get_ydata()[1] for line in ax.get_lines())
    assert ax.get_ylabel() == kit.CPU_UNIT
    kit.summarize(bench, points, FAKE_ENV)
    out = capsys.readouterr().out
    assert "360.0 µs of CPU per call" in out and "% of" not in out


def test_results_table_shows_cpu_time_without_a_share(tmp_path):
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "tools" / "results_table.py")
    results_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_table)
    points = [kit.Point("triton", "float32", 2**10, 364.0), kit.Point("triton", "float32", 2**12, 300.0)]
    kit.record(copy_benchmark(unit=kit.CPU_UNIT), points, FAKE_ENV, results_dir=tmp_path)
    markdown = results_table.results_markdown(tmp_path)
    assert "| float32 | triton | 364 | 300 |" in markdown


def test_summary_states_the_share_of_the_limit(capsys):
    kit.summarize(copy_benchmark(), POINTS, FAKE_ENV)
    assert "90.0% of 3,000" in capsys.readouterr().out


def test_run_without_a_gpu_smoke_runs_providers_and_shows_no_timings(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    calls = []
    bench = copy_benchmark(make=lambda provider, n, dtype: lambda: calls.append((provider, n)))
    monkeypatch.setattr(kit, "RESULTS_DIR", tmp_path)
    kit.run(bench)
    assert calls == [("triton", 16), ("torch", 16)]
    assert "No recorded GPU results for 'copy'" in capsys.readouterr().out
    assert not plt.get_fignums()


def test_run_without_a_gpu_plots_the_recording(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    kit.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    monkeypatch.setattr(kit, "RESULTS_DIR", tmp_path)
    kit.run(copy_benchmark())
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
    kit.record(copy_benchmark(), POINTS, FAKE_ENV, results_dir=tmp_path)
    markdown = results_table.results_markdown(tmp_path)
    assert "### Some GPU 80GB" in markdown
    assert "| float32 | triton | 1,500 (50%) | 2,700 (90%) |" in markdown


def test_downloaded_notebook_writes_its_own_kit(tmp_path):
    spec = importlib.util.spec_from_file_location("conf", ROOT / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    cell = conf.notebook_setup_cell().replace("%matplotlib inline\n", "")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = cell + "\nimport kit\nprint(kit.DEVICE)\n"
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "kit.py").read_text() == (ROOT / "tutorials" / "kit.py").read_text()


def test_load_chapter_is_quiet_and_cached(capsys):
    import sys

    sys.modules.pop("chapter_01", None)
    module = kit.load_chapter("01")
    assert capsys.readouterr().out == ""
    assert kit.load_chapter("01") is module and callable(module.add)
    sys.modules.pop("chapter_01", None)


def test_load_chapter_missing_says_what_to_do():
    with pytest.raises(FileNotFoundError, match="download it"):
        kit.load_chapter("99")


def test_activation_reference_rejects_unknown_names():
    with pytest.raises(ValueError, match="choose one of"):
        kit.activation_reference(torch.ones(2), "swish")


@pytest.mark.parametrize("activation", kit.ACTIVATIONS)
def test_activations_and_derivatives_match_torch(activation):
    import triton
    import triton.language as tl

    @triton.jit
    def evaluate(z_ptr, y_ptr, dy_ptr, ACTIVATION: tl.constexpr):
        offsets = tl.arange(0, 128)
        z = tl.load(z_ptr + offsets)
        tl.store(y_ptr + offsets, kit.apply_activation(z, ACTIVATION))
        tl.store(dy_ptr + offsets, kit.activation_derivative(z, ACTIVATION))

    z = torch.linspace(-4, 4, 128, device=kit.DEVICE).requires_grad_()
    y, dy = torch.empty_like(z), torch.empty_like(z)
    evaluate[(1,)](z.detach(), y, dy, ACTIVATION=activation)
    expected = kit.activation_reference(z, activation)
    expected.sum().backward()
    torch.testing.assert_close(y, expected.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dy, z.grad, atol=1e-6, rtol=1e-5)


def test_show_refusals_prints_each_error_and_fails_on_accepted_input(capsys):
    def refuse():
        raise ValueError("pass a tensor")

    kit.show_refusals("f()", {"bad": refuse})
    assert "bad: pass a tensor" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="f\\(\\) accepted bad input: silent"):
        kit.show_refusals("f()", {"bad": refuse, "silent": lambda: None})


def test_every_provider_of_a_plot_gets_its_own_color(monkeypatch):
    providers = ["triton", "triton (portable)", "torch", "liger_kernel", "torch.compile"]
    colors = kit.provider_colors(providers)
    assert colors["triton"] == kit.STYLE["triton"] and colors["torch"] == kit.STYLE["torch"]
    assert len(set(colors.values())) == len(providers)
    monkeypatch.setitem(kit.STYLE, "liger_kernel", kit.OTHER_COLORS[0])  # as chapter 03 does
    assert len(set(kit.provider_colors(providers).values())) == len(providers)


def test_loaded_by_another_chapter_only_inside_a_quiet_load(monkeypatch):
    assert not kit.loaded_by_another_chapter()
    monkeypatch.setattr(kit, "_quiet_loads", 1)  # as inside load_chapter(..., quiet=True)
    assert kit.loaded_by_another_chapter()


def test_rate_converts_work_per_millisecond_into_the_unit(monkeypatch):
    monkeypatch.setattr(kit, "measure_ms", lambda fn: (0.5, 0.4, 0.6))
    assert kit.rate(3e9, None) == pytest.approx(6000.0)  # 3 GB in 0.5 ms: 6,000 GB/s
    assert kit.rate(2e12, None, "TFLOP/s") == pytest.approx(4000.0)


def test_per_time_is_work_over_seconds_in_the_unit():
    assert kit.per_time(3e9, 0.5, "GB/s") == pytest.approx(6000.0)
    assert kit.per_time(2e12, 0.5, "TFLOP/s") == pytest.approx(4000.0)
