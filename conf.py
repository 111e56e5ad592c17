"""Sphinx configuration: the gallery of chapters in tutorials/, the pages in docs/.

Built with ``make html`` (sphinx-build -c . docs build/html). Chapters execute during the
build: at full size on a GPU, at reduced size under Triton's interpreter without one.
"""

import os
import re
import sys
from pathlib import Path

import sphinx_gallery.gen_rst
import sphinx_gallery.notebook

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tutorials"))  # chapters import kit
os.environ.setdefault("MPLBACKEND", "agg")

project = "Triton Kernels, Step by Step"
author = "the project's authors"
copyright = "2026, the project's authors"

extensions = ["sphinx.ext.mathjax", "sphinx_copybutton", "sphinx_gallery.gen_gallery"]
exclude_patterns = ["_build"]
html_theme = "pydata_sphinx_theme"
html_title = project
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2}
html_show_sourcelink = False


def notebook_setup_cell() -> str:
    """The first cell of every notebook: makes ``kit`` importable wherever the notebook runs.

    Inside the project ``kit`` is on the path already. A notebook downloaded on its own writes
    the copy of ``tutorials/kit.py`` embedded here beside itself, so one file is all a reader
    needs, plus torch, triton and matplotlib.
    """
    return (
        "# Setup, added to every notebook. The chapters share one helper module, kit.py\n"
        "# (device detection, sizes, timing, plots). Inside the project it is importable\n"
        "# already; a notebook downloaded on its own writes the copy below beside itself.\n"
        "# Needs torch, triton and matplotlib (pip install torch triton matplotlib). Without\n"
        "# a GPU, kit runs the kernels under Triton's interpreter.\n"
        "%matplotlib inline\n"
        "import importlib.util\n"
        "import pathlib\n\n"
        'if importlib.util.find_spec("kit") is None:\n'
        + embed_file("kit.py", (ROOT / "tutorials" / "kit.py").read_text())
    )


def embed_file(name: str, source: str) -> str:
    """A setup-cell line, inside its ``if``, that writes ``source`` beside the notebook."""
    assert "'''" not in source, f"{name} is embedded in r''' quotes: use double quotes there"
    return f"    pathlib.Path({name!r}).write_text(r'''" + source + "''')\n"


def with_chapters_it_builds_on(make_notebook):
    """Wrap sphinx-gallery's notebook writer: a chapter that reuses another one's kernels
    (``kit.load_chapter("04")``) gets that chapter's script embedded in its setup cell too, so
    that its downloaded notebook still runs on its own."""

    def make(script_blocks, gallery_conf, target_dir):
        notebook = make_notebook(script_blocks, gallery_conf, target_dir)
        code = "".join(block.content for block in script_blocks if block.type == "code")
        for number in sorted(set(re.findall(r"kit\.load_chapter\(\"(\d\d)\"\)", code))):
            (path,) = (ROOT / "tutorials").glob(f"{number}-*.py")
            notebook["cells"][0]["source"] += [  # sphinx-gallery strips the last newline
                f"\n    # This chapter builds on chapter {number}: its script goes beside kit.py.\n",
                embed_file(path.name, path.read_text()).rstrip("\n"),
            ]
        return notebook

    return make


if not hasattr(sphinx_gallery.notebook, "unwrapped_jupyter_notebook"):  # wrap once
    sphinx_gallery.notebook.unwrapped_jupyter_notebook = sphinx_gallery.notebook.jupyter_notebook
    sphinx_gallery.gen_rst.jupyter_notebook = with_chapters_it_builds_on(sphinx_gallery.notebook.jupyter_notebook)
    sphinx_gallery.notebook.jupyter_notebook = sphinx_gallery.gen_rst.jupyter_notebook

sphinx_gallery_conf = {
    "examples_dirs": "../tutorials",
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/\d\d-",
    "ignore_pattern": r"kit\.py|__init__\.py",
    "within_subsection_order": "FileNameSortKey",
    "first_notebook_cell": notebook_setup_cell(),
    "notebook_images": True,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "download_all_examples": True,
    "show_signature": False,
    "plot_gallery": "True",
    "min_reported_time": 1,
}
