from pathlib import Path

import kit  # first: without a GPU it switches triton to the interpreter
import matplotlib.pyplot as plt
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load_chapter(number: str):
    """Import a chapter as a module. This runs it top to bottom, its own checks included."""
    module = kit.load_chapter(number, quiet=kit.ON_GPU)  # on a GPU: skip its benchmarks
    plt.close("all")
    return module


def random_tensor(shape, dtype=torch.float32, seed=0, scale=1.0, shift=0.0):
    """Seeded normal values, scale * randn + shift, drawn in fp32 and then rounded to dtype."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale + shift).to(kit.DEVICE, dtype)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")
