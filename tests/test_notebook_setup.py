"""The notebooks' first cell installs only what exists, and nothing we ship installs a name
from an index that is not ours to install: the package stepkernels is not on PyPI, so a
`pip install stepkernels` there would take whatever someone else published under that name."""

import importlib.util
import json
from pathlib import Path
import re
import subprocess
import sys
from types import SimpleNamespace
import zipfile

import pytest
import torch

# The cell runs in an IPython shell (IPython comes with ipykernel, a test requirement).
InteractiveShell = pytest.importorskip("IPython.core.interactiveshell").InteractiveShell

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gallery_conf", ROOT / "conf.py")
conf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conf)

REQUIREMENT_FILES = ["requirements.txt", "docs/requirements.txt", "tests/requirements.txt"]
TEXT_SUFFIXES = {".py", ".rst", ".md", ".txt", ".toml", ".cfg", ".sh", ".ipynb", ".yml", ".yaml"}
INSTALL = re.compile(r"\bpip3?\s+install\b")


def pinned_names() -> set[str]:
    """The third-party packages our requirement files pin: the only names we install by name."""
    names = set()
    for path in REQUIREMENT_FILES:
        for line in (ROOT / path).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                names.add(normalized(re.match(r"[A-Za-z0-9._-]+", line)[0]))
    return names


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_names(command: str) -> list[str]:
    """The package names a `pip install ...` text asks an index for; paths, placeholders such as
    <clone>, variables and options are not names."""
    names = []
    for match in INSTALL.finditer(command):
        rest = re.split(r"`|#|;|&&|\||\)|\"|'|\n", command[match.end() :])[0]
        rest = re.sub(r"<[^>]*>", " ", rest)  # <path to a clone>: a placeholder
        for token in rest.split():
            if token.startswith("-") or re.search(r"[/{}$*~]|^\.|\.(whl|zip|tar\.gz)$", token):
                continue  # an option or a path (-e ., ./file.whl[plots], dist/*.whl, $(VAR))
            if token in ("or", "and"):
                continue  # prose: pip install <clone> or <wheel>
            names.append(normalized(re.match(r"[A-Za-z0-9._-]*", token)[0]))
    return [name for name in names if name]


def commands_in(path: Path) -> list[str]:
    """The texts of a file in which a pip command may stand: each line, and in prose each inline
    literal with its line breaks joined (``pip install`` may wrap)."""
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        return ["".join(cell["source"]) for cell in cells]
    literal = {".rst": r"``(.+?)``", ".md": r"(?<!`)`([^`]+)`(?!`)"}.get(path.suffix)
    wrapped = re.findall(literal, text, re.S) if literal else []
    return text.splitlines() + [" ".join(words.split()) for words in wrapped]


