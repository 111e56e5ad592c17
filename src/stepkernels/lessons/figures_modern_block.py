"""The picture of chapter 14, rotary embeddings: which features a rotation pairs, and which
program turns which rows of q and k."""

from __future__ import annotations


def draw_rotary_programs(
    dim: int = 8, q_heads: int = 6, k_heads: int = 2, position_blocks: int = 4
) -> None:
    """Left: a head's ``dim`` features, feature i turned with feature i + dim/2 ("rotate
    half"). Right: the rows of q and k, a block of positions by a head each; a program takes
    a column, loads its positions' cos and sin once (top), then walks q's heads and k's."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    fig, (pairs, grid) = plt.subplots(
        1, 2, figsize=(9.5, 3.4), gridspec_kw=dict(width_ratios=(1, 1.4))
    )
    half = dim // 2
    for i in range(dim):
        color = colors(i % half)
        pairs.add_patch(plt.Rectangle((i, 0), 0.9, 0.9, color=color, alpha=0.6))
        pairs.text(i + 0.45, 0.45, f"x{i}", ha="center", va="center", fontsize=8)
    for i in range(half):
        pairs.annotate(
            "",
            (i + half + 0.45, 0.95),
            (i + 0.45, 0.95),
            arrowprops=dict(
                arrowstyle="<->", color=colors(i), connectionstyle="arc3,rad=-0.4"
            ),
        )
    pairs.text(
        dim / 2,
        -0.6,
        f"y_i = x_i cos_i - x_(i+{half}) sin_i\n"
        f"y_(i+{half}) = x_(i+{half}) cos_(i+{half}) + x_i sin_(i+{half})",
        ha="center",
        va="center",
        fontsize=8,
    )
    pairs.set(
        xlim=(-0.2, dim + 0.2), ylim=(-1.2, 2.6), title="pairs (i, i + D/2) of a head"
    )
    pairs.axis("off")
    heads = [f"q{h}" for h in range(q_heads)] + [f"k{h}" for h in range(k_heads)]
    for block in range(position_blocks):
        color = colors(block)
        grid.add_patch(
            plt.Rectangle((block, len(heads) + 0.3), 0.9, 0.8, color=color, alpha=0.9)
        )
        grid.text(
            block + 0.45,
            len(heads) + 0.7,
            "cos, sin",
            ha="center",
            va="center",
            fontsize=7,
        )
        for row, name in enumerate(heads):
            y = len(heads) - 1 - row
            grid.add_patch(plt.Rectangle((block, y), 0.9, 0.8, color=color, alpha=0.45))
            grid.text(block + 0.45, y + 0.4, name, ha="center", va="center", fontsize=7)
        grid.annotate(
            "",
            (block + 0.95, 0.1),
            (block + 0.95, len(heads) - 0.2),
            arrowprops=dict(arrowstyle="->", color=color, lw=1),
        )
        grid.text(block + 0.45, -0.45, f"program {block}", ha="center", fontsize=7)
    grid.set(
        xlim=(-0.1, position_blocks + 0.2),
        ylim=(-0.8, len(heads) + 1.3),
        title="a program: a block of positions, every head of q then k",
    )
    grid.axis("off")
    fig.tight_layout()
