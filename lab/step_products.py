"""The training step's matrix products one at a time, ours against cuBLAS (issue 41).

Chapter 12's GPT at nanoGPT's Shakespeare shape (16,384 tokens a step, 384 wide, 6 layers, 65
classes; ``--shape shakespeare``, the default) or at GPT-2 small's (``--shape gpt2-small``:
8,192 tokens a step, 768 wide, 12 layers, 65 classes) runs, in bf16, three products a linear
layer: the forward x Wᵀ, dX = dY W and the
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
    python lab/step_products.py --shape gpt2-small --candidates  # GPT-2 small's products
    python lab/step_products.py --long-k 3  # splits_k's LONG_K set to 3 for this run
    python lab/step_products.py --shape gpt2-small --candidates --only dW  # some products
    STEPKERNELS_DEVICE_PROFILE=sm90 python lab/step_products.py --shape gpt2-small --compile
        # no GPU: every candidate's launch compiled for sm_90 (shared memory, registers, spills)
    python lab/step_products.py --compile-flat  # no GPU: the flat variant (below) for sm_90

``--configs`` needs no GPU: with ``STEPKERNELS_DEVICE_PROFILE=sm90`` it prints what an H100's
(or H200's: 132 SMs too) launch rules choose, the configs the autotuner would time for each
product and, for each, its tiles, programs and waves, and the shares a split gives a tile.
``--candidates`` times fixed configs through ``matmul_tma(config=...)``, among them some that
the package does not offer: for the forward and dX products (K = 384 to 1,536, many tiles),
fewer stages and two programs an SM; for the weight gradients, up to 16 shares a tile.
With ``--candidates`` a forward or dX product also times each candidate on the flat variant
of chapter 07's kernel: its tile loop ``tl.range(..., flatten=True)`` and the K loop's bounds
0 and ``k_steps`` (a config without the split tail has no others), so that Triton's pipeliner
may load the next tile's first K steps during a tile's epilogue (``lab/matmul_flatten.py``
found that flattening no longer changes the package's code, whose K loop's bounds vary by
item). ``--before`` turns ``splits_k`` off (no product is a weight gradient's shape), so that the
weight gradients take the portable kernel, as they did before issue 41: one checkout times
both. Without a GPU the products run at a toy size under the interpreter, checked against
torch; interpreted timings are never results, so none are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
from pathlib import Path
import re
import sys
from unittest import mock

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--compile-flat" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import sm90
from stepkernels.lessons import bench
from stepkernels.ops import matmul as matmul_module
from stepkernels.ops import matmul_hopper as hopper
from stepkernels.ops import matmul_tuning
from stepkernels.ops.matmul import matmul, matmul_portable_tuned, on_descriptors
from stepkernels.runtime.core import DEVICE, ON_GPU, sm_count
import torch

SHAPES = {
    "shakespeare": dict(tokens=16384, width=384, layers=6, vocab=65),
    "gpt2-small": dict(tokens=8192, width=768, layers=12, vocab=65),  # batch 8 x 1,024
}
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
# GPT-2 small (M = 8,192 tokens, K = 768 or 3,072 for the forward and dX products): whole
# waves on 132 SMs and deeper pipelines, in tiles that Triton expresses (powers of two; no
# 192). 8 warps on a 128-row or 256-row tile are two consumer warpgroups splitting the rows,
# as cuBLAS's cooperative kernels do; Triton has no producer warp here (lab/NOTES.md).
GPT2_SHORT_K_CANDIDATES = [
    (128, 256, 64, 3, 8, 1),  # offered
    (256, 128, 64, 3, 8, 1),  # offered
    (128, 128, 64, 3, 8, 2),  # offered: two programs an SM
    (128, 256, 64, 4, 8, 1),  # not offered: 4 stages (cuBLAS's 256 x 128 takes 4)
    (256, 128, 64, 4, 8, 1),  # not offered
    (64, 256, 64, 4, 4, 1),  # not offered: 1,152 tiles for qkv (97% of 9 waves)
    (128, 256, 128, 2, 8, 1),  # not offered: half the K steps, 2 stages of 96 KB
    (64, 256, 64, 2, 4, 2),  # not offered: two an SM (lab/matmul_two_per_sm.py's)
]
# MAX_SPLITS 1: no split (the tile's whole K in one program)
GPT2_WEIGHT_GRADIENT_CANDIDATES = [
    (128, 128, 64, 4, 8, 1, 8),  # offered
    (128, 128, 64, 4, 8, 1, 1),  # whole tiles: qkv's 108 on 132 SMs, 128 K steps each
    (128, 128, 64, 5, 8, 1, 1),  # whole, 5 stages
    (128, 256, 64, 3, 8, 1, 8),  # offered: attention out's 18 tiles split 7 ways
    (128, 256, 64, 3, 8, 1, 16),  # not offered
    (64, 128, 64, 4, 4, 1, 16),  # not offered
    (128, 128, 64, 3, 8, 2, 8),  # offered: two programs an SM
]
CANDIDATES = {
    "shakespeare": (SHORT_K_CANDIDATES, WEIGHT_GRADIENT_CANDIDATES),
    "gpt2-small": (GPT2_SHORT_K_CANDIDATES, GPT2_WEIGHT_GRADIENT_CANDIDATES),
}


TILE_LOOP = "tl.range(tl.program_id(axis=0), work, NUM_PROGRAMS)"
K_LOOP = "for k in range(k_first, k_last):"


@functools.cache
def flat_kernel():
    """Chapter 07's ``matmul_tma_kernel`` with its loop nest flattened and the K loop over
    every K step: right for configs without ``SPLIT_TAIL`` only (``flat``)."""
    return sm90.kernel_variant(
        hopper.matmul_tma_kernel,
        "matmul_tma_flat",
        [(TILE_LOOP, TILE_LOOP[:-1] + ", flatten=True)", 1), (K_LOOP, "for k in range(0, k_steps):", 1)],
    )


@contextlib.contextmanager
def flat(config: dict):
    """Within the block ``matmul_tma(config=config)`` launches ``flat_kernel``."""
    if config.get("SPLIT_TAIL"):
        raise ValueError("the flat variant reads every K step of a tile: no SPLIT_TAIL")
    with mock.patch.object(hopper, "matmul_tma_kernel", flat_kernel()):
        yield


def products(shape: dict, dtype: torch.dtype, seed: int = 0, values: bool = True, only=()):
    """(name, a, b, runs a step) for every product of a step, as ``linear`` calls them
    (``values``: random, else left as allocated; ``only``: the products whose names hold
    one of these words, every product if none)."""
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
    return [product for product in found if not only or any(w in product[0] for w in only)]


def route(a, b) -> str:
    """The kernel ``matmul`` takes for a @ b on this machine (or device profile), as
    ``chosen_product`` chooses it (an operand realigned for a long K)."""
    (M, K), N = a.shape, b.shape[1]
    long_k = matmul_tuning.splits_k(M, N, K)
    if on_descriptors(a.dtype, M, N, K) and hopper.tma_operands(a, b, long_k) is not None:
        return "descriptor, K split" if long_k else "descriptor"
    return "portable"


def descriptor_operands(a, b):
    """The operands chapter 07's kernel would take for a @ b (realigned), or None."""
    return hopper.tma_operands(a, b, realign=True)


