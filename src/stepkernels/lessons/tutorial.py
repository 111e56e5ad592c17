"""Small helpers the chapters share: where the kernels run, sizes, and showing refusals."""

from __future__ import annotations

from stepkernels.lessons.bench import choose  # noqa: F401  (re-exported)
from stepkernels.runtime.core import DEVICE, INTERPRET, ON_GPU  # noqa: F401  (re-exported)
import torch
import triton


def announce() -> None:
    """Print one line saying where this chapter's kernels run."""
    if ON_GPU:
        print(
            f"Running on {torch.cuda.get_device_name()} with torch {torch.__version__} "
            f"and triton {triton.__version__}: full problem sizes, live timings."
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
