"""Write every chapter as a Jupyter notebook, exactly as the gallery build does.

    python tools/make_notebooks.py OUTPUT_DIR

Uses the gallery's own first cell from conf.py, so the notebooks that nbval executes are the
ones readers download.
"""

import importlib.util
from pathlib import Path
import shutil
import sys

from sphinx_gallery.notebook import python_to_jupyter_cli

ROOT = Path(__file__).resolve().parent.parent


def setup_cell() -> str:
    """conf.py's NOTEBOOK_SETUP_CELL (importing conf.py only defines names)."""
    spec = importlib.util.spec_from_file_location("gallery_conf", ROOT / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf.NOTEBOOK_SETUP_CELL


def main(output_dir: str) -> None:
    settings = {"first_notebook_cell": setup_cell()}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    chapters = sorted((ROOT / "tutorials").glob("[0-9][0-9]-*.py"))
    for chapter in chapters:
        shutil.copy(chapter, out / chapter.name)
    python_to_jupyter_cli([str(out / c.name) for c in chapters], sphinx_gallery_conf=settings)
    for chapter in chapters:
        (out / chapter.name).unlink()


if __name__ == "__main__":
    main(*sys.argv[1:])
