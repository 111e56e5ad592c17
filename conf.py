"""Sphinx configuration: the gallery of chapters in tutorials/, the pages in docs/.

Built with ``make html`` (sphinx-build -c . docs build/html). Chapters execute during the
build: at full size on a GPU, at reduced size under Triton's interpreter without one. They
import the package ``stepkernels`` (src/), installed in the build's environment.
"""

import os
from pathlib import Path
import sys

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from gallery_stamp import package_changed  # noqa: E402

os.environ.setdefault("MPLBACKEND", "agg")

project = "Triton Kernels, Step by Step"
author = "the project's authors"
copyright = "2026, the project's authors"

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

# The first cell of every notebook: one visible step that installs the package the chapter
# imports (skipped where it is installed already, as in this repository's environment).
NOTEBOOK_SETUP_CELL = """\
# Setup: the chapters import their kernels, timing and plots from the package stepkernels.
# Where it is installed (pip install <clone of the repository> or <wheel>), this does
# nothing; elsewhere it installs it. Without a GPU the kernels run under Triton's
# interpreter, on Linux (see "Running the tutorials" for other systems).
%matplotlib inline
import importlib.util

if importlib.util.find_spec("stepkernels") is None:
    %pip install --quiet stepkernels matplotlib"""


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
    "plot_gallery": "True",
    "run_stale_examples": package_changed(),
    "min_reported_time": 1,
}
