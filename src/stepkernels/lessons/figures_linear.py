"""The pictures of chapter 05 (autograd and the fused linear layer)."""

from __future__ import annotations


def draw_training_losses(
    torch_losses: list[float], fused_losses: list[float], title: str
) -> None:
    """The loss curves of the same network trained with nn.Linear and with FusedLinear."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    ax.plot(torch_losses, label="PyTorch (nn.Linear + nn.GELU)", color="tab:red", lw=3)
    ax.plot(fused_losses, label="FusedLinear (Triton)", color="tab:blue", lw=1.2)
    ax.set(yscale="log", xlabel="step", ylabel="training loss (MSE)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
