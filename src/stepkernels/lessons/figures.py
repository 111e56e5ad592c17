"""The explanatory pictures of the chapters: tiles, program orders, reductions, masks.

Each is a short function that draws one figure with matplotlib (imported when called), so a
lesson shows the picture with one call and keeps its text about the kernel.
"""

from __future__ import annotations


def draw_programs(n_elements: int, block_size: int) -> None:
    """Draw a vector cut into blocks, one program each, with the masked-off tail hatched."""
    import matplotlib.pyplot as plt

    n_programs = -(-n_elements // block_size)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(0.42 * n_programs * block_size + 1, 1.9))
    for index in range(n_programs * block_size):
        program, in_bounds = index // block_size, index < n_elements
        face = colors(program % 10) if in_bounds else "white"
        ax.add_patch(
            plt.Rectangle(
                (index, 0),
                0.94,
                1,
                facecolor=face,
                alpha=0.75,
                edgecolor="0.4",
                hatch=None if in_bounds else "//",
            )
        )
        ax.text(index + 0.47, 0.5, str(index), ha="center", va="center", fontsize=8)
    for program in range(n_programs):
        ax.text(
            (program + 0.5) * block_size,
            1.25,
            f"program_id = {program}",
            ha="center",
            fontsize=9,
        )
    ax.text(
        n_elements, -0.35, "masked off: offsets >= n_elements", fontsize=8, color="0.3"
    )
    ax.set(xlim=(-0.3, n_programs * block_size + 0.3), ylim=(-0.6, 1.6))
    ax.axis("off")
    ax.set_title(
        f"n_elements = {n_elements}, BLOCK_SIZE = {block_size}: "
        f"grid = cdiv({n_elements}, {block_size}) = {n_programs} programs",
        fontsize=9,
    )
    fig.tight_layout()
