"""CUDA-graph helpers: a side stream to capture on, and a function captured as a graph.

The training step (``stepkernels.models.train``) and the benchmark harness
(``stepkernels.lessons.bench``) both record work as CUDA graphs; chapter 08 explains why.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib

import torch


@contextlib.contextmanager
def side_stream(side: torch.cuda.Stream | None = None):
    """Make a new stream (or ``side``) current, after the work queued so far. CUDA graphs
    cannot capture the default stream, so whatever is to be captured runs on one of these."""
    side = torch.cuda.Stream() if side is None else side
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield side


def capture(fn: Callable) -> torch.cuda.CUDAGraph:
    """``fn``'s GPU work recorded as a CUDA graph, replayed without Python (see How we measure).

    Compilation, autotuning and autograd's first-call set-up must not happen while capturing,
    so ``fn`` first runs a few times on a side stream, as PyTorch's CUDA-graph notes ask.
    """
    fn()
    with side_stream() as side:
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        fn()
    return graph
