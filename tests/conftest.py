import importlib.util
from functools import cache
from pathlib import Path

import kit  # noqa: F401  (first: without a GPU it switches triton to the interpreter)
import matplotlib.pyplot as plt
import pytest

ROOT = Path(__file__).resolve().parent.parent


@cache
def load_chapter(number: str):
    """Import a chapter as a module. This runs it top to bottom, its own checks included."""
    (path,) = (ROOT / "tutorials").glob(f"{number}-*.py")
    spec = importlib.util.spec_from_file_location(f"chapter_{number}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plt.close("all")
    return module


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")
