"""Write every chapter as a Jupyter notebook, exactly as the gallery build does.

    python tools/make_notebooks.py OUTPUT_DIR

Uses the gallery's own setup cell from conf.py, so the notebooks that nbval executes are
the ones readers download.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

from sphinx_gallery.notebook import python_to_jupyter_cli

ROOT = Path(__file__).resolve().parent.parent


def main(output_dir: str) -> None:
    spec = importlib.util.spec_from_file_location("conf", ROOT / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    # The chapters draw their pictures with code, so the setup cell is the only setting needed.
    settings = {"first_notebook_cell": conf.sphinx_gallery_conf["first_notebook_cell"]}
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
