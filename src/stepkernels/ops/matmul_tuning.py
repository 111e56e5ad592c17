"""Which of chapter 07's configs the autotuner times: the split tail's, only where it splits.

Chapter 07's descriptor kernel comes in two binaries per tile, with and without
``SPLIT_TAIL``. The split's binary carries more registers and is slower where the last wave
stays whole, so timing it there costs a compile and a benchmark for nothing, and can pick it
by noise. ``tail_shares`` repeats the kernel's ``tail_split`` rule on the host (a test checks
that they agree); ``keep_tma_configs`` is the autotuner's pruning, and ``tma_autotuned`` the
autotuner itself, for the chapter's kernel and the experiments' variants of it.
"""

from stepkernels.runtime.core import autotune_configs, sm_count
from stepkernels.runtime.tiles import keep_configs_for_dtype
import triton
import triton.language as tl

MAX_SPLITS = 8  # most shares a tail tile is split into
# Fewest K steps a share: a global the kernel reads, so a constexpr.
SHARE_STEPS = tl.constexpr(4)


def tail_shares(M: int, N: int, K: int, config: dict, programs: int) -> int:
    """Shares a tail tile is split into for ``config`` (1: the last wave stays whole), as
    chapter 07's ``tail_split`` works it out in the kernel."""
    tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
    tail = tiles % programs
    if tail == 0:
        return 1
    most = min(
        config.get("MAX_SPLITS", MAX_SPLITS),
        triton.cdiv(K, config["BLOCK_K"]) // SHARE_STEPS.value,
    )
    return max(min(programs // tail, most), 1)


def keep_tma_configs(configs, named_args, **kwargs):
    """``keep_configs_for_dtype``'s choice, less the ``SPLIT_TAIL`` configs whose last wave
    would stay whole for this product."""
    M, N, K = (named_args[name] for name in "MNK")
    return [
        config
        for config in keep_configs_for_dtype(configs, named_args, **kwargs)
        if not config.kwargs.get("SPLIT_TAIL")
        or tail_shares(M, N, K, config.kwargs, programs(config.kwargs)) > 1
    ]


def programs(config: dict) -> int:
    """The grid of chapter 07's kernel for ``config``: one or more programs an SM."""
    return sm_count() * config.get("PROGRAMS_PER_SM", 1)


def tma_autotuned(kernel, configs):
    """``kernel`` (chapter 07's descriptor kernel, or a variant of it) autotuned over
    ``configs`` for each shape and precision."""
    return triton.autotune(
        configs=autotune_configs(configs),
        key=["M", "N", "K", "INPUT_PRECISION"],
        restore_value=["c_ptr"],  # for ACCUMULATE, as in chapter 04
        prune_configs_by={"early_config_prune": keep_tma_configs},
    )(kernel)
