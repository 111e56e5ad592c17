"""Sphinx configuration: the gallery of chapters in tutorials/, the pages in docs/.

Built with ``make html`` (sphinx-build -c . docs build/html). Chapters execute during the
build: at full size on a GPU, at reduced size under Triton's interpreter without one. They
import the package ``stepkernels`` (src/), installed in the build's environment.

``make test`` builds the same pages with ``-D plot_gallery=0``: the chapters ran once already,
as notebooks under nbval, so this build does not execute them again.
"""

import os
from pathlib import Path
import re
import shutil
import sys
import zipfile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from gallery_stamp import package_changed  # noqa: E402

os.environ.setdefault("MPLBACKEND", "agg")

project = "Triton Kernels, Step by Step"
author = "the project's authors"
copyright = "2026, the project's authors"
release = version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
# The wheel that `make html` builds (make wheel) and ships beside every notebook.
WHEEL = f"stepkernels-{version}-py3-none-any.whl"

# sphinx_mathjax_offline ships MathJax and serves it from the pages' own _static folder: the
# maths renders with no network.
extensions = [
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # the module is named so
    "sphinx_copybutton",
    "sphinx_gallery.gen_gallery",
]
exclude_patterns = ["_build"]
html_theme = "pydata_sphinx_theme"
html_title = project
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2}
html_show_sourcelink = False
# Room for a line of 88 columns, the chapters' formatting, in the article (docs/_static).
html_static_path = ["docs/_static"]
html_css_files = ["wider-code.css"]
# |wheel|_ in a page at the top of the site names the wheel and links to it (make html ships it).
rst_epilog = f".. |wheel| replace:: {WHEEL}\n.. _wheel: _downloads/{WHEEL}\n"

# The first cell of every notebook (tools/make_notebooks.py reads it from here, so the notebooks
# that nbval runs are the ones readers download). The package is not on PyPI, and a name there
# that we do not own is never installed: the cell installs the wheel shipped beside the notebook
# or stops and says how to install. Then it says where the kernels will run.
NOTEBOOK_SETUP_CELL = f"""\
# Setup. The chapters import their kernels, timing and plots from the package stepkernels,
# which is not on PyPI. Where it is not installed, this cell installs the wheel that the
# gallery ships beside this notebook ({WHEEL}: each chapter's
# "Download zipped" holds both), and never a package of that name from an index. Then it
# says where the kernels run: on this GPU, or under Triton's interpreter without one.
import importlib
import importlib.util
import os
from pathlib import Path

WHEEL = Path("{WHEEL}")
if importlib.util.find_spec("stepkernels") is None:
    if not WHEEL.is_file():
        raise ModuleNotFoundError(
            f"stepkernels is not installed, and {{WHEEL}} is not beside this notebook (in "
            f"{{Path.cwd()}}). Put it there (each chapter's 'Download zipped' holds it) and run "
            "this cell again, or install from a clone of the repository: "
            "pip install <path to the clone>"
        )
    %pip install --quiet ./{{WHEEL}}[plots]
    importlib.invalidate_caches()

%matplotlib inline
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    major, minor = torch.cuda.get_device_capability()
    print(f"GPU: {{torch.cuda.get_device_name()}}, compute capability {{major}}.{{minor}}")
    missing = [
        what
        for what, runs in [
            ("bfloat16 (needs sm_80 or newer)", (major, minor) >= (8, 0)),
            ("float8 e4m3 (needs sm_89 or newer)", (major, minor) >= (8, 9)),
            ("chapter 07's Hopper kernel (9.x only; it runs chapter 04's)", major == 9),
        ]
        if not runs
    ]
    print("Not on this GPU: " + "; ".join(missing) if missing else "Every chapter runs in full.")
else:
    print("No GPU: the kernels run under Triton's interpreter on the CPU, at reduced sizes,")
    print("and the plots show results recorded on a GPU.")"""


sphinx_gallery_conf = {
    "examples_dirs": "../tutorials",
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/\d\d-",
    "ignore_pattern": r"__init__\.py",
    "within_subsection_order": "FileNameSortKey",
    "first_notebook_cell": NOTEBOOK_SETUP_CELL,
    "notebook_images": True,
    "image_srcset": ["2x"],  # plots sharp on high-DPI screens
    # A cell's figures one under another at full width, not side by side as thumbnails.
    "image_scrapers": ("stepkernels.lessons.tutorial.full_width_figures",),
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "download_all_examples": True,
    "show_signature": False,
    "min_reported_time": 1,
}


def executing(config) -> bool:
    """Whether this build runs the chapters: sphinx-gallery's plot_gallery (-D plot_gallery=0)."""
    return str(config.plot_gallery).strip().lower() not in ("0", "false", "no", "")


def rerun_when_the_package_changed(app, config) -> None:
    # Only a build that executes may take the package's stamp: one that does not (make test)
    # would otherwise hide a package change from the next make html.
    config.sphinx_gallery_conf["run_stale_examples"] = executing(config) and package_changed()


def ship_the_wheel(app, exception) -> None:
    """Put the wheel beside every notebook of the built pages, and into their zip files."""
    if exception is not None or app.builder.format != "html" or not executing(app.config):
        return
    wheel = ROOT / "dist" / WHEEL
    if not wheel.is_file():
        raise FileNotFoundError(f"{wheel} is missing: make html builds it first (make wheel)")
    downloads = Path(app.outdir) / "_downloads"
    shutil.copy(wheel, downloads / WHEEL)
    for notebook in downloads.glob("*/*.ipynb"):
        shutil.copy(wheel, notebook.parent / WHEEL)
    for archive in downloads.glob("*/*.zip"):
        with zipfile.ZipFile(archive, "a") as bundle:
            if any(name.endswith(".ipynb") for name in bundle.namelist()) and WHEEL not in bundle.namelist():
                bundle.write(wheel, WHEEL)


def setup(app):
    # Before sphinx-gallery's own config-inited handler (priority 10) copies its settings.
    app.connect("config-inited", rerun_when_the_package_changed, priority=5)
    app.connect("build-finished", ship_the_wheel)
