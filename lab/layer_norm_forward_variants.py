"""Chapter 03's forward against torch.compile and Liger-Kernel: cache hints, warps, split rows.

The recorded forward is 2 to 6% behind torch.compile from N = 4,096 to 32,768 and reads rows
past 32,768 twice (65% of a copy at 65,536). Two suspects, one at a time, at M = 4,096:

* cache hints: every program reads the weight and the bias, each value of x once. Inductor's
  kernels mark such loads ``evict_last`` and ``evict_first``; chapter 03's loads say nothing.
  ``rows_kernel`` is the chapter's one-block loop with the hints as constexprs, timed over warps
  and over a capped grid (8 programs per SM, two stages) or one program per block of rows;
* long rows: ``split_kernel`` gives each program one chunk of a row, as chapter 02's split
  softmax does: it publishes its chunk's mean and sum of squared deviations, waits for the row's
  other chunks (``publish_and_wait``), merges the pairs by Chan's rule and writes its chunk of y
  from registers, so x is read once. If a sibling never publishes it walks the row itself.

    python lab/layer_norm_forward_variants.py [--reload | --walked | --lanes | --inductor | --even]

``--walked`` times rows that fit one program read twice, as torch.compile's kernels do: a
first walk loading ``evict_last`` (x stays in L2), a second loading ``evict_first``.
``--lanes`` times the same walks with per-lane accumulators as torch.compile's kernel keeps
them (Welford's update in each lane, one reduction across lanes after the walk), the next
suspect in ``layer_norm_forward_walked.log``; not yet run on a GPU.
``--even`` times the one-block launches with and without masks (``EVEN``: N a power of two,
every load and store unmasked, as in torch.compile's kernels, which know M and N when they
compile), N = 4,096 to 32,768.
``--inductor`` times both walks at the block and warps torch.compile's autotuner took at each
size (``layer_norm_inductor_config.log``: 16 or 32 warps, blocks up to the whole row).
``--reload`` times only the split forward at M x N = 2^26, holding its chunk in registers
across the wait or reading it again (from L2) after it, which frees registers for more
programs per SM (Nsight Compute: 168 registers a thread in fp16, 3 programs an SM).

Under the interpreter it checks both kernels against torch; on a GPU it prints, per dtype and N,
the best launches of each kernel next to the package's, torch.compile, Liger-Kernel (when
installed) and a copy of the same bytes.
"""

import functools
import itertools
import sys

from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import layer_norm_forward
from stepkernels.runtime import core
from stepkernels.runtime.waiting import MAX_POLLS, publish_and_wait
import torch
import triton
import triton.language as tl

ROWS = 4096


@triton.jit
def rows_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, M, N, eps,
        BLOCK_N: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, NUM_STAGES: tl.constexpr,
        X_EVICT: tl.constexpr, W_EVICT: tl.constexpr, EVEN: tl.constexpr = False):  # fmt: skip
    # EVEN: N == BLOCK_N and M a multiple of ROWS_PER_PROGRAM, so no load or store is masked
    # (torch.compile's kernels know M and N when they compile, and drop such masks).
    n_blocks, grid_size = tl.cdiv(M, ROWS_PER_PROGRAM), tl.num_programs(axis=0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    for block in tl.range(tl.program_id(0), n_blocks, grid_size, num_stages=NUM_STAGES):
        rows = block * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr + offsets, eviction_policy=X_EVICT).to(tl.float32)
            mean = tl.sum(x, axis=1) / BLOCK_N
            centered = x - mean[:, None]
            rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / BLOCK_N + eps)
            w = tl.load(w_ptr + cols, eviction_policy=W_EVICT)
            b = tl.load(b_ptr + cols, eviction_policy=W_EVICT)
        else:
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0, eviction_policy=X_EVICT)
            x = x.to(tl.float32)
            mean = tl.sum(x, axis=1) / N
            centered = tl.where(mask, x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, eviction_policy=W_EVICT)
            b = tl.load(b_ptr + cols, mask=col_mask, other=0.0, eviction_policy=W_EVICT)
        y = centered * rstd[:, None] * w.to(tl.float32) + b.to(tl.float32)
        if EVEN:
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty))
            tl.store(mean_ptr + rows, mean)
            tl.store(rstd_ptr + rows, rstd)
        else:
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(mean_ptr + rows, mean, mask=row_mask)
            tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def walked_statistics(x_row, N, BLOCK_N: tl.constexpr):
    """The fallback: mean and sum of squared deviations of a row, walked, Chan's merge."""
    count, mean, m2 = 0.0, 0.0, 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        block_count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
        block_mean = tl.sum(x, axis=0) / block_count
        deviation = tl.where(mask, x - block_mean, 0.0)
        total, delta = count + block_count, block_mean - mean
        mean = mean + delta * (block_count / total)
        m2 = m2 + tl.sum(deviation * deviation, axis=0) + delta * delta * (count * block_count / total)
        count = total
    return mean, m2


