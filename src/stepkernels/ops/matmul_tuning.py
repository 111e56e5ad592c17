"""Which of chapter 07's configs the autotuner times: the split tail's only where it splits,
and for a weight gradient's shape only those.

Chapter 07's descriptor kernel comes in two binaries per tile, with and without
``SPLIT_TAIL``. The split's binary carries more registers and is slower where the last wave
stays whole, so timing it there costs a compile and a benchmark for nothing, and can pick it
by noise. ``tail_shares`` repeats the kernel's ``tail_split`` rule on the host (a test checks
that they agree); ``keep_tma_configs`` is the autotuner's pruning, and ``tma_autotuned`` the
autotuner itself, for the chapter's kernel and the experiments' variants of it.

A weight gradient dW = dYᵀ X has an output as small as the layer's weight (few tiles) and a
reduction over every token (a long K): ``splits_k`` says when a product is of that kind. Chapter
04's ``matmul`` then gives it to chapter 07's kernel, and the pruning keeps only the configs
that split its K over the SMs that its tiles alone would leave idle.
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


# K at least this many times the output's longer side (and 4 × 256): a weight gradient's shape
LONG_K = 4


def splits_k(M: int, N: int, K: int) -> bool:
    """A weight gradient's shape: fewer 128 × 128 tiles of the M × N output than SMs, and a
    reduction at least ``LONG_K`` times the output's longer side (and 1,024 or more, so that
    a split has K steps to share). dYᵀ X of a layer 384 to 1,536 wide over 16,384 tokens is
    one; chapter 04's skinny products (K = N) are not."""
    tiles = -(-M // 128) * -(-N // 128)  # at every call: no triton.cdiv
    return tiles < sm_count() and K >= LONG_K * max(M, N, 256)


def keep_tma_configs(configs, named_args, **kwargs):
    """``keep_configs_for_dtype``'s choice, less the ``SPLIT_TAIL`` configs whose last wave
    would stay whole for this product; for a weight gradient's shape (``splits_k``), only
    the configs that split (a whole config leaves most SMs idle), where any does."""
    M, N, K = (named_args[name] for name in "MNK")
    kept = [
        config
        for config in keep_configs_for_dtype(configs, named_args, **kwargs)
        if not config.kwargs.get("SPLIT_TAIL")
        or tail_shares(M, N, K, config.kwargs, programs(config.kwargs)) > 1
    ]
    if splits_k(M, N, K):
        split = [config for config in kept if config.kwargs.get("SPLIT_TAIL")]
        return split or kept
    return kept


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
