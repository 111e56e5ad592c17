r"""stepkernels: the fused GPU kernels that the chapters of *Triton Kernels, Step by Step* build.

.. code-block:: python

    from stepkernels import softmax, layer_norm, linear, dropout, cross_entropy, attention, GPT

Every public function takes and returns torch tensors, checks its input (a clear error, never a
silent wrong answer), and is differentiable where the operation has a backward.

On a machine without a GPU the kernels run under Triton's interpreter, on CPU tensors. Triton
reads that choice (``TRITON_INTERPRET=1``) when it is first imported, so importing this package
sets it, once, when no GPU is present and Triton is not imported yet: that is the only way the
kernels can run there. Set ``TRITON_INTERPRET`` yourself to decide otherwise.
"""

import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        raise ImportError(
            "No GPU here, so Triton's kernels must run under its interpreter, which Triton "
            "reads when it is imported: import stepkernels before triton, or set "
            "TRITON_INTERPRET=1 before starting Python."
        )
    os.environ["TRITON_INTERPRET"] = "1"

# The public functions (their modules are written from the chapters by tools/export.py).
from stepkernels.attention import attention  # noqa: E402
from stepkernels.cross_entropy import cross_entropy  # noqa: E402
from stepkernels.dropout import Dropout, dropout, dropout_bias_act  # noqa: E402
from stepkernels.gpt import GPT  # noqa: E402
from stepkernels.layer_norm import LayerNorm, layer_norm  # noqa: E402
from stepkernels.linear import FusedLinear, linear  # noqa: E402
from stepkernels.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from stepkernels.matmul import matmul  # noqa: E402
from stepkernels.modules import DropoutBiasAct  # noqa: E402
from stepkernels.softmax import log_softmax, softmax  # noqa: E402
from stepkernels.vector_add import add  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "Dropout",
    "DropoutBiasAct",
    "FusedLinear",
    "GPT",
    "LayerNorm",
    "add",
    "attention",
    "cross_entropy",
    "dropout",
    "dropout_bias_act",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "log_softmax",
    "matmul",
    "softmax",
]