@triton.jit
def write_row(x_row, y_row, w_ptr, b_ptr, mean_at, rstd_at, mean, m2, N, eps, BLOCK_N: tl.constexpr,
        SECOND: tl.constexpr):  # fmt: skip
    """The walks' second pass: y of a row from its mean and M2, x loaded with ``SECOND``'s
    eviction policy, weight and bias kept in L2; then the row's mean and rstd."""
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=SECOND).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_row + cols, ((x - mean) * rstd * w + b).to(y_row.dtype.element_ty), mask=mask)
    tl.store(mean_at, mean)
    tl.store(rstd_at, rstd)


@triton.jit
def walked_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, N, eps, BLOCK_N: tl.constexpr,
        FIRST: tl.constexpr, SECOND: tl.constexpr):  # fmt: skip
    """A row a program, read twice: Chan's walk for the statistics, loading with ``FIRST``'s
    eviction policy, then a walk writing y, loading with ``SECOND``'s (torch.compile's
    kernels load evict_last, then evict_first: the second read comes from L2)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * N, y_ptr + row * N
    count, mean, m2 = 0.0, 0.0, 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0, eviction_policy=FIRST).to(tl.float32)
        block_count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
        block_mean = tl.sum(x, axis=0) / block_count
        deviation = tl.where(cols < N, x - block_mean, 0.0)
        total, delta = count + block_count, block_mean - mean
        mean = mean + delta * (block_count / total)
        m2 = m2 + tl.sum(deviation * deviation, axis=0) + delta * delta * count * block_count / total
        count = total
    write_row(x_row, y_row, w_ptr, b_ptr, mean_ptr + row, rstd_ptr + row, mean, m2, N, eps, BLOCK_N, SECOND)


@triton.jit
def welford_combine(mean_a, m2_a, count_a, mean_b, m2_b, count_b):
    """Chan's rule for two (mean, M2, count) triples; an empty side gives the other."""
    count = count_a + count_b
    delta = mean_b - mean_a
    share_b = tl.where(count > 0, count_b / tl.maximum(count, 1.0), 0.0)
    return mean_a + delta * share_b, m2_a + m2_b + delta * delta * count_a * share_b, count


