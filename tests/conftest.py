from pathlib import Path

import kit  # first: without a GPU it switches triton to the interpreter
import matplotlib.pyplot as plt
import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_chapter(number: str):
    """Import a chapter as a module. This runs it top to bottom, its own checks included."""
    module = kit.load_chapter(number, quiet=kit.ON_GPU)  # on a GPU: skip its benchmarks
    plt.close("all")
    return module


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")
