"""The training step's matrix products one at a time, ours against cuBLAS (issue 41).

Chapter 12's GPT at nanoGPT's Shakespeare shape (16,384 tokens a step, 384 wide, 6 layers, 65
classes) runs, in bf16, three products a linear layer: the forward x Wᵀ, dX = dY W and the
weight gradient dW = dYᵀ X, with the operands laid out as chapter 05's ``linear`` hands them
to ``matmul`` (Wᵀ and dYᵀ are views, never copies). For each product this script prints the
kernel ``matmul`` takes (the portable kernel, chapter 07's descriptor kernel, or that kernel
splitting K for a weight gradient, ``splits_k``), then on a GPU its time and TFLOP/s against
``torch.matmul`` on the same views (both captured in a CUDA graph and replayed,
``bench.measure_ms``), and the config the autotuner chose. The last line sums the step's
products, each as many times as a step runs it (the MLP's input layer twice forward: the
backward recomputes it).

    python lab/step_products.py             # GPU: time each product; CPU: check them (toy size)
    python lab/step_products.py --configs   # the kernel and the configs timed for each product
    python lab/step_products.py --candidates  # GPU: also fixed configs, kept or not
    python lab/step_products.py --before    # as before issue 41: dW on the portable kernel

``--configs`` needs no GPU: with ``STEPKERNELS_DEVICE_PROFILE=sm90`` it prints what an H100's
(or H200's: 132 SMs too) launch rules choose, the configs the autotuner would time for each
product and, for each, its tiles, programs and waves, and the shares a split gives a tile.
``--candidates`` times fixed configs through ``matmul_tma(config=...)``, among them some that
the package does not offer: for the forward and dX products (K = 384 to 1,536, many tiles),
fewer stages and two programs an SM; for the weight gradients, up to 16 shares a tile.
``--before`` turns ``splits_k`` off (no product is a weight gradient's shape), so that the
weight gradients take the portable kernel, as they did before issue 41: one checkout times
both. Without a GPU the products run at a toy size under the interpreter, checked against
torch; interpreted timings are never results, so none are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from unittest import mock

from stepkernels.lessons import bench
from stepkernels.ops import matmul as matmul_module
from stepkernels.ops import matmul_hopper as hopper
from stepkernels.ops import matmul_tuning
from stepkernels.ops.matmul import matmul, matmul_portable_tuned, on_descriptors
from stepkernels.runtime.core import DEVICE, ON_GPU, sm_count
import torch

SHAKESPEARE = dict(tokens=16384, width=384, layers=6, vocab=65)
TOY = dict(tokens=1024, width=16, layers=1, vocab=65)
# (in, out) features as multiples of the width, and how many times a layer runs forward
LAYERS = {"qkv": (1, 3, 1), "attention out": (1, 1, 1), "mlp in": (1, 4, 2), "mlp out": (4, 1, 1)}

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, programs an SM): for the forward and dX products
SHORT_K_CANDIDATES = [
    (128, 256, 64, 3, 8, 1),  # offered
    (128, 128, 64, 4, 8, 1),  # offered
    (128, 128, 64, 3, 8, 2),  # offered: two programs an SM
    (128, 256, 64, 2, 8, 1),  # not offered: K = 384 is 6 steps, fewer stages to fill
    (128, 128, 64, 2, 4, 2),  # not offered: two an SM, lighter
    (64, 256, 64, 2, 4, 2),  # not offered (lab/matmul_two_per_sm.py's)
]
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, programs an SM, MAX_SPLITS): split configs
WEIGHT_GRADIENT_CANDIDATES = [
    (128, 128, 64, 4, 8, 1, 8),  # offered
    (128, 128, 64, 4, 8, 1, 16),  # not offered: up to 16 shares a tile
    (64, 128, 64, 4, 4, 1, 8),  # offered
    (64, 128, 64, 4, 4, 1, 16),  # not offered
    (128, 256, 64, 3, 8, 1, 8),  # offered
    (128, 128, 64, 3, 8, 2, 8),  # offered: two programs an SM
]


def products(shape: dict, dtype: torch.dtype, seed: int = 0, values: bool = True):
    """(name, a, b, runs a step) for every product of a step, as ``linear`` calls them
    (``values``: random, else left as allocated)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*size):
        if not values:
            return torch.empty(*size, device=DEVICE, dtype=dtype)
        return torch.randn(*size, generator=generator).to(DEVICE, dtype)

    tokens, width, layers = shape["tokens"], shape["width"], shape["layers"]
    found = []
    widths = {name: (i * width, o * width, f) for name, (i, o, f) in LAYERS.items()}
    widths["lm head"] = (width, shape["vocab"], 1)
    for name, (n_in, n_out, forwards) in widths.items():
        runs = 1 if name == "lm head" else layers
        x, weight = rand(tokens, n_in), rand(n_out, n_in) * n_in**-0.5
        grad_y = rand(tokens, n_out)
        found.append((f"{name} forward", x, weight.mT, forwards * runs))
        found.append((f"{name} dX", grad_y, weight, runs))
        found.append((f"{name} dW", grad_y.mT, x, runs))
    return found