@triton.jit
def lanes_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, N, eps, BLOCK_N: tl.constexpr,
        FIRST: tl.constexpr, SECOND: tl.constexpr):  # fmt: skip
    """``walked_kernel`` with per-lane accumulators, as torch.compile's kernel keeps them:
    each of the BLOCK_N lanes runs Welford's update on the values it loads, with no reduction
    across lanes until the walk ends (then one ``tl.reduce`` by Chan's rule)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * N, y_ptr + row * N
    mean = tl.zeros((BLOCK_N,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    count = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=FIRST).to(tl.float32)
        count += tl.where(mask, 1.0, 0.0)
        delta = x - mean
        mean += tl.where(mask, delta / tl.maximum(count, 1.0), 0.0)
        m2 += tl.where(mask, delta * (x - mean), 0.0)
    mean, m2, _ = tl.reduce((mean, m2, count), 0, welford_combine)
    write_row(x_row, y_row, w_ptr, b_ptr, mean_ptr + row, rstd_ptr + row, mean, m2, N, eps, BLOCK_N, SECOND)


def forward_walked(x, w, b, block=2048, warps=8, first="evict_last", second="evict_first", lanes=False):
    n_rows, n_cols = x.shape
    y, mean, rstd = torch.empty_like(x), torch.empty(n_rows, device=x.device), torch.empty(n_rows, device=x.device)
    kernel = lanes_kernel if lanes else walked_kernel
    kernel[(n_rows,)](x, y, w, b, mean, rstd, n_cols, 1e-5, BLOCK_N=block, FIRST=first, SECOND=second,
                      num_warps=warps)  # fmt: skip
    return y, mean, rstd


# (block, warps) torch.compile's autotuner took for its looped kernel at M = 4,096
# (``layer_norm_inductor_config.log``)
INDUCTOR_LAUNCH = {(torch.float16, 4096): (2048, 16), (torch.float16, 8192): (2048, 16),
                   (torch.float16, 16384): (8192, 32), (torch.float16, 32768): (32768, 32),
                   (torch.float32, 4096): (2048, 16), (torch.float32, 8192): (4096, 16),
                   (torch.float32, 16384): (8192, 32), (torch.float32, 32768): (32768, 32)}  # fmt: skip


def walked_sweep():
    """Rows that fit one program, read twice as torch.compile does, against ours (M = 4,096)."""
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (4096, 8192, 16384, 32768)):
        x = torch.randn(4096, n_cols, device="cuda", dtype=dtype)
        w, b = torch.rand(n_cols, device="cuda", dtype=dtype) + 0.5, torch.randn_like(x[0])
        nbytes = 2 * x.numel() * x.element_size()
        compiled = bench.compile_static(torch.nn.functional.layer_norm)
        rated = {"copy": bench.rate(nbytes, bench.copy_of(nbytes)),
                 "torch.compile": bench.rate(nbytes, functools.partial(compiled, x, (n_cols,), w, b)),
                 "package": bench.rate(nbytes, functools.partial(layer_norm_forward, x, w, b, 1e-5))}  # fmt: skip
        lanes = "--lanes" in sys.argv  # per-lane accumulators (torch.compile's way), hints on
        hint_choices = (True,) if lanes else (True, False)
        launches = itertools.product((1024, 2048, 4096), (4, 8, 16), hint_choices, (lanes,))
        if "--inductor" in sys.argv:  # torch.compile's own choice, both accumulations, hints on
            launches = [(*INDUCTOR_LAUNCH[dtype, n_cols], True, kind) for kind in (False, True)]
        for block, warps, hints, per_lane in launches:
            if block <= n_cols and block // (32 * warps) >= 4:
                policies = ("evict_last", "evict_first") if hints else ("", "")
                call = functools.partial(forward_walked, x, w, b, block, warps, *policies, lanes=per_lane)
                name = f"{'lanes' if per_lane else 'walked'} {block}/{warps}w{' hints' if hints else ''}"
                rated[name] = bench.rate(nbytes, call)
        fixed = "  ".join(f"{n} {rated.pop(n):,.0f}" for n in ("copy", "torch.compile", "package"))
        best = sorted(((r, n) for n, r in rated.items()), reverse=True)[:5]
        print(
            f"{core.dtype_name(dtype)}, N = {n_cols:,}: {fixed} | " + "  ".join(f"{n} {r:,.0f}" for r, n in best),
            flush=True,
        )


@triton.jit
def split_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stats_ptr, counter_ptr, N,
        n_chunks, eps, BLOCK_N: tl.constexpr, CHUNKS_POW2: tl.constexpr,
        MAX_POLLS: tl.constexpr, X_EVICT: tl.constexpr, W_EVICT: tl.constexpr,
        RELOAD: tl.constexpr = False):  # fmt: skip
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < N
    x_row = x_ptr + row * N
    x = tl.load(x_row + cols, mask=in_row, other=0.0, eviction_policy=X_EVICT).to(tl.float32)
    count = tl.minimum(N - chunk * BLOCK_N, BLOCK_N).to(tl.float32)
    chunk_mean = tl.sum(x, axis=0) / count
    deviation = tl.where(in_row, x - chunk_mean, 0.0)
    row_stats = stats_ptr + row * 2 * CHUNKS_POW2  # CHUNKS_POW2 means, then as many m2s
    tl.store(row_stats + chunk, chunk_mean)
    tl.store(row_stats + CHUNKS_POW2 + chunk, tl.sum(deviation * deviation, axis=0))
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):
        chunks = tl.arange(0, CHUNKS_POW2)
        present = chunks < n_chunks
        means = tl.load(row_stats + chunks, mask=present, other=0.0, volatile=True)
        m2s = tl.load(row_stats + CHUNKS_POW2 + chunks, mask=present, other=0.0, volatile=True)
        counts = tl.minimum(tl.maximum(N - chunks * BLOCK_N, 0), BLOCK_N).to(tl.float32)
        mean = tl.sum(means * counts, axis=0) / N
        spread = means - mean
        m2 = tl.sum(m2s + counts * spread * spread, axis=0)
    else:
        mean, m2 = walked_statistics(x_row, N, BLOCK_N)
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0, eviction_policy=W_EVICT).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=in_row, other=0.0, eviction_policy=W_EVICT).to(tl.float32)
    if RELOAD:  # read the chunk again, from L2, rather than hold it across the wait
        x = tl.load(x_row + cols, mask=in_row, other=0.0).to(tl.float32)
    y = (x - mean) * rstd * w + b
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)
    if chunk == 0:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


HINTS = {"no hints": ("", ""), "hints": ("evict_first", "evict_last")}


def forward_rows(x, w, b, rows=1, warps=8, programs=None, stages=1, hints="no hints", even=False):
    n_rows, n_cols = x.shape
    y, mean, rstd = torch.empty_like(x), torch.empty(n_rows, device=x.device), torch.empty(n_rows, device=x.device)
    grid = triton.cdiv(n_rows, rows)
    grid = min(grid, programs) if programs else grid
    even = even and n_cols == triton.next_power_of_2(n_cols) and n_rows % rows == 0
    rows_kernel[(grid,)](x, y, w, b, mean, rstd, n_rows, n_cols, 1e-5,
        BLOCK_N=triton.next_power_of_2(n_cols), ROWS_PER_PROGRAM=rows, NUM_STAGES=stages,
        X_EVICT=HINTS[hints][0], W_EVICT=HINTS[hints][1], EVEN=even, num_warps=warps)  # fmt: skip
    return y, mean, rstd


REGISTERS = {}  # launch name -> registers per thread, from the compiled kernel


def forward_split(x, w, b, chunk=8192, warps=8, hints="no hints", reload=False):
    n_rows, n_cols = x.shape
    n_chunks = triton.cdiv(n_cols, chunk)
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    y, mean, rstd = torch.empty_like(x), torch.empty(n_rows, device=x.device), torch.empty(n_rows, device=x.device)
    stats = torch.empty(n_rows, 2, chunks_pow2, device=x.device)
    counters = torch.zeros(n_rows, device=x.device, dtype=torch.int32)
    compiled = split_kernel[(n_rows * n_chunks,)](x, y, w, b, mean, rstd, stats, counters, n_cols,
        n_chunks, 1e-5, BLOCK_N=chunk, CHUNKS_POW2=chunks_pow2, MAX_POLLS=MAX_POLLS,
        X_EVICT=HINTS[hints][0], W_EVICT=HINTS[hints][1], RELOAD=reload, num_warps=warps)  # fmt: skip
    REGISTERS[(x.dtype, chunk, warps, reload)] = getattr(compiled, "n_regs", None)
    return y, mean, rstd


def reload_sweep():
    """The split forward holding its chunk across the wait, or reading it again from L2."""
    for dtype, n_cols in itertools.product((torch.float16, torch.float32), (65536, 262144)):
        x = torch.randn(2**26 // n_cols, n_cols, device="cuda", dtype=dtype)
        w, b = torch.rand(n_cols, device="cuda", dtype=dtype) + 0.5, torch.randn_like(x[0])
        nbytes = 2 * x.numel() * x.element_size()
        shown = [f"copy {bench.rate(nbytes, bench.copy_of(nbytes)):,.0f}"]
        for chunk, warps, reload in itertools.product((4096, 8192), (4, 8), (False, True)):
            rate = bench.rate(nbytes, functools.partial(forward_split, x, w, b, chunk, warps, reload=reload))
            regs = REGISTERS.get((dtype, chunk, warps, reload))
            shown.append(f"{chunk}/{warps}w{' reload' if reload else ''} {rate:,.0f} ({regs} regs)")
        print(f"{core.dtype_name(dtype)}, N = {n_cols:,}: " + "  ".join(shown), flush=True)


def check():
    generator = torch.Generator().manual_seed(0)
    for n_rows, n_cols, chunk in [(5, 100, 32), (3, 64, 64), (7, 33, 16), (2, 300, 128)]:
        x = (torch.randn(n_rows, n_cols, generator=generator) * 3 + 100).to(core.DEVICE)
        w = torch.rand(n_cols, generator=generator).to(core.DEVICE)
        b = torch.randn(n_cols, generator=generator).to(core.DEVICE)
        expected = torch.nn.functional.layer_norm(x.double(), (n_cols,), w.double(), b.double())
        for got in (forward_rows(x, w, b, rows=2, hints="hints"), forward_split(x, w, b, chunk),
                    forward_rows(x, w, b, rows=1, even=True),
                    forward_walked(x, w, b, chunk), forward_walked(x, w, b, chunk, 4, "", ""),
                    forward_walked(x, w, b, chunk, lanes=True),
                    forward_split(x, w, b, chunk, reload=True)):  # fmt: skip
            torch.testing.assert_close(got[0], expected.float(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got[1], x.mean(1))
    print(
        "one-block (with hints), walked (block sums or lanes) and split forwards match torch (fp32, mean 100, spread 3)"
    )


def launches(n_cols):
    block = triton.next_power_of_2(n_cols)
    sms = core.sm_count()
    evens = (False, True) if "--even" in sys.argv else (False,)
    if block <= 32768:
        for warps, grid, hints, even in itertools.product((4, 8, 16, 32), ("8/SM", "all"), HINTS, evens):
            if 8 <= block // (32 * warps) <= 64:
                programs, stages = (8 * sms, 2) if grid == "8/SM" else (None, 1)
                launch = (warps, programs, stages, hints, even)
                yield (f"rows {warps}w {grid} {hints}{' even' if even else ''}",
                       lambda x, w, b, k=launch: forward_rows(x, w, b, 1, *k))  # fmt: skip
    if "--even" in sys.argv:
        return
    for chunk, warps, hints in itertools.product((4096, 8192, 16384), (4, 8, 16), HINTS):
        if chunk < block and 8 <= chunk // (32 * warps) <= 64:
            yield (f"split {chunk}/{warps}w {hints}",
                   lambda x, w, b, k=(chunk, warps, hints): forward_split(x, w, b, *k))  # fmt: skip


def time_one_size(dtype, n_cols, liger):
    x = torch.randn(ROWS, n_cols, device="cuda", dtype=dtype)
    w, b = torch.rand(n_cols, device="cuda", dtype=dtype) + 0.5, torch.randn_like(x[0])
    nbytes = 2 * x.numel() * x.element_size()
    compiled = bench.compile_static(torch.nn.functional.layer_norm)
    calls = {"copy (same bytes)": bench.copy_of(nbytes),
             "torch.compile": lambda: compiled(x, (n_cols,), w, b),
             "package": lambda: layer_norm_forward(x, w, b, 1e-5)}  # fmt: skip
    if liger is not None:
        calls["liger_kernel"] = lambda: liger.apply(x, w, b, 1e-5)
    for name, fn in launches(n_cols):
        calls[name] = lambda fn=fn: fn(x, w, b)
    rated = {}
    for name, fn in calls.items():
        try:
            rated[name] = bench.rate(nbytes, fn)
        except Exception as error:  # does not compile or fit: say so, go on
            print(f"  {name}: {type(error).__name__} {str(error).splitlines()[0][:80]}")
    fixed = [n for n in ("copy (same bytes)", "torch.compile", "liger_kernel", "package") if n in rated]
    head = "  ".join(f"{n} {rated[n]:,.0f}" for n in fixed)
    print(f"{core.dtype_name(dtype)}, N = {n_cols:,}: {head}")
    for kind in ("rows", "split", "even"):
        chosen = [(r, n) for n, r in rated.items() if n.startswith(kind) and not n.endswith("even")]
        if kind == "even":
            chosen = [(r, n) for n, r in rated.items() if n.endswith("even")]
        ranked = sorted(chosen, reverse=True)
        if ranked:
            print(f"   {kind:5}: " + "  ".join(f"{n} {r:,.0f}" for r, n in ranked[:5]), flush=True)


def main():
    check()
    if not core.ON_GPU:
        return
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction as liger
    except ImportError:
        liger = None
    with bench.side_stream():
        if "--reload" in sys.argv:
            return reload_sweep()
        if "--walked" in sys.argv or "--lanes" in sys.argv or "--inductor" in sys.argv:
            return walked_sweep()
        sizes = (4096, 8192, 16384, 32768) if "--even" in sys.argv else (4096, 8192, 16384, 32768, 65536)
        for dtype, n_cols in itertools.product((torch.float16, torch.float32), sizes):
            time_one_size(dtype, n_cols, liger)


if __name__ == "__main__":
    main()
