"""Chapter 03's one-block layer-norm backward over launches, and what its second kernel costs.

Run from the repository root (``PYTHONPATH=src``)::

    python lab/layer_norm_backward_launch.py            # GPU: time; CPU: check
    python lab/layer_norm_backward_launch.py --stages   # 2, 3 or 4 stages
    python lab/layer_norm_backward_launch.py --sum      # the second kernel

At M = 4,096 rows of N = 4,096 and 8,192 columns, fp16 and fp32, GB/s of the backward's
compulsory bytes (x and dy read, dx written; the benchmark's count):

* the package's two-stage backward, and ``sum_partials_kernel`` alone on its partials (the
  second kernel: how much of the gap to a copy it is);
* the backward kernel over rows a program (8 to 64: programs per SM), warps (4 to 16) and
  pipeline stages (2 to 4), two-stage reduction included; the five best, then those and the
  package timed again in alternation, since one launch moves by 1-2% from timing to timing.

``--stages``: the package's launch with 2, 3 or 4 stages, alternating, at N = 1,024 to 4,096.
``--sum``: ``sum_partials_kernel`` alone over tiles (partial rows x columns) and warps, at the
partial counts the package makes for N = 1,024 to 65,536 (L2 flushed before each replay, so
it overstates the kernel's time in the backward, where its partials were just written).
"""

import itertools
import sys

from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import backward_config, layer_norm_backward, layer_norm_forward
from stepkernels.runtime import core
from stepkernels.runtime.partials import sum_partials_kernel
import torch
import triton

N_ROWS = 4096


def inputs(n_rows, n_cols, dtype, offset=0.0):
    """dy, x, weight, mean, rstd: a backward's inputs, rows centred on ``offset``."""
    x = torch.randn(n_rows, n_cols, device=core.DEVICE, dtype=dtype) + offset
    weight, bias = (torch.randn(n_cols, device=x.device, dtype=dtype) for _ in "wb")
    _, mean, rstd = layer_norm_forward(x, weight, bias, 1e-5)
    return torch.randn_like(x), x, weight, mean, rstd


def alternating(calls: dict, nbytes: int, rounds: int = 3) -> dict:
    """Each call's mean GB/s over ``rounds`` rounds, the calls timed in turn (past drift)."""
    totals = dict.fromkeys(calls, 0.0)
    for _, (name, call) in itertools.product(range(rounds), calls.items()):
        totals[name] += bench.rate(nbytes, call) / rounds
    return totals


def shares(totals: dict, copy: float) -> str:
    """``name GB/s (share of a copy)`` for each, separated by semicolons."""
    return "; ".join(f"{k} {v:,.0f} ({v / copy:.0%})" for k, v in totals.items())


def sum_alone(n_partials, n_cols, dtype, block_p=32, block_n=None, warps=4):
    """The second kernel on ``n_partials`` rows of partials, by default as the package (before
    this experiment) launched it."""
    partials = torch.randn(n_partials, 2, n_cols, device=core.DEVICE)
    dw, db = (torch.empty(n_cols, device=partials.device, dtype=dtype) for _ in "wb")
    default = triton.next_power_of_2(triton.cdiv(n_cols, 2 * core.sm_count()))
    block_n = block_n or min(128, max(16, default))

    def call():
        sum_partials_kernel[(triton.cdiv(n_cols, block_n),)](
            partials, partials, dw, db, n_partials, n_cols, HAS_COUNTS=False, HAS_DW=True,
            HAS_DB=True, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=warps,
        )  # fmt: skip
        return dw, db

    return call, partials


def launches(n_cols, itemsize):
    block = triton.next_power_of_2(n_cols)
    for rows, warps, stages in itertools.product((8, 16, 32, 64), (4, 8, 16), (2, 3, 4)):
        per_thread = block // (32 * warps)
        if not 4 <= per_thread <= 64 or stages * 2 * block * itemsize > 160 * 1024:
            continue
        yield dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, NUM_STAGES=stages, num_warps=warps)


def label(config):
    return f"rows {config['ROWS_PER_PROGRAM']} w{config['num_warps']} st{config['NUM_STAGES']}"