def route(a, b) -> str:
    """The kernel ``matmul`` takes for a @ b on this machine (or device profile)."""
    (M, K), N = a.shape, b.shape[1]
    if on_descriptors(a.dtype, M, N, K) and hopper.tma_operands(a, b) is not None:
        return "descriptor, K split" if matmul_tuning.splits_k(M, N, K) else "descriptor"
    return "portable"


def describe(config: dict, num_warps=None, num_stages=None) -> str:
    tile = f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']}"
    text = f"{tile}/{num_stages}s/{num_warps}w"
    if config.get("PROGRAMS_PER_SM", 1) > 1:
        text += f" {config['PROGRAMS_PER_SM']}/SM"
    if config.get("SPLIT_TAIL"):
        text += f" split<={config.get('MAX_SPLITS', matmul_tuning.MAX_SPLITS)}"
    return text


def timed_configs(a, b) -> list[str]:
    """The descriptor kernel's configs the autotuner times for a @ b, with tiles, programs,
    waves and the shares of a split tile."""
    (M, K), N = a.shape, b.shape[1]
    named = {"a_ptr": a, "M": M, "N": N, "K": K}
    lines = []
    for config in matmul_tuning.keep_tma_configs(hopper.TMA_CONFIGS, named):
        kwargs = config.kwargs
        tiles = -(-M // kwargs["BLOCK_M"]) * -(-N // kwargs["BLOCK_N"])
        programs = matmul_tuning.programs(kwargs)
        line = f"    {describe(kwargs, config.num_warps, config.num_stages):32}"
        line += f" {tiles:5} tiles / {programs} programs = {tiles / programs:5.2f} waves"
        if kwargs.get("SPLIT_TAIL"):
            line += f", {matmul_tuning.tail_shares(M, N, K, kwargs, programs)} shares a tail tile"
        lines.append(line)
    return lines


def chosen(a, b) -> str:
    """The config the autotuner chose for a @ b (after a call)."""
    (M, K), N = a.shape, b.shape[1]
    tuned = hopper.matmul_tma_tuned if route(a, b) != "portable" else matmul_portable_tuned
    for key, config in tuned.kernel.cache.items():
        if tuple(key[:3]) == (M, N, K):
            return describe(config.kwargs, config.num_warps, config.num_stages)
    return "?"


def flops(a, b) -> float:
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]


def fixed(a, b, config):
    return functools.partial(hopper.matmul_tma, a, b, config=config)


