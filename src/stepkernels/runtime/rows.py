"""runtime.rows: the code of chapter 02, Fused softmax: one pass over memory, for rows of any
length."""

# Generated from tutorials/02-fused-softmax.py by tools/export.py: edit the chapter, then `make
# export`.

import contextlib
import functools

import numpy as np
from stepkernels.runtime.core import INTERPRET
import torch

quiet = functools.partial(np.errstate, invalid="ignore", divide="ignore")
quiet = quiet if INTERPRET else contextlib.nullcontext


def as_rows(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2 and t.stride(1) == 1:  # the common case, without reshape's cost
        return t
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
