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


def compare_layers(model, idx, targets) -> str:
    """Chapter 12's check of a GPT: logits, loss and every parameter's gradient on our
    layers against PyTorch's, one set of parameters, in fp32 without tf32. Raises where
    they differ (logits within 1e-4, gradients within rtol 1e-3 and atol 1e-5); returns a
    line saying by how much they differ."""
    results, previous = {}, torch.get_float32_matmul_precision()
    chosen = model.use_triton
    torch.set_float32_matmul_precision("highest")
    try:
        for use_triton in (True, False):
            model.use_triton = use_triton
            model.zero_grad()
            logits, loss = model(idx, targets)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results[use_triton] = logits.detach(), loss.detach(), grads
    finally:
        torch.set_float32_matmul_precision(previous)
        model.use_triton = chosen
    (ours, our_loss, our_grads), (theirs, their_loss, their_grads) = results.values()
    gaps = {n: (g - their_grads[n]).abs().max().item() for n, g in our_grads.items()}
    worst = max(gaps, key=gaps.get)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for name, grad in our_grads.items():
        torch.testing.assert_close(
            grad, their_grads[name], rtol=1e-3, atol=1e-5, msg=name
        )
    return (
        f"loss {our_loss.item():.6f} (ours), {their_loss.item():.6f} (PyTorch's); largest "
        f"difference of logits {(ours - theirs).abs().max().item():.1e}, of gradients "
        f"{gaps[worst]:.1e} ({worst})"
    )
