"""Chapter 11's attention launches made to fit the shared memory of the device.

Hand-written, beside the chapter's module. The chapter's ``default_launches`` gives the
launches measured on the H100 (blocks of queries and keys, warps, stages); ``fit_to_device``
wraps it so that each launch whose shared memory, as ``shared_bytes`` bounds it, exceeds what
the device gives a program (``runtime/device.py``) takes fewer stages, then smaller blocks,
until it fits. On the H100 (227 KB) and the A100 (163 KB) the 16-bit launches stay as
measured; on the 99 KB of an A10, RTX 3090, L4 or RTX 4090 the fp32 ones and the 16-bit dQ
launch of head dim 128 shrink. ``tools/check_targets.py`` compiles every launch the rules
choose for sm_80, sm_86, sm_89 and sm_90 and holds what Triton allocates to ``shared_bytes``.
"""

import dataclasses
import functools

from stepkernels.runtime.device import profile

# Rows of D values a program keeps in shared memory for its whole loop, and rows it
# streams each step, by kernel (in default_launches' order), for BLOCK_M = m and BLOCK_N = n.
# O, read once by the dQ kernel, stays in registers.
TILE_ROWS = {
    "forward": lambda m, n: (m, 2 * n),  # Q; K and V
    "key_grads": lambda m, n: (2 * n, 2 * m),  # K and V; Q and dO
    "query_grad": lambda m, n: (2 * m, 2 * n),  # Q and dO; K and V
}
SCRATCH = 2048  # bytes of barriers and reductions' scratch


def shared_bytes(launch, kernel: str, head_dim: int, itemsize: int) -> int:
    """An upper bound of the shared memory ``launch`` (a ``Launch`` of chapter 11) takes on
    the device. With TMA (sm_90) each streamed tile has num_stages buffers: exact to
    ``SCRATCH`` for 16-bit tiles. Before Hopper, Triton 3.9 reads the tiles with plain
    loads: fp32 ones pipelined num_stages deep (the backward's transposed tf32 products
    convert them once more), 16-bit ones once, and it converts the tile of scores through
    shared memory. Measured: tools/check_targets.py."""
    m, n = launch.block_m, launch.block_n
    held, streamed = TILE_ROWS[kernel](m, n)
    if profile().tma:
        copies, scores = launch.num_stages, 0
    elif itemsize == 4:
        copies, scores = launch.num_stages + (kernel != "forward"), m * n * 4
    else:
        copies, scores = 1, m * n * 4
    return (held + copies * streamed) * head_dim * itemsize + scores + SCRATCH


def fitted(launch, kernel: str, head_dim: int, itemsize: int, budget: int):
    """``launch``, or the first of its smaller variants that fits ``budget`` bytes of shared
    memory: fewer stages (down to 2), the larger block halved (down to 16), then one stage."""
    size = lambda launch: shared_bytes(launch, kernel, head_dim, itemsize)
    while size(launch) > budget:
        m, n = launch.block_m, launch.block_n
        fewer = dataclasses.replace(launch, num_stages=launch.num_stages - 1)
        least = 1 if max(m, n) == 16 else 2
        if launch.num_stages > least and size(fewer) < size(launch):
            launch = fewer
        elif max(m, n) == 16:
            break  # nothing smaller: Triton refuses it, saying how much it needs
        elif m >= n:  # 8 warps for 128 queries, 4 below
            launch = dataclasses.replace(
                launch, block_m=m // 2, num_warps=min(launch.num_warps, 4)
            )
        else:
            launch = dataclasses.replace(launch, block_n=n // 2)
    return launch


def fit_to_device(rule):
    """``rule(head_dim, element_size, causal)`` -> (forward, key gradients, query gradient)
    launches, each fitted to the device's shared memory; ``.measured`` is ``rule`` itself."""

    @functools.wraps(rule)
    def fitted_rule(head_dim: int, element_size: int, causal: bool):
        budget = profile().shared_memory
        launches = zip(rule(head_dim, element_size, causal), TILE_ROWS, strict=True)
        return tuple(
            fitted(launch, kernel, head_dim, element_size, budget)
            for launch, kernel in launches
        )

    fitted_rule.measured = rule
    return fitted_rule
