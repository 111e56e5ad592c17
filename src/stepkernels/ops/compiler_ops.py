"""ops.compiler_ops: the code of chapter 08, Launch overhead: what a call costs, and CUDA graphs
and torch.compile to remove it."""

# Generated from tutorials/08-launch-overhead.py by tools/export.py: edit the chapter, then `make
# export`.

from stepkernels.ops.layer_norm import (  # noqa: F401  (chapter 03's, kept here by name)
    LayerNorm,
    layer_norm_backward_op,
    layer_norm_forward_op,
)
from stepkernels.ops.layer_norm import layer_norm as traced_layer_norm  # noqa: F401

# Chapter 03's LayerNorm calls the operators itself while compiled: the old name stays.
TracedLayerNorm = LayerNorm