def check():
    for dtype in (torch.float32, torch.float16):
        args = inputs(37, 1000, dtype)
        want = layer_norm_backward(*args)
        configs = list(launches(1000, args[1].element_size()))
        assert configs
        for config in configs:
            got = layer_norm_backward(*args, config=config)
            torch.testing.assert_close(got[0], want[0])  # warps change the sums' order
            for ours, theirs in zip(got[1:], want[1:], strict=True):
                torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
        for block_p, block_n, warps in itertools.product((4, 8), (16, 64), (1, 4)):
            call, partials = sum_alone(5, 100, dtype, block_p, block_n, warps)
            want = [partials[:, i].sum(0).to(dtype) for i in (0, 1)]
            torch.testing.assert_close(call(), want, rtol=1e-3, atol=1e-3)
    print("every launch gives the package's dx, dW and dB")


def sweep():
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (4096, 8192)):
        args = inputs(N_ROWS, n_cols, dtype)
        size = args[1].element_size()
        nbytes = 3 * args[1].numel() * size
        copy = bench.rate(nbytes, bench.copy_of(nbytes))
        package = backward_config(n_cols, N_ROWS, itemsize=size)
        n_partials = triton.cdiv(N_ROWS, package["ROWS_PER_PROGRAM"])
        summing, _ = sum_alone(n_partials, n_cols, dtype)
        sum_us = bench.measure_ms(summing)[0] * 1e3
        whole_us = bench.measure_ms(lambda a=args: layer_norm_backward(*a))[0] * 1e3
        name = f"{core.dtype_name(dtype)}, N = {n_cols:,}"
        print(f"{name}: copy {copy:,.0f} GB/s; package ({label(package)}) {whole_us:.1f} µs, "
              f"{nbytes / whole_us / 1e3:,.0f} GB/s ({nbytes / whole_us / 1e3 / copy:.0%}); "
              f"sum_partials alone on {n_partials} partials {sum_us:.1f} µs")  # fmt: skip
        rated = []
        for config in launches(n_cols, size):
            call = lambda a=args, c=config: layer_norm_backward(*a, config=c)
            rated.append((bench.rate(nbytes, call), label(config), config))
        rated.sort(key=lambda r: -r[0])
        print("  best five:", "; ".join(f"{r[1]} {r[0]:,.0f}" for r in rated[:5]))
        again = {"package": package, **{r[1]: r[2] for r in rated[:3]}}
        calls = {k: lambda a=args, c=c: layer_norm_backward(*a, config=c) for k, c in again.items()}
        print("  again, mean of 3 alternating:", shares(alternating(calls, nbytes), copy))


def sum_sweep():
    """``sum_partials_kernel`` alone over tiles and warps, at the partials the package makes."""
    for n_partials, n_cols in ((512, 1024), (256, 2048), (128, 4096), (128, 8192), (32, 16384),
                               (32, 65536)):  # fmt: skip
        rated = []
        for block_p, block_n, warps in itertools.product((32, 64, 128, 256), (16, 32, 64, 128),
                                                         (2, 4, 8)):  # fmt: skip
            if block_p > max(32, triton.next_power_of_2(n_partials)):
                continue
            if not 4 <= block_p * block_n // (32 * warps) <= 128:
                continue
            if 2 * 2 * block_p * block_n * 4 > 160 * 1024:  # 2 stages of dW and dB tiles
                continue
            call, _ = sum_alone(n_partials, n_cols, torch.float16, block_p, block_n, warps)
            rated.append((bench.measure_ms(call)[0] * 1e3, f"P{block_p} N{block_n} w{warps}"))
        rated.sort()
        default, _ = sum_alone(n_partials, n_cols, torch.float16)
        before = bench.measure_ms(default)[0] * 1e3
        print(f"sum of {n_partials} partials, N = {n_cols:,}: as launched {before:.1f} µs; best:",
              "; ".join(f"{r[1]} {r[0]:.1f}" for r in rated[:5]), flush=True)  # fmt: skip


def stages_sweep():
    """The package's launch with 2, 3 or 4 stages, alternating, shorter rows included."""
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (1024, 2048, 4096)):
        args = inputs(N_ROWS, n_cols, dtype)
        nbytes = 3 * args[1].numel() * args[1].element_size()
        package = backward_config(n_cols, N_ROWS, itemsize=args[1].element_size())
        calls = {
            stages: lambda a=args, c={**package, "NUM_STAGES": stages}: layer_norm_backward(*a, config=c)
            for stages in (2, 3, 4)
        }
        totals = alternating(calls, nbytes)
        print(f"{core.dtype_name(dtype)}, N = {n_cols:,}, {label(package)}; by stages:",
              "; ".join(f"{k} {v:,.0f}" for k, v in totals.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    check()
    if core.ON_GPU:
        with bench.side_stream():
            {"--sum": sum_sweep, "--stages": stages_sweep}.get(sys.argv[-1], sweep)()
