"""The package and its chapters are one source: tools/export.py, the wheel, the lessons' size."""

import importlib.util
from pathlib import Path
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "tutorials").glob("[0-9][0-9]-*.py"))
spec = importlib.util.spec_from_file_location("export", ROOT / "tools" / "export.py")
export = importlib.util.module_from_spec(spec)
spec.loader.exec_module(export)


def test_the_package_modules_are_what_the_chapters_say():
    ran = subprocess.run([sys.executable, "tools/export.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr


def test_saved_cells_are_read_up_to_the_next_cell(tmp_path):
    chapter = tmp_path / "09-example.py"
    chapter.write_text(
        '"""\nAn example\n==========\n"""\n\n'
        "# %%\n# Text of the first cell.\n\n# @save ops/example\nimport torch\n\nA = 1\n\n"
        "# %%\n# Not saved.\n\nB = 2\n\n"
        "# %%\n# Saved, without the space.\n\n#@save ops/example\nC = 3\n"
    )
    assert export.saved_cells(chapter) == [("ops/example", "import torch\n\nA = 1"), ("ops/example", "C = 3")]
    assert export.title(chapter) == "An example"
    chapter.write_text(chapter.read_text().replace("#@save ops/example", "# @save example"))
    with pytest.raises(SystemExit, match="names no WING/NAME"):  # a marker without its wing
        export.saved_cells(chapter)


def test_export_check_fails_when_a_chapter_changes_and_write_mends_it(tmp_path, monkeypatch):
    chapters, package = tmp_path / "tutorials", tmp_path / "src"
    chapters.mkdir()
    package.mkdir()
    chapter = chapters / "01-example.py"
    chapter.write_text('"""\nExample\n=======\n"""\n\n# %%\n# A kernel.\n\n# @save ops/example\nX = 1\n')
    monkeypatch.setattr(export, "ROOT", tmp_path)
    monkeypatch.setattr(export, "CHAPTERS", chapters)
    monkeypatch.setattr(export, "PACKAGE", package)
    export.main()
    export.main("--check")
    chapter.write_text(chapter.read_text().replace("X = 1", "X = 2"))
    with pytest.raises(SystemExit, match="make export"):
        export.main("--check")
    export.main()
    assert "X = 2" in (package / "ops" / "example.py").read_text()
    chapter.write_text(chapter.read_text().replace("# @save ops/example", ""))
    export.main()
    assert not (package / "ops" / "example.py").exists()  # generated, and no chapter saves into it now


def test_the_wheel_holds_the_modules_and_the_recorded_results(tmp_path):
    # Built from a copy: setuptools would otherwise add what a stale build/ holds.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ran = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path, source],
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    (wheel,) = tmp_path.glob("stepkernels-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "src" / "stepkernels"
    modules = {path.relative_to(package.parent).as_posix() for path in package.glob("**/*.py")}
    assert modules <= names
    recorded = [name for name in names if name.startswith("stepkernels/results/") and name.endswith(".csv")]
    assert any(name.endswith("/environment.json") for name in names) and len(recorded) >= 10
    # The lab's logs, notes and scripts stay out of the wheel.
    assert not [name for name in names if name.endswith((".log", ".md")) or "/experiments/" in name]


def test_the_gallery_reruns_its_chapters_when_the_package_changes(tmp_path):
    spec = importlib.util.spec_from_file_location("gallery_stamp", ROOT / "tools" / "gallery_stamp.py")
    stamp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stamp)
    package, stamp_file = tmp_path / "package", tmp_path / "build" / ".stamp"
    (package / "results").mkdir(parents=True)
    (package / "ops.py").write_text("X = 1\n")
    assert stamp.package_changed(stamp_file, package)  # first build
    assert not stamp.package_changed(stamp_file, package)  # nothing changed
    (package / "results" / "bench.csv").write_text("a new recording\n")
    assert stamp.package_changed(stamp_file, package)
    (package / "ops.py").write_text("X = 2\n")
    assert stamp.package_changed(stamp_file, package)


def test_the_public_names_are_the_functions_and_modules_of_the_redesign():
    import types

    import stepkernels

    expected = {"softmax", "log_softmax", "layer_norm", "LayerNorm", "matmul", "linear", "FusedLinear"}
    expected |= {"dropout", "dropout_bias_act", "Dropout", "DropoutBiasAct", "add"}
    expected |= {"cross_entropy", "linear_cross_entropy", "attention", "GPT", "GPTConfig"}
    expected |= {"rms_norm", "RMSNorm", "rotary_embedding", "rotary_embedding_qk", "silu_mul"}
    expected |= {"FusedAdamW", "add_layer_norm"}  # chapter 15
    expected |= {"varlen_attention"}  # chapter 11: packed sequences
    assert set(stepkernels.__all__) == expected
    for name in expected:
        public = getattr(stepkernels, name)
        assert callable(public) and not isinstance(public, types.ModuleType), name


def test_export_leaves_hand_written_modules_alone(tmp_path, monkeypatch):
    chapters, package = tmp_path / "tutorials", tmp_path / "src"
    chapters.mkdir()
    package.mkdir()
    (package / "__init__.py").write_text('"""Hand-written; its modules are written by tools/export.py."""\n')
    monkeypatch.setattr(export, "ROOT", tmp_path)
    monkeypatch.setattr(export, "CHAPTERS", chapters)
    monkeypatch.setattr(export, "PACKAGE", package)
    export.main()
    export.main("--check")
    assert (package / "__init__.py").exists()
