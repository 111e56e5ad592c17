"""What chapter 12 measures beside the training step: the step's matrix products alone."""

from __future__ import annotations

from stepkernels.lessons import bench
from stepkernels.models.train import Config
from stepkernels.runtime import core
import torch


def products_alone(cfg: Config, vocab_size: int) -> float:
    """Tokens per second of a step that were only its matrix products, in bf16 by cuBLAS
    (GPU time of a CUDA graph): the forward and two backward products of each linear layer."""
    n, width = cfg.batch_size * cfg.block_size, cfg.n_embd
    shapes = [
        (width, 3 * width),
        (width, width),
        (width, 4 * width),
        (4 * width, width),
    ]
    options = {"device": core.DEVICE, "dtype": torch.bfloat16}
    operands = [
        (
            torch.randn(n, k, **options),
            torch.randn(m, k, **options),
            torch.randn(n, m, **options),
        )
        for k, m in shapes * cfg.n_layer + [(width, vocab_size)]
    ]

    def step():
        for x, weight, grad in operands:
            x @ weight.T, grad @ weight, grad.T @ x

    return n / bench.measure_ms(step)[0] * 1e3
