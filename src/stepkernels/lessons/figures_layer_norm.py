"""The pictures of chapter 03, layer normalization: how the lock-based backward combines the
programs' partial sums of dW and dB."""

from __future__ import annotations


def draw_lock_reduction(n_programs: int = 8, group_size_m: int = 3) -> None:
    """Programs adding their partial dW and dB into ``group_size_m`` lock-guarded buffers
    (program p into buffer p % group_size_m), and the second stage that sums the buffers."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    buffer_x = [
        (group + 0.5) * n_programs / group_size_m for group in range(group_size_m)
    ]
    for program in range(n_programs):
        group = program % group_size_m
        ax.add_patch(
            plt.Rectangle((program, 2), 0.85, 0.6, color=colors(group), alpha=0.6)
        )
        ax.text(
            program + 0.42,
            2.3,
            f"program {program}",
            ha="center",
            va="center",
            fontsize=7,
        )
        arrow = dict(arrowstyle="->", color=colors(group), lw=1)
        ax.annotate("", (buffer_x[group], 1.3), (program + 0.42, 2), arrowprops=arrow)
    for group, center in enumerate(buffer_x):
        ax.add_patch(
            plt.Rectangle((center - 0.9, 0.7), 1.8, 0.6, color=colors(group), alpha=0.9)
        )
        ax.text(
            center, 1.0, f"buffer {group} + lock", ha="center", va="center", fontsize=7
        )
        ax.annotate(
            "",
            (n_programs / 2, 0.3),
            (center, 0.7),
            arrowprops=dict(arrowstyle="->", lw=1),
        )
    ax.add_patch(plt.Rectangle((n_programs / 2 - 1.5, -0.3), 3, 0.6, color="0.8"))
    ax.text(
        n_programs / 2,
        0.0,
        "second stage: dW, dB",
        ha="center",
        va="center",
        fontsize=8,
    )
    ax.set(xlim=(-0.2, n_programs + 0.2), ylim=(-0.4, 2.8))
    ax.axis("off")
    ax.set_title(
        f"{n_programs} programs, GROUP_SIZE_M = {group_size_m}: program p adds its partial sums "
        f"into buffer p % {group_size_m} while holding that buffer's lock",
        fontsize=9,
    )
    fig.tight_layout()
