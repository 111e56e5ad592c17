"""Small helpers the chapters share: where the kernels run, sizes, showing refusals, and
showing figures (in a notebook, a script's windows, and the gallery)."""

from __future__ import annotations

from stepkernels.lessons import bench
from stepkernels.lessons.bench import choose, show  # noqa: F401  (re-exported)
from stepkernels.runtime.core import DEVICE, INTERPRET, ON_GPU  # noqa: F401  (re-exported)
import torch
import triton


def announce() -> None:
    """Print one line saying where this chapter's kernels run, and how its benchmarks time."""
    bench.forget_environment_line()  # a chapter's first headline names its software
    if ON_GPU:
        sweep = (
            "every size of every benchmark"
            if bench.full_sweep()
            else "a quick run: each benchmark at its largest size, drawn over the recorded "
            "sweep (STEPKERNELS_FULL=1 measures every size)"
        )
        print(
            f"Running on {torch.cuda.get_device_name()} with torch {torch.__version__} "
            f"and triton {triton.__version__}: full problem sizes, live timings of {sweep}."
        )
    else:
        print(
            "No GPU in use: kernels run under Triton's interpreter on the CPU at reduced size; "
            "the plots show results recorded on a GPU, never interpreter timings."
        )


def show_refusals(function_name: str, bad_calls: dict) -> None:
    """Make each call in ``bad_calls`` (case name -> call) and print the error it raises.

    A call that raises no TypeError or ValueError means bad input was accepted: an error.
    """
    width = max(map(len, bad_calls))
    for case, call in bad_calls.items():
        try:
            call()
        except (TypeError, ValueError) as error:
            print(f"{case:>{width}}: {error}")
        else:
            raise AssertionError(f"{function_name} accepted bad input: {case}")


def full_width_figures(block, block_vars, gallery_conf, **kwargs):
    """sphinx-gallery's matplotlib scraper, with every figure of a cell at full width.

    sphinx-gallery collects the figures open when a cell ends; where there are several, it
    lays them out side by side as thumbnails (CSS class ``sphx-glr-multi-img``, 42% of the
    width) unless the cell or the file asks for ``"single"`` (``# sphinx_gallery_multi_image
    = "single"``). This scraper asks for it wherever neither says otherwise, so a cell that
    runs several benchmarks shows their figures one under another, each at full width.
    conf.py names it: ``"image_scrapers": ("stepkernels.lessons.tutorial.full_width_figures",)``.
    """
    from sphinx_gallery.scrapers import matplotlib_scraper

    file_conf = block_vars.get("file_conf") or {}
    if block_vars.get("multi_image") is None and "multi_image" not in file_conf:
        block_vars = {**block_vars, "multi_image": "single"}
    return matplotlib_scraper(block, block_vars, gallery_conf, **kwargs)
