"""The pictures of the matrix-multiplication chapter: which tiles of C the first programs of a
launch compute, in row-major and in grouped order, and which panels of A and B they read."""

from __future__ import annotations


def grouped_tile(
    tile_id: int, tiles_m: int, tiles_n: int, group_size_m: int
) -> tuple[int, int]:
    """Tile (row, column) of C that program ``tile_id`` computes in the grouped order: the
    arithmetic of the kernels' ``tile_of_program``, in plain Python."""
    tiles_per_group = group_size_m * tiles_n
    first_row = (tile_id // tiles_per_group) * group_size_m
    rows_in_group = min(tiles_m - first_row, group_size_m)
    row = first_row + (tile_id % tiles_per_group) % rows_in_group
    column = (tile_id % tiles_per_group) // rows_in_group
    return row, column


def panels_read(
    tiles_m: int, tiles_n: int, group_size_m: int, programs: int
) -> tuple[int, int]:
    """How many row-panels of A and column-panels of B the first ``programs`` programs read."""
    tiles = [
        grouped_tile(pid, tiles_m, tiles_n, group_size_m) for pid in range(programs)
    ]
    return len({row for row, _ in tiles}), len({column for _, column in tiles})


def draw_program_order(
    tiles: int = 9, programs_in_flight: int = 9, group: int = 3
) -> None:
    """Two grids of C tiles side by side, row-major and grouped, numbered by the program that
    computes each; the first ``programs_in_flight`` are colored, with the panels they read."""
    import matplotlib.pyplot as plt

    orders = {
        "row-major (GROUP_SIZE_M = 1)": 1,
        f"grouped (GROUP_SIZE_M = {group})": group,
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 6.0), layout="constrained")
    colors = plt.get_cmap("viridis")
    for ax, (title, group_size) in zip(axes, orders.items(), strict=True):
        rows_read, columns_read = set(), set()
        for pid in range(tiles * tiles):
            row, column = grouped_tile(pid, tiles, tiles, group_size)
            in_flight = pid < programs_in_flight
            if in_flight:
                rows_read.add(row)
                columns_read.add(column)
            face = colors(pid / programs_in_flight * 0.85) if in_flight else "white"
            ax.add_patch(
                plt.Rectangle(
                    (column, -row - 1), 1, 1, facecolor=face, edgecolor="0.6", lw=0.8
                )
            )
            text_color = "white" if in_flight else "0.45"
            ax.text(
                column + 0.5,
                -row - 0.5,
                str(pid),
                ha="center",
                va="center",
                fontsize=7,
                color=text_color,
            )
        # A to the left of C (its row-panels), B above it (its column-panels); red: read.
        for row in range(tiles):
            face = "tab:red" if row in rows_read else "0.93"
            ax.add_patch(
                plt.Rectangle((-1.6, -row - 1), 1, 1, facecolor=face, edgecolor="white")
            )
        for column in range(tiles):
            face = "tab:red" if column in columns_read else "0.93"
            ax.add_patch(
                plt.Rectangle((column, 0.6), 1, 1, facecolor=face, edgecolor="white")
            )
        ax.text(-1.1, 0.9, "A", ha="center", va="center", fontsize=11)
        ax.text(-0.35, 1.1, "B", ha="right", va="center", fontsize=11)
        ax.set_title(
            f"{title}\nprograms 0..{programs_in_flight - 1} read {len(rows_read)} panels of "
            f"A + {len(columns_read)} of B = {len(rows_read) + len(columns_read)}",
            fontsize=9,
        )
        ax.set(xlim=(-1.8, tiles + 0.2), ylim=(-tiles - 0.2, 1.8), aspect="equal")
        ax.axis("off")
    fig.suptitle(
        "Which tiles of C the first programs compute (numbers: program id), and the panels of A and B (red) they read",
        fontsize=9,
    )
