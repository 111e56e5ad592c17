r"""stepkernels: the fused GPU kernels that the chapters of *Triton Kernels, Step by Step* build.

.. code-block:: python

    from stepkernels import softmax, layer_norm, linear, dropout, cross_entropy, attention, GPT
    from stepkernels import rms_norm, rotary_embedding, silu_mul

Every public function takes and returns torch tensors, checks its input (a clear error, never a
silent wrong answer), and is differentiable where the operation has a backward.

The package has wings, and imports run one way (``tests/test_architecture.py`` checks it):

- ``runtime``: device facts, input checks, cheap launches, CUDA-graph helpers, and the device
  code that several operations share (tiles, waiting for sibling programs, activations);
- ``ops``: one module per operation, written from its chapter (``tools/export.py``);
- ``models``: the GPT, its training and its data;
- ``lessons``: what the chapters use beside the library (timing, recordings, plots, checks).
  The library never imports it.

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
from stepkernels.models.gpt import GPT, GPTConfig  # noqa: E402
from stepkernels.ops.adamw import FusedAdamW  # noqa: E402
from stepkernels.ops.add_layer_norm import add_layer_norm  # noqa: E402
from stepkernels.ops.attention import attention, varlen_attention  # noqa: E402
from stepkernels.ops.cross_entropy import cross_entropy  # noqa: E402
from stepkernels.ops.dropout import Dropout, dropout, dropout_bias_act  # noqa: E402
from stepkernels.ops.layer_norm import LayerNorm, layer_norm  # noqa: E402
from stepkernels.ops.linear import FusedLinear, linear  # noqa: E402
from stepkernels.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from stepkernels.ops.matmul import matmul  # noqa: E402
from stepkernels.ops.modules import DropoutBiasAct  # noqa: E402
from stepkernels.ops.rms_norm import RMSNorm, rms_norm  # noqa: E402
from stepkernels.ops.rotary import rotary_embedding, rotary_embedding_qk  # noqa: E402
from stepkernels.ops.softmax import log_softmax, softmax  # noqa: E402
from stepkernels.ops.swiglu import silu_mul  # noqa: E402
from stepkernels.ops.vector_add import add  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "Dropout",
    "DropoutBiasAct",
    "FusedAdamW",
    "FusedLinear",
    "GPT",
    "GPTConfig",
    "LayerNorm",
    "RMSNorm",
    "add",
    "add_layer_norm",
    "attention",
    "cross_entropy",
    "dropout",
    "dropout_bias_act",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "log_softmax",
    "matmul",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_qk",
    "silu_mul",
    "softmax",
    "varlen_attention",
]