def describe(config: dict, num_warps=None, num_stages=None) -> str:
    tile = f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']}"
    text = f"{tile}/{num_stages}s/{num_warps}w"
    if config.get("PROGRAMS_PER_SM", 1) > 1:
        text += f" {config['PROGRAMS_PER_SM']}/SM"
    if config.get("SPLIT_TAIL"):
        text += f" split<={config.get('MAX_SPLITS', matmul_tuning.MAX_SPLITS)}"
    return text


def busy(M: int, N: int, K: int, config: dict) -> float:
    """The share of the SMs' time that ``config``'s persistent schedule keeps busy, each K
    step of each tile costing the same: items as the kernel deals them (whole tiles, then
    a split tail's shares), program p on SM p % SMs."""
    sms, grid = sm_count(), matmul_tuning.programs(config)
    tiles = -(-M // config["BLOCK_M"]) * -(-N // config["BLOCK_N"])
    k_steps = -(-K // config["BLOCK_K"])
    splits = matmul_tuning.tail_shares(M, N, K, config, grid) if config.get("SPLIT_TAIL") else 1
    whole = tiles - tiles % grid if splits > 1 else tiles
    steps = [k_steps] * whole
    for share in range((tiles - whole) * splits):
        part = share % splits
        steps.append((part + 1) * k_steps // splits - part * k_steps // splits)
    per_sm = [0] * sms
    for item, cost in enumerate(steps):
        per_sm[item % grid % sms] += cost
    return sum(steps) / (sms * max(per_sm))


def timed_configs(a, b) -> list[str]:
    """The descriptor kernel's configs the autotuner times for a @ b, with tiles, programs,
    waves and the shares of a split tile."""
    (M, K), N = a.shape, b.shape[1]
    named = {"a_ptr": a, "M": M, "N": N, "K": K}
    configs = matmul_tuning.keep_tma_configs(hopper.TMA_CONFIGS, named)
    return [config_line(M, N, K, c.kwargs, c.num_warps, c.num_stages) for c in configs]


def config_line(M, N, K, kwargs, num_warps, num_stages, mark="") -> str:
    tiles = -(-M // kwargs["BLOCK_M"]) * -(-N // kwargs["BLOCK_N"])
    programs = matmul_tuning.programs(kwargs)
    line = f"  {mark:1} {describe(kwargs, num_warps, num_stages):32}"
    line += f" {tiles:5} tiles / {programs} programs = {tiles / programs:5.2f} waves"
    line += f", {-(-K // kwargs['BLOCK_K']):3} K steps, busy {busy(M, N, K, kwargs):4.0%}"
    if kwargs.get("SPLIT_TAIL"):
        line += f", {matmul_tuning.tail_shares(M, N, K, kwargs, programs)} shares a tail tile"
    return line


def candidate_configs(name: str, shape_name: str) -> list[dict]:
    """The fixed configs ``--candidates`` times for a product of ``shape_name``'s step."""
    short_k, weight_gradient = CANDIDATES[shape_name]
    if "dW" not in name:
        return [tile_kwargs(*c) for c in short_k]
    configs = []
    for *tile, most in weight_gradient:
        split = {"SPLIT_TAIL": True, "MAX_SPLITS": most} if most > 1 else {}
        configs.append({**tile_kwargs(*tile), **split})
    return configs


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


def candidate_lines(name, a, b, torch_ms, shape_name):
    """Fixed configs' rates for a @ b against torch's time."""
    want = torch.matmul(a, b).float()
    a, b = descriptor_operands(a, b)
    for config in candidate_configs(name, shape_name):
        kernels = [("", contextlib.nullcontext)]
        if not config.get("SPLIT_TAIL") and "dW" not in name:
            kernels.append((" flat", functools.partial(flat, config)))
        for label, launching in kernels:
            call = fixed(a, b, config)
            with launching():
                torch.testing.assert_close(call().float(), want, rtol=2e-2, atol=2e-1)
                ms = bench.measure_ms(call)[0]
            text = describe(config, config["num_warps"], config["num_stages"]) + label
            rate = bench.per_time(flops(a, b), ms, "TFLOP/s")
            print(f"      {text:37} {ms * 1e3:7.1f} us {rate:5.0f} TFLOP/s  torch/ours {torch_ms / ms:4.2f}")


def tile_kwargs(block_m, block_n, block_k, stages, warps, per_sm):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_SIZE_M": 8,
            "num_stages": stages, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}  # fmt: skip


def time_products(shape_name, candidates: bool, only=()):
    shape, dtype = SHAPES[shape_name], torch.bfloat16
    total_ours = total_torch = 0.0
    print(f"{'product':22} {'M x N x K':>20} {'kernel':20} {'ours us':>8} {'TFLOP/s':>8} "
          f"{'torch us':>8} {'TFLOP/s':>8} {'torch/ours':>10}  config")  # fmt: skip
    for name, a, b, runs in products(shape, dtype, only=only):
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
        if candidates and descriptor_operands(a, b) is not None:
            candidate_lines(name, a, b, torch_ms, shape_name)
    which = f"the products of {' or '.join(only)}" if only else "a step's products"
    print(f"{which} (each times its runs): ours {total_ours:.3f} ms, torch "
          f"{total_torch:.3f} ms, torch/ours {total_torch / total_ours:.2f}")  # fmt: skip


def print_configs(shape_name, candidates: bool):
    """Per product: its kernel, the configs timed, and (``candidates``, marked +) the
    fixed configs ``--candidates`` times."""
    print(f"{sm_count()} SMs, {shape_name}")
    for name, a, b, runs in products(SHAPES[shape_name], torch.bfloat16, values=False):
        (M, K), N = a.shape, b.shape[1]
        print(f"{name:22} {f'{M}x{N}x{K}':>20} {route(a, b)}, {runs} a step")
        if route(a, b) != "portable":
            print("\n".join(timed_configs(a, b)))
        if candidates and descriptor_operands(a, b) is not None:
            for config in candidate_configs(name, shape_name):
                warps, stages = config["num_warps"], config["num_stages"]
                print(config_line(M, N, K, config, warps, stages, "+"))


def check(shape):
    """Every product of a toy step against torch (fp32, the interpreter), and the flat
    variant of chapter 07's kernel against the package's on the forward and dX products."""
    for name, a, b, _ in products(shape, torch.float32):
        torch.testing.assert_close(matmul(a, b), a @ b, rtol=1e-4, atol=1e-4 * a.shape[1] ** 0.5)
        text = ""
        operands = descriptor_operands(a, b)
        if "dW" not in name and operands is not None:
            config = tile_kwargs(16, 16, 16, 2, 4, 1)  # a toy tile: several tiles, K steps
            with flat(config):
                got = hopper.matmul_tma(*operands, config=config)
            want = hopper.matmul_tma(*operands, config=config)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            text = ", the flat variant matches the package"
        print(f"{name:22} {route(a, b):20} matches torch{text}")


def compile_flat():
    """(No GPU, run as ``--compile-flat``: not interpreted.) The package's kernel and the
    flat variant compiled for sm_90 at GPT-2 small's forward layout (bf16, A row-major, B
    column-major, bias) for the short-K candidates: shared memory, registers, spills and
    whether the variant's PTX differs from the package's."""
    signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16",
                 "pre_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32",
                 "M": "i32", "N": "i32", "K": "i32", "stride_a": "i32",
                 "stride_b": "i32", "stride_bias": "i32"}  # fmt: skip
    aligned = [name for name in signature if name not in ("stride_bias", "bias_ptr")]
    for block_m, block_n, block_k, stages, warps, per_sm in GPT2_SHORT_K_CANDIDATES:
        constants = {"A_COLUMN_MAJOR": False, "B_COLUMN_MAJOR": True, "ACTIVATION": None,
                     "HAS_BIAS": True, "STORE_PREACTIVATION": False, "INPUT_PRECISION": "tf32",
                     "UPCAST": False, "NUM_SMS": 132, "BLOCK_M": block_m, "BLOCK_N": block_n,
                     "BLOCK_K": block_k, "GROUP_SIZE_M": 8, "ACCUMULATE": False,
                     "SPLIT_TAIL": False, "MAX_SPLITS": 8, "PROGRAMS_PER_SM": per_sm}  # fmt: skip
        codes = []
        for label, kernel in (("package", hopper.matmul_tma_kernel), ("flat", flat_kernel())):
            tile = f"{block_m}x{block_n}x{block_k}/{stages}s/{warps}w" + (f" {per_sm}/SM" if per_sm > 1 else "")
            try:
                compiled = sm90.compile_sm90(kernel, signature, constants, aligned, num_warps=warps, num_stages=stages)
            except Exception as error:  # noqa: BLE001 - a finding: report and go on
                print(f"{tile:24} {label:8} does not compile: {type(error).__name__}: {str(error)[:200]}")
                continue
            registers, spilled = resources(compiled)
            codes.append(ptx_code(compiled.asm["ptx"]))
            same = ", PTX as the package's" if codes[0] == codes[-1] else ", PTX differs"
            same = "" if label == "package" else same
            print(f"{tile:24} {label:8} {compiled.metadata.shared:7} B shared, {registers:3} registers, "
                  f"{spilled} B spilled, PTX {len(codes[-1])} lines{same}", flush=True)  # fmt: skip


def resources(compiled) -> tuple[int, int]:
    """(registers a thread, local memory a thread in bytes) from ``cuobjdump``."""
    text = sm90.nvidia_tool("cuobjdump", "--dump-resource-usage", sm90.cubin_file(compiled))
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", text)
    return int(found.group(1)), int(found.group(2))


def ptx_code(ptx: str) -> list:
    """The PTX's lines of code, its debug lines left out (as lab/matmul_flatten.py's)."""
    debug = re.compile(r"\s*(\.loc|\.file|//|\$L__|\.section|\.b8|\.b32|\.b64)")
    return [line for line in ptx.splitlines() if line.strip() and not debug.match(line)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", action="store_true", help="kernels and configs only")
    parser.add_argument("--candidates", action="store_true", help="also time fixed configs")
    parser.add_argument("--before", action="store_true", help="dW on the portable kernel")
    parser.add_argument("--shape", choices=SHAPES, default="shakespeare", help="the step's shape")
    parser.add_argument("--long-k", type=int, help="matmul_tuning.LONG_K for this run")
    parser.add_argument("--compile", action="store_true", help="compile the candidates")
    parser.add_argument("--compile-flat", action="store_true", help="compile the flat variant")
    parser.add_argument("--only", nargs="+", default=(), help="products whose names hold a word")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as rules:
        if args.before:
            rules.enter_context(before_issue_41())
        if args.long_k is not None:
            rules.enter_context(mock.patch.object(matmul_tuning, "LONG_K", args.long_k))
        if args.compile_flat:
            compile_flat()
        elif args.compile:
            compile_candidates(args.shape)
        elif args.configs:
            print_configs(args.shape, args.candidates)
        elif ON_GPU:
            time_products(args.shape, args.candidates, args.only)
        else:
            check(TOY)


def compile_candidates(shape_name: str):
    """(No GPU; ``STEPKERNELS_DEVICE_PROFILE=sm90``.) Every candidate's launch over the
    step's products, recorded under the interpreter as ``tools/check_targets.py`` records
    the exercises' and compiled for sm_90 by its functions: shared memory, registers and
    spills, and what breaks the profile's limits."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import check_targets
    from triton.runtime.interpreter import InterpretedFunction

    launches = {}

    def keep(self, *args, grid, warmup, **kwargs):  # check_targets.recorded_launches's
        runtime = set(self.arg_names) - check_targets._constexpr_names(self.fn)
        launch = {
            "kernel": f"{self.fn.__module__}:{self.fn.__qualname__}",
            "args": [check_targets._described(a, n not in runtime)
                     for a, n in zip(args, self.arg_names, strict=False)],
            "kwargs": {k: check_targets._described(v, k not in runtime)
                       for k, v in sorted(kwargs.items())},
        }  # fmt: skip
        launches.setdefault(json.dumps(launch, sort_keys=True), launch)

    check_targets.choose_as_on_a_gpu()
    named = {}
    with check_targets._patched(InterpretedFunction, "run", keep):
        for name, a, b, _ in products(SHAPES[shape_name], torch.bfloat16, values=False):
            operands = descriptor_operands(a, b)
            for config in candidate_configs(name, shape_name) if operands else ():
                before = len(launches)
                hopper.matmul_tma(*operands, config=config)
                if len(launches) > before:
                    text = describe(config, config["num_warps"], config["num_stages"])
                    named[len(launches) - 1] = f"{name}: {text}"
    results = check_targets.compile_launches(list(launches.values()), "sm90", jobs=1)
    for index, result in enumerate(results):
        found = "; ".join(check_targets.problems(result, "sm90")) or "ok"
        print(f"{named.get(index, '(same binary as above)'):52} {result.get('shared', '?'):>7} B "
              f"shared, {result.get('registers', '?'):>3} registers, "
              f"{result.get('spilled', '?')} B spilled, {found}")  # fmt: skip


@contextlib.contextmanager
def before_issue_41():
    """No product is a weight gradient's shape: dW goes to the portable kernel again."""
    never = lambda M, N, K: False  # noqa: E731
    with mock.patch.object(matmul_module, "splits_k", never):
        with mock.patch.object(matmul_tuning, "splits_k", never):
            yield


if __name__ == "__main__":
    main()
