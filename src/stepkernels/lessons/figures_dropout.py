"""The pictures of chapter 06, low-memory dropout: masks side by side, and how alike their rows
are. Hand-written; matplotlib is imported when a picture is drawn."""

from __future__ import annotations

from stepkernels.runtime.core import DEVICE
import torch


def row_correlation(keep: torch.Tensor) -> float:
    """Mean absolute correlation between the rows of a 2-D mask (1 when every row is the same
    mask; about 1 / sqrt(columns) for independent rows)."""
    correlation = torch.corrcoef(keep.detach().float().cpu())
    off_diagonal = correlation[~torch.eye(len(keep), dtype=torch.bool)]
    return off_diagonal.abs().mean().item()


def draw_row_masks(masks: dict, p: float) -> None:
    """Draw 2-D keep masks (title -> bool tensor) side by side, white where kept, each titled
    with the mean correlation between its rows."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1,
        len(masks),
        figsize=(4.5 * len(masks), 3.2),
        squeeze=False,
        layout="constrained",
    )
    for ax, (name, keep) in zip(axes[0], masks.items(), strict=True):
        ax.imshow(keep.cpu().numpy(), cmap="gray", interpolation="nearest")
        ax.set_title(
            f"counter = {name}\nmean |correlation| between rows: {row_correlation(keep):.2f}",
            fontsize=9,
        )
        ax.set(xlabel="column", ylabel="row")
    fig.suptitle(f"Dropout masks, p = {p} (white: kept)", fontsize=10)


def draw_restarting_counters(
    dropout, n_rows: int = 32, n_cols: int = 64, p: float = 0.5
) -> None:
    """The mask of a kernel whose counters restart in every row, next to the mask of one that
    numbers elements across the whole tensor. A counter that restarts per row draws what
    ``dropout`` draws when each row is its own launch with the same seed, so ``dropout``
    (a function ``dropout(x, p, seed)``) makes both."""
    ones = torch.ones(n_rows, n_cols, device=DEVICE)
    restarting = torch.stack([dropout(row, p, 1234) != 0 for row in ones])
    draw_row_masks(
        {
            "restarts every row (the bug)": restarting,
            "row * n_cols + col": dropout(ones, p, 1234) != 0,
        },
        p,
    )
