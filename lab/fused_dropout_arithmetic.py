"""What sets the pace of the fused bias + GELU + dropout forward: one suspect removed at a time.

Run on a GPU from the repository root (``PYTHONPATH=src``)::

    python lab/fused_dropout_arithmetic.py

Chapter 06's fused forward runs at about the same elements per second in fp16 as in fp32, far
below a copy in fp16. Variants of its kernel (same launch, same tiles) change one thing each:
the generator (none; one Philox call per four elements as recorded; per eight elements, 16 bits
each, compared as integers; 7 rounds instead of 10) and GELU (none; ``erf`` from libdevice;
an ``erf`` from a short rational approximation). GB/s counts 2N elements' bytes; the copy moves
the same bytes. Under the interpreter it checks that the variants agree where they should.
"""

from stepkernels.lessons import bench
from stepkernels.ops.dropout import fused_launch
from stepkernels.runtime import core
import torch
import triton
import triton.language as tl


@triton.jit
def erf_fast(x):
    # Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7, one exp and one reciprocal.
    a = tl.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                + t * (-1.453152027 + t * 1.061405429))))  # fmt: skip
    y = 1.0 - poly * tl.exp(-a * a)
    return tl.where(x < 0, -y, y)


@triton.jit
def variant_kernel(x_ptr, bias_ptr, out_ptr, n_rows, n_cols, rows_per_program, p,
                   threshold, scale, seed, RNG: tl.constexpr, GELU: tl.constexpr,
                   BLOCK_COLS: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    groups_per_block: tl.constexpr = BLOCK_COLS // LANES
    col_groups = tl.program_id(1) * groups_per_block + tl.arange(0, groups_per_block)
    lane = tl.arange(0, LANES)[None, :]
    cols = col_groups[:, None] * LANES + lane
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols).to(tl.float32)
    first_row = tl.program_id(0).to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=2):
        row = first_row + i
        in_bounds = cols < tl.where(row < n_rows, n_cols, 0)
        counters = (row * ((n_cols + LANES - 1) // LANES) + col_groups).to(tl.uint32)
        offsets = row * n_cols + cols
        z = tl.load(x_ptr + offsets, mask=in_bounds).to(tl.float32) + bias
        if GELU == 1:
            z = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
        elif GELU == 2:
            z = 0.5 * z * (1.0 + erf_fast(z * 0.7071067811865476))
        if RNG == 0:
            keep = z == z
        elif RNG == 1 or RNG == 3:  # four floats per call, compared with p
            r0, r1, r2, r3 = tl.rand4x(seed, counters, 10 if RNG == 1 else 7)
            r = tl.where(lane == 0, r0[:, None], tl.where(lane == 1, r1[:, None],
                         tl.where(lane == 2, r2[:, None], r3[:, None])))  # fmt: skip
            keep = r >= p
        else:  # eight 16-bit integers per call, compared with round(p * 2^16)
            r0, r1, r2, r3 = tl.randint4x(seed, counters)
            word = lane // 2
            r = tl.where(word == 0, r0[:, None], tl.where(word == 1, r1[:, None],
                         tl.where(word == 2, r2[:, None], r3[:, None])))  # fmt: skip
            bits = (r.to(tl.uint32, bitcast=True) >> ((lane % 2) * 16).to(tl.uint32)) & 0xFFFF
            keep = bits.to(tl.int32) >= threshold
        out = tl.where(keep, z * scale, 0.0)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


VARIANTS = {  # name: (RNG, GELU, elements per row of the tile)
    "recorded (Philox per 4, libdevice erf)": (1, 1, 4),
    "bias only, tiles [G, 4]": (0, 0, 4),
    "bias only, tiles [G, 8]": (0, 0, 8),
    "no dropout, libdevice erf": (0, 1, 4),
    "no dropout, libdevice erf, [G, 8]": (0, 1, 8),
    "no dropout, fast erf, [G, 8]": (0, 2, 8),
    "Philox per 4, no GELU": (1, 0, 4),
    "Philox per 8 (16 bits), no GELU": (2, 0, 8),
    "Philox per 8 (16 bits), libdevice erf": (2, 1, 8),
    "Philox per 4 (7 rounds), libdevice erf": (3, 1, 4),
    "Philox per 4, fast erf": (1, 2, 4),
    "Philox per 8 (16 bits), fast erf": (2, 2, 8),
}


def launch(x, bias, rng, gelu, lanes=4, p=0.1, seed=1234, warps=4):
    out = torch.empty_like(x)
    block_cols, rows_per_program, grid = fused_launch(*x.shape, backward=True)  # strips
    variant_kernel[grid](x, bias, out, *x.shape, rows_per_program, p, round(p * 2**16),
                         1 / (1 - p), seed, RNG=rng, GELU=gelu, BLOCK_COLS=block_cols,
                         LANES=lanes, num_warps=warps)  # fmt: skip
    return out


def main() -> None:
    if not core.ON_GPU:
        x = torch.randn(8, 64)
        bias = torch.randn(64)
        exact = launch(x, bias, 0, 1)
        torch.testing.assert_close(launch(x, bias, 0, 2, 8), exact, atol=1e-6, rtol=0)
        for rng, lanes in ((1, 4), (2, 8), (3, 4)):
            kept = launch(torch.ones(64, 64), torch.zeros(64), rng, 0, lanes) != 0
            print(f"RNG {rng}: kept {kept.float().mean():.3f} of 4,096 at p = 0.1")
        print("interpreter: variants agree; run on a GPU for timings")
        return
    rows, cols = 2**26 // 4096, 4096
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        bias = torch.randn(cols, device="cuda", dtype=dtype)
        nbytes = 2 * x.numel() * x.element_size()
        copy = bench.per_time(nbytes, bench.measure_ms(bench.copy_of(nbytes))[0], "GB/s")
        print(f"{dtype}, {rows} x {cols}: copy of the same bytes {copy:,.0f} GB/s")
        for name, variant in VARIANTS.items():
            for warps in (4, 8):
                ms = bench.measure_ms(lambda x=x, b=bias, v=variant, w=warps: launch(x, b, *v, warps=w))[0]
                rate = bench.per_time(nbytes, ms, "GB/s")
                print(f"  {name:<42} {warps} warps {rate:7,.0f} GB/s ({rate / copy:.0%})")


if __name__ == "__main__":
    main()