def shipped_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        paths = [ROOT / line for line in listed.stdout.splitlines()]
    else:  # not a git checkout: everything but what the builds write
        skip = {".venv", "build", "dist", "data", ".git"}
        paths = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    this = Path(__file__).resolve()  # its examples of what the check catches
    return [
        p
        for p in paths
        if p.is_file() and p.resolve() != this and (p.suffix in TEXT_SUFFIXES or p.name in ("Makefile", "run"))
    ]


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory):
    out = tmp_path_factory.mktemp("notebooks")
    made = subprocess.run([sys.executable, "tools/make_notebooks.py", out], cwd=ROOT, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    return sorted(out.glob("*.ipynb"))


def test_the_parser_finds_a_name_and_passes_paths_and_placeholders():
    assert installed_names("%pip install --quiet stepkernels matplotlib") == ["stepkernels", "matplotlib"]
    assert installed_names("runs ``pip install stepkernels``. Then") == ["stepkernels"]
    assert installed_names("pip install <path to a clone of this repository>   # or: pip install -e <clone>") == []
    assert installed_names("%pip install --quiet ./{WHEEL}[plots]") == []
    assert installed_names("(pip install <clone of the repository> or <wheel>), this") == []
    assert installed_names("make wheel && pip install dist/stepkernels-*.whl  # or") == []
    assert installed_names("$(PY) -m pip install --quiet --no-deps -e .") == []


def test_every_notebook_starts_with_conf_py_setup_cell(notebooks):
    assert len(notebooks) == len(list((ROOT / "tutorials").glob("[0-9][0-9]-*.py")))
    for notebook in notebooks:
        first = next(c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code")
        assert "".join(first["source"]) == conf.NOTEBOOK_SETUP_CELL, notebook.name


def test_no_notebook_page_or_script_installs_a_name_we_do_not_pin(notebooks):
    allowed = pinned_names()
    assert "stepkernels" not in allowed and "torch" in allowed
    wrong = {}
    for path in shipped_files() + notebooks:
        for command in commands_in(path):
            for name in installed_names(command):
                if name not in allowed:
                    wrong.setdefault(path.name, []).append(name)
    assert not wrong, f"pip install of names that are not third-party pins of ours: {wrong}"


class Notebook:
    """The setup cell run by IPython itself, with %pip and %matplotlib recorded, not run."""

    def __init__(self):
        self.shell = InteractiveShell()
        self.magics = []
        for magic in ("pip", "matplotlib"):
            self.shell.register_magic_function(
                lambda line, magic=magic: self.magics.append(f"%{magic} {line}"), "line", magic
            )

    def run_setup_cell(self):
        try:
            return self.shell.run_cell(conf.NOTEBOOK_SETUP_CELL)
        finally:
            self.shell.cleanup()
            InteractiveShell.clear_instance()


@pytest.fixture
def missing_package(monkeypatch, tmp_path):
    """A notebook in an empty folder of an environment without stepkernels."""
    find_spec = importlib.util.find_spec
    hidden = lambda name, *rest: None if name == "stepkernels" else find_spec(name, *rest)
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_without_the_wheel_the_cell_stops_and_says_how_to_install(missing_package, capsys):
    notebook = Notebook()
    result = notebook.run_setup_cell()
    assert isinstance(result.error_in_exec, ModuleNotFoundError)
    message = str(result.error_in_exec)
    assert conf.WHEEL in message and "pip install <path to the clone>" in message
    assert not [magic for magic in notebook.magics if magic.startswith("%pip")]


def test_the_cell_installs_the_wheel_beside_the_notebook(missing_package):
    (missing_package / conf.WHEEL).write_bytes(b"")
    notebook = Notebook()
    assert notebook.run_setup_cell().success
    assert f"%pip install --quiet ./{conf.WHEEL}[plots]" in notebook.magics


def test_the_cell_names_the_interpreter_without_a_gpu(capsys):
    notebook = Notebook()
    assert notebook.run_setup_cell().success
    assert "No GPU: the kernels run under Triton's interpreter" in capsys.readouterr().out
    assert notebook.magics == ["%matplotlib inline"]  # installed already: nothing to install


@pytest.mark.parametrize(
    "capability, left_out",
    [
        ((7, 5), ["bfloat16", "float8", "Hopper"]),
        ((8, 0), ["float8", "Hopper"]),
        ((8, 9), ["Hopper"]),
        ((9, 0), []),
        ((10, 0), ["Hopper"]),
    ],
)
def test_the_cell_names_the_gpu_and_what_does_not_run_on_it(monkeypatch, capsys, capability, left_out):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    assert Notebook().run_setup_cell().success
    out = capsys.readouterr().out
    assert f"GPU: Some GPU, compute capability {capability[0]}.{capability[1]}" in out
    for what in ["bfloat16", "float8", "Hopper"]:
        assert (what in out) == (what in left_out), out
    assert ("Every chapter runs in full" in out) == (not left_out)


def built_pages(root: Path, plot_gallery: str):
    """A built site's _downloads as sphinx-gallery leaves it: a notebook, a chapter's zip of
    script and notebook, a zip of scripts alone; and the Sphinx app that built it."""
    downloads = root / "html" / "_downloads"
    for folder in "abc":
        (downloads / folder).mkdir(parents=True)
    (downloads / "a" / "01-x.ipynb").write_text("{}")
    with zipfile.ZipFile(downloads / "b" / "01-x.zip", "w") as bundle:
        bundle.writestr("01-x.py", "")
        bundle.writestr("01-x.ipynb", "{}")
    with zipfile.ZipFile(downloads / "c" / "tutorials_python.zip", "w") as bundle:
        bundle.writestr("01-x.py", "")
    app = SimpleNamespace(
        builder=SimpleNamespace(format="html"), config=SimpleNamespace(plot_gallery=plot_gallery), outdir=root / "html"
    )
    return downloads, app


def test_make_html_ships_the_wheel_beside_every_notebook(tmp_path, monkeypatch):
    monkeypatch.setattr(conf, "ROOT", tmp_path)
    downloads, app = built_pages(tmp_path, plot_gallery="True")
    with pytest.raises(FileNotFoundError, match="make wheel"):
        conf.ship_the_wheel(app, None)
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / conf.WHEEL).write_bytes(b"the wheel")
    conf.ship_the_wheel(app, None)
    assert (downloads / conf.WHEEL).read_bytes() == (downloads / "a" / conf.WHEEL).read_bytes() == b"the wheel"
    assert zipfile.ZipFile(downloads / "b" / "01-x.zip").read(conf.WHEEL) == b"the wheel"
    assert conf.WHEEL not in zipfile.ZipFile(downloads / "c" / "tutorials_python.zip").namelist()


def test_make_test_gallery_build_neither_executes_nor_ships(tmp_path, monkeypatch):
    monkeypatch.setattr(conf, "ROOT", tmp_path)  # no wheel there: shipping would fail
    downloads, app = built_pages(tmp_path, plot_gallery="0")
    conf.ship_the_wheel(app, None)
    assert not list(downloads.rglob(conf.WHEEL))
    monkeypatch.setattr(conf, "package_changed", lambda: pytest.fail("took the package stamp"))
    config = SimpleNamespace(plot_gallery="0", sphinx_gallery_conf={})
    conf.rerun_when_the_package_changed(app, config)
    assert config.sphinx_gallery_conf["run_stale_examples"] is False


def test_the_wheel_make_wheel_builds_is_the_one_the_cell_installs():
    version = re.search(r'^__version__ = "(.+)"', (ROOT / "src/stepkernels/__init__.py").read_text(), re.M)[1]
    assert conf.WHEEL == f"stepkernels-{version}-py3-none-any.whl"  # pyproject's version is the package's
