"""nn.Module wrappers of the package's functions that their chapters leave out of the lesson.

Chapter 06 teaches ``Dropout``; ``DropoutBiasAct`` wraps its fused layer the same way, with a
learned bias and a fresh 63-bit seed per call.
"""

from stepkernels.ops.dropout import dropout_bias_act
from stepkernels.runtime import core
from stepkernels.runtime.arguments import activation_argument, dropout_p
import torch


class DropoutBiasAct(torch.nn.Module):
    """``dropout(act(x + bias))`` with a learned bias of ``features`` values, fused; the bias
    is created on ``device`` (default: where the kernels run) in ``dtype``."""

    def __init__(self, features, p=0.1, activation="gelu", device=None, dtype=None):
        super().__init__()
        activation_argument(activation)
        self.p, self.activation = dropout_p(p), activation
        zeros = torch.zeros(features, device=device or core.DEVICE, dtype=dtype)
        self.bias = torch.nn.Parameter(zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seed = core.fresh_seed() if self.training else 0
        bias = self.bias.to(x.dtype)
        return dropout_bias_act(x, bias, self.p, self.activation, seed, self.training)

    def extra_repr(self) -> str:
        features, activation = self.bias.numel(), self.activation
        return f"features={features}, p={self.p}, activation={activation!r}"