def candidate_lines(name, a, b, torch_ms):
    """Fixed configs' rates for a @ b against torch's time."""
    if "dW" in name:
        candidates = [
            {**tile_kwargs(*c[:6]), "SPLIT_TAIL": True, "MAX_SPLITS": c[6]} for c in WEIGHT_GRADIENT_CANDIDATES
        ]
    else:
        candidates = [tile_kwargs(*c) for c in SHORT_K_CANDIDATES]
    want = torch.matmul(a, b).float()
    for config in candidates:
        call = fixed(a, b, config)
        torch.testing.assert_close(call().float(), want, rtol=2e-2, atol=2e-1)
        ms = bench.measure_ms(call)[0]
        text = describe(config, config["num_warps"], config["num_stages"])
        rate = bench.per_time(flops(a, b), ms, "TFLOP/s")
        print(f"      {text:32} {ms * 1e3:7.1f} us {rate:5.0f} TFLOP/s  torch/ours {torch_ms / ms:4.2f}")


def tile_kwargs(block_m, block_n, block_k, stages, warps, per_sm):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_SIZE_M": 8,
            "num_stages": stages, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}  # fmt: skip


def time_products(shape, candidates: bool):
    dtype = torch.bfloat16
    total_ours = total_torch = 0.0
    print(f"{'product':22} {'M x N x K':>20} {'kernel':20} {'ours us':>8} {'TFLOP/s':>8} "
          f"{'torch us':>8} {'TFLOP/s':>8} {'torch/ours':>10}  config")  # fmt: skip
    for name, a, b, runs in products(shape, dtype):
        ours, theirs = functools.partial(matmul, a, b), functools.partial(torch.matmul, a, b)
        torch.testing.assert_close(ours().float(), theirs().float(), rtol=2e-2, atol=2e-1)
        ours_ms, torch_ms = bench.measure_ms(ours)[0], bench.measure_ms(theirs)[0]
        total_ours, total_torch = total_ours + runs * ours_ms, total_torch + runs * torch_ms
        work = flops(a, b)
        size = f"{a.shape[0]}x{b.shape[1]}x{a.shape[1]}"
        print(
            f"{name:22} {size:>20} {route(a, b):20} {ours_ms * 1e3:8.1f} "
            f"{bench.per_time(work, ours_ms, 'TFLOP/s'):8.0f} {torch_ms * 1e3:8.1f} "
            f"{bench.per_time(work, torch_ms, 'TFLOP/s'):8.0f} {torch_ms / ours_ms:10.2f}  "
            f"{chosen(a, b)}",
            flush=True,
        )
        if candidates and route(a, b) != "portable":
            candidate_lines(name, a, b, torch_ms)
    print(f"a step's products (each times its runs): ours {total_ours:.3f} ms, torch "
          f"{total_torch:.3f} ms, torch/ours {total_torch / total_ours:.2f}")  # fmt: skip


def print_configs(shape):
    print(f"{sm_count()} SMs")
    for name, a, b, _ in products(shape, torch.bfloat16, values=False):
        size = f"{a.shape[0]}x{b.shape[1]}x{a.shape[1]}"
        print(f"{name:22} {size:>20} {route(a, b)}")
        if route(a, b) != "portable":
            print("\n".join(timed_configs(a, b)))


def check(shape):
    """Every product of a toy step against torch (fp32, the interpreter)."""
    for name, a, b, _ in products(shape, torch.float32):
        torch.testing.assert_close(matmul(a, b), a @ b, rtol=1e-4, atol=1e-4 * a.shape[1] ** 0.5)
        print(f"{name:22} {route(a, b):20} matches torch")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", action="store_true", help="kernels and configs only")
    parser.add_argument("--candidates", action="store_true", help="also time fixed configs")
    parser.add_argument("--before", action="store_true", help="dW on the portable kernel")
    args = parser.parse_args(argv)
    shape = SHAKESPEARE
    with before_issue_41() if args.before else contextlib.nullcontext():
        if args.configs:
            print_configs(shape)
        elif ON_GPU:
            time_products(shape, args.candidates)
        else:
            check(TOY)


@contextlib.contextmanager
def before_issue_41():
    """No product is a weight gradient's shape: dW goes to the portable kernel again."""
    never = lambda M, N, K: False  # noqa: E731
    with mock.patch.object(matmul_module, "splits_k", never):
        with mock.patch.object(matmul_tuning, "splits_k", never):
            yield


if __name__ == "__main__":
    main()
