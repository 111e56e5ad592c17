"""A launch sweep for chapter 14's kernels, toward issue 43's target (GPU; one run, ~4 min).

The target: rms_norm, rotary and silu_mul, forward and forward + backward, at or above
torch.compile and Liger-Kernel from 2^24 elements, at >= 90% of a copy of the same bytes.
For each layer, direction, dtype (bf16, fp32) and size (2^24 and 2^27 elements, in chapter
14's shapes: rows of 4,096; q of 32 heads and k of 8, head_dim 128; rows of 8,192), it times

* every candidate launch of the layer's launch table (``ops.rms_norm.FORWARD_LAUNCH`` and
  ``BACKWARD_LAUNCH``, ``ops.rotary.ROTARY_LAUNCH``, ``ops.swiglu.SWIGLU_LAUNCH``), through
  the public function as the chapter's benchmark calls it; a forward + backward point varies
  the backward's launch (rotary: the one launch of both);
* a Triton copy of the same bytes (``bench.copy_of``, the chapter's "copy (same bytes)").

as GB/s of the bytes the chapter counts: GPU time of CUDA-graph replays with L2 flushed
(``do_bench``), the providers of a point timed in turns. Each table entry is then chosen: the
candidate whose worst share of the best rate, over the points that use the entry, is highest;
the entry as it is stays unless that candidate beats it by 2% (``KEEP_WITHIN``) at each point.
A second pass times, at each point, the table as it was, the table as chosen, torch.compile
and the copy, in turns; points it has no time for show torch.compile as recorded
(results/nvidia-h200, marked "rec"). Recorded Liger-Kernel is shown beside. Last, it prints the
tables to paste into ``tutorials/14-modern-block.py`` (then ``python tools/export.py``).

    python lab/modern_sweep.py [--budget 200] [--only rms-norm,rotary,silu-mul]
                               [--sizes 24,27] [--dtypes bfloat16,float32] [--no-compile]

``--budget``: seconds of measuring after start-up; points past it are skipped (and said).
Without a GPU it runs every candidate once at a small size under Triton's interpreter against
eager PyTorch (forward and backward), with made-up timings, to check the script end to end.
``--registers`` (no GPU needed) compiles the rms_norm backward's and rotary's candidates for
sm_90 with this machine's Triton (``sm90.py``) and prints registers and stack a thread: leads.
"""

import os
import sys

# Compiled for sm_90, not interpreted: set before triton is imported, when run (not imported).
if __name__ == "__main__" and "--registers" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import argparse
import contextlib
import csv
import functools
import itertools
import json
import re
import statistics
import time

from stepkernels import rms_norm, rotary_embedding_qk, silu_mul
from stepkernels.lessons import bench
from stepkernels.ops import rms_norm as rms_module
from stepkernels.ops import rotary as rotary_module
from stepkernels.ops import swiglu as swiglu_module
from stepkernels.ops.rotary import rope_tables
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name
import torch
import torch.nn.functional as F
import triton

HIDDEN, HEAD_DIM, Q_HEADS, K_HEADS, FFN = 4096, 128, 32, 8, 8192  # chapter 14's shapes
RECORDED = bench.default_results_dir() / "nvidia-h200"
TURNS, REP_MS = 2, 20  # a point's providers in turns of REP_MS each
KEEP_WITHIN = 1.02  # a table's entry stays unless a candidate beats it by 2% at each of its points
COMPILE = "torch.compile"
TABLES = ("FORWARD_LAUNCH", "BACKWARD_LAUNCH", "ROTARY_LAUNCH", "SWIGLU_LAUNCH")
failures = set()


# The layers: inputs, ours, PyTorch's, passes counted (forward, forward + backward), and the
# launch table each direction varies: (module, table name, key of a call's entry).


def rope_reference(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def size_of(module, elements):
    return "small" if elements < module.LARGE_FROM else "large"


LAYERS = {
    "rms-norm": dict(
        shapes=lambda n: [((n // HIDDEN, HIDDEN), True), ((HIDDEN,), True)],
        ours=lambda x, w: rms_norm(x, (HIDDEN,), w),
        theirs=lambda x, w: F.rms_norm(x, (HIDDEN,), w),
        passes=(2, 5),
        tables=(
            lambda n, s: (rms_module, "FORWARD_LAUNCH", (s, size_of(rms_module, n))),
            lambda n, s: (rms_module, "BACKWARD_LAUNCH", (s, size_of(rms_module, n))),
        ),
    ),
    "rotary": dict(
        shapes=lambda n: [
            ((1, Q_HEADS, n // (Q_HEADS * HEAD_DIM), HEAD_DIM), True),
            ((1, K_HEADS, n // (Q_HEADS * HEAD_DIM), HEAD_DIM), True),
        ],
        ours=rotary_embedding_qk,
        theirs=lambda q, k, c, s: (rope_reference(q, c, s), rope_reference(k, c, s)),
        passes=(2 * 1.25, 4 * 1.25),  # k is a quarter of q
        tables=(  # one kernel, one launch, both directions; q and k's elements count
            lambda n, s: (rotary_module, "ROTARY_LAUNCH", (s, size_of(rotary_module, n * 1.25))),
        )
        * 2,
    ),
    "silu-mul": dict(
        shapes=lambda n: [((n // FFN, FFN), True), ((n // FFN, FFN), True)],
        ours=silu_mul,
        theirs=lambda g, u: F.silu(g) * u,
        passes=(3, 8),
        tables=(
            lambda n, s: (swiglu_module, "SWIGLU_LAUNCH", ("forward", s, size_of(swiglu_module, n))),
            lambda n, s: (swiglu_module, "SWIGLU_LAUNCH", ("backward", s, size_of(swiglu_module, n))),
        ),
    ),
}


def launches(table: str) -> list:
    """The candidates of a table's entry; the entry as it is comes first where it is not one."""
    if table == "FORWARD_LAUNCH":  # rows of 4,096: 1 to 4 rows a program, 4 to 16 warps
        pairs = [(4096, 8), (4096, 16), (4096, 32), (8192, 16), (8192, 32), (16384, 32)]
        return [dict(tile=t, per_thread=p) for t, p in pairs]
    if table == "BACKWARD_LAUNCH":
        return [
            dict(programs_per_sm=p, stages=s, per_thread=t)
            for p, s, t in itertools.product((1, 2, 3, 4), (1, 2, 3, 4), (16, 32))
        ]
    if table == "ROTARY_LAUNCH":  # tile / warps kept near the registers of 4096 / 4
        tiles = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
        return [
            dict(tile=t, programs_per_sm=p, warps=w, stages=s)
            for (t, w), p, s in itertools.product(tiles, (4, 8, 16), (1, 2))
        ]
    assert table == "SWIGLU_LAUNCH"
    pairs = [(1024, 2), (1024, 4), (2048, 2), (2048, 4), (2048, 8), (4096, 4)]
    pairs += [(4096, 8), (4096, 16), (8192, 8), (8192, 16)]
    return [dict(tile=t, warps=w) for t, w in pairs]


def use(module, table: str, key, launch: dict) -> None:
    """Make ``launch`` the table's entry for ``key``; launches read the tables when called."""
    getattr(module, table)[key] = dict(launch)
    for name in ("forward_config", "backward_config"):  # rms_norm's caches
        cached = getattr(module, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


def inputs_of(layer: str, n: int, dtype, backward: bool) -> tuple:
    """A point's tensors, made once for all its providers: (leaves, inputs, output grads)."""
    spec = LAYERS[layer]
    leaves = [
        torch.randn(shape, device=DEVICE, dtype=dtype).requires_grad_(backward and wants)
        for shape, wants in spec["shapes"](n)
    ]
    inputs = list(leaves)
    if layer == "rotary":
        inputs += rope_tables(leaves[0].shape[2], HEAD_DIM, dtype, DEVICE)
    outputs = leaves[:2] if layer == "rotary" else leaves[:1]  # outputs have their shapes
    return leaves, inputs, [torch.randn_like(out) for out in outputs] if backward else []


def make_call(layer: str, provider, tensors: tuple):
    """The chapter's call: the forward, or (with output grads) the forward and backward."""
    leaves, inputs, grads = tensors
    spec = LAYERS[layer]
    function = bench.compile_static(spec["theirs"]) if provider == COMPILE else spec["ours"]
    if not grads:
        return lambda: function(*inputs)
    return lambda: torch.autograd.grad(function(*inputs), leaves, grads)


def note_failure(what: str, error: Exception) -> None:
    message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
    if message not in failures:
        failures.add(message)
        print(f"    {what} failed: {message}", flush=True)


def rates(providers: dict, nbytes: float) -> dict:
    """GB/s of each provider (name: (prepare, tables)), timed in turns; ``tables``: the
    entries {(module, table, key): launch} its call takes, or None."""
    timers = {}
    for name, (prepare, tables) in providers.items():
        try:
            for (module, table, key), launch in (tables or {}).items():
                use(module, table, key, launch)
            call = prepare()
            timers[name] = (bench.capture(call).replay, call) if ON_GPU else (call, call)
        except Exception as error:  # a launch that does not compile or fit
            launches_text = "; ".join(launch_text(launch) for launch in (tables or {}).values())
            note_failure(f"{name} ({launches_text})" if isinstance(name, int) else str(name), error)
    samples = {name: [] for name in timers}
    for _ in range(TURNS if ON_GPU else 1):
        for name, (timer, _) in timers.items():
            if ON_GPU:
                samples[name] += triton.testing.do_bench(timer, warmup=5, rep=REP_MS, return_mode="all")
            else:  # the interpreter: one run each, made-up times
                timer()
                made_up = nbytes / 3e9 * (1 + (hash(str(name)) % 1000) / 1000)
                samples[name].append(made_up)
    timers.clear()
    if ON_GPU:
        torch.cuda.empty_cache()
    return {name: nbytes / statistics.median(s) / 1e6 for name, s in samples.items()}


@functools.cache
def recorded(name: str) -> dict:
    """(provider, dtype, x): GB/s as recorded on the H200, for the names that are."""
    path = RECORDED / f"{name}.csv"
    if not path.exists():
        return {}
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("value")]
    return {(r["provider"], r["dtype"], int(r["x"])): float(r["value"]) for r in rows}


def launch_text(launch: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in launch.items())


def points_of(args) -> list:
    """(layer, backward, dtype, log2 size) in the order measured: bf16 first (the widest gaps),
    every layer at a size before the next size, so that a budget cut drops the last sizes."""
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    layers = args.only.split(",")
    return [
        (layer, backward, dtype, size)
        for dtype in dtypes
        for size in sizes
        for layer in layers
        for backward in (False, True)
    ]


def registers() -> None:
    """The candidates of the rewritten kernels compiled for sm_90, bf16, rows of 4,096 and
    chapter 14's heads: registers and stack (spills) a thread."""
    import sm90

    def usage(kernel, signature, constants, warps, stages=3):
        aligned = [name for name in signature if name.endswith(("_ptr", "_stride")) or name in ("N", "HALF")]
        compiled = sm90.compile_sm90(kernel, signature, constants, aligned, num_warps=warps, num_stages=stages)
        found = sm90.nvidia_tool("cuobjdump", "-res-usage", sm90.cubin_file(compiled))
        return [int(re.search(rf"{k}:(\d+)", found).group(1)) for k in ("REG", "STACK")]

    pointers = ("x_ptr", "dy_ptr", "dx_ptr", "weight_ptr", "rstd_ptr", "partial_ptr")
    signature = {name: "*fp32" if name in ("rstd_ptr", "partial_ptr") else "*bf16" for name in pointers}
    signature.update(dict.fromkeys(("x_row_stride", "dy_row_stride", "dx_row_stride", "M", "N"), "i32"))
    signature["rows_per_program"] = "i32"
    for stages, per_thread in itertools.product((1, 2, 3, 4), (16, 32)):
        warps = 4096 // (32 * per_thread)
        constants = dict(BLOCK_N=4096, HAS_WEIGHT=True, WANT_DW=True, NUM_STAGES=stages)
        regs, stack = usage(rms_module.rms_norm_backward_kernel, signature, constants, warps)
        print(f"rms_norm backward, {warps} warps, {stages} stages: {regs} registers, {stack} B of stack", flush=True)
    names = ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cos_ptr", "sin_ptr")
    signature = dict.fromkeys(names, "*bf16")
    strides = [f"{t}_{s}_stride" for t in "qk" for s in ("batch", "head", "position")] + ["cos_stride"]
    signature.update(dict.fromkeys(strides, "i32"))
    signature.update(dict.fromkeys(("q_heads", "k_heads", "seq_len", "heads_per_program", "HALF"), "i32"))
    tiles = sorted({(c["tile"], c["warps"], c["stages"]) for c in launches("ROTARY_LAUNCH")})
    for (tile, warps, stages), backward in itertools.product(tiles, (False, True)):
        constants = dict(BLOCK_POSITIONS=tile // 128, BLOCK_HALF=64, BACKWARD=backward, NUM_STAGES=stages)
        regs, stack = usage(rotary_module.rotary_kernel, signature, constants, warps)
        direction = "backward" if backward else "forward"
        print(f"rotary {direction}, tile {tile}, {warps} warps, {stages} stages: {regs} registers, {stack} B of stack")


def main() -> None:
    if "--registers" in sys.argv:
        return registers()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=200.0)
    parser.add_argument("--only", default="rms-norm,rotary,silu-mul")
    parser.add_argument("--sizes", default="24,27" if ON_GPU else "13")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    elapsed = lambda: time.perf_counter() - start
    where = bench.gpu_name() if ON_GPU else "Triton's interpreter, made-up timings"
    print(f"# lab/modern_sweep.py on {where}; torch {torch.__version__}, triton {triton.__version__}")
    before = {  # the tables as the package has them: (module, table): {key: launch}
        (m, t): {k: dict(v) for k, v in getattr(m, t).items()}
        for m in (rms_module, rotary_module, swiglu_module)
        for t in TABLES
        if hasattr(m, t)
    }
    every_before = {(m, t, k): v for (m, t), entries in before.items() for k, v in entries.items()}
    results, skipped = {}, []  # point: {candidate index or name: GB/s}
    entry_of = {}  # point: (module, table, key)
    with bench.side_stream() if ON_GPU else contextlib.nullcontext():
        # 1. Every candidate of every point, and the copy
        for point in points_of(args):
            layer, backward, dtype, size = point
            n, spec = 2**size, LAYERS[layer]
            label = f"{layer} {'fwd+bwd' if backward else 'forward'} {dtype_name(dtype)} 2^{size}"
            if elapsed() > 0.6 * args.budget:
                skipped.append(label)
                continue
            module, table, key = spec["tables"][backward](n, dtype.itemsize)
            entry_of[point] = (module, table, key)
            nbytes = spec["passes"][backward] * n * dtype.itemsize
            tensors = inputs_of(layer, n, dtype, backward)
            providers = {
                index: (
                    functools.partial(make_call, layer, "ours", tensors),
                    {(module, table, key): launch},
                )
                for index, launch in enumerate(launches(table))
            }
            if ON_GPU:
                providers["copy"] = (functools.partial(bench.copy_of, int(nbytes)), None)
            else:
                check_candidates(layer, backward, dtype, n, module, table, key)
            rated = rates(providers, nbytes)
            del tensors, providers
            use(module, table, key, before[module, table][key])
            results[point] = rated
            ours = {i: r for i, r in rated.items() if i != "copy"}
            best = max(ours, key=ours.get) if ours else None
            shown = f"best {ours[best]:,.0f} GB/s {launch_text(launches(table)[best])}" if ours else "none ran"
            copy = f", copy {rated['copy']:,.0f}" if "copy" in rated else ""
            print(f"[{elapsed():4.0f} s] {label}: {len(ours)} launches, {shown}{copy}", flush=True)

        # 2. Each table entry: the candidate with the best worst share over its points
        chosen, notes = {}, {}
        by_entry = {}
        for point, entry in entry_of.items():
            by_entry.setdefault(entry, []).append(point)
        for (module, table, key), points in by_entry.items():
            candidates = launches(table)
            shares = []
            for index in range(len(candidates)):
                worst = min(
                    (
                        results[p].get(index, 0.0) / max(r for i, r in results[p].items() if i != "copy")
                        for p in points
                        if any(i != "copy" for i in results[p])
                    ),
                    default=0.0,
                )
                shares.append(worst)
            best = max(range(len(shares)), key=shares.__getitem__)
            was = before[module, table][key]
            if was in candidates:  # timed in the same turns: keep it unless beaten by KEEP_WITHIN
                gain = min(results[p].get(best, 0.0) / results[p].get(candidates.index(was), 1e-9) for p in points)
                notes[module, table, key] = f"{gain - 1:+.1%} over the entry it replaces, at its worst point"
                if gain < KEEP_WITHIN:
                    notes[module, table, key] = f"kept; the best, {launch_text(candidates[best])}, {gain - 1:+.1%}"
                    best = candidates.index(was)
            chosen[module, table, key] = candidates[best]
        every_chosen = {**every_before, **chosen}

        # 3. At each point: the table before and as chosen, torch.compile, the copy
        print(f"\n# In turns at each point, GB/s of the counted bytes (rec: recorded, {RECORDED.name})")
        widths = dict(before=7, chosen=7, **{COMPILE: 13}, copy=6, **{"chosen/tc": 9, "/copy": 6, "liger rec": 9})
        print("point".ljust(34), *(name.rjust(width) for name, width in widths.items()))
        for point in entry_of:
            layer, backward, dtype, size = point
            n, spec = 2**size, LAYERS[layer]
            module, table, key = entry_of[point]
            nbytes = spec["passes"][backward] * n * dtype.itemsize
            tensors = inputs_of(layer, n, dtype, backward)
            mine = functools.partial(make_call, layer, "ours", tensors)
            providers = {"before": (mine, every_before), "chosen": (mine, every_chosen)}
            if ON_GPU:
                providers["copy"] = (functools.partial(bench.copy_of, int(nbytes)), None)
            compile_now = ON_GPU and not args.no_compile and elapsed() < args.budget
            if compile_now:
                compiled = functools.partial(make_call, layer, COMPILE, tensors)
                providers[COMPILE] = (compiled, None)
            rated = rates(providers, nbytes)
            del tensors, providers
            name = f"{layer}-forward{'-backward' if backward else ''}"
            was = recorded(name)
            tc = rated.get(COMPILE)
            tc_text = f"{tc:,.0f}" if tc else "-"
            if tc is None and (COMPILE, dtype_name(dtype), n) in was:
                tc = was[COMPILE, dtype_name(dtype), n]
                tc_text = f"{tc:,.0f} rec"
            liger = was.get(("liger_kernel", dtype_name(dtype), n))
            copy, mine_rate = rated.get("copy"), rated.get("chosen")
            label = f"{layer} {'fwd+bwd' if backward else 'forward'} {dtype_name(dtype)} 2^{size}"
            cells = [
                f"{label:34}",
                f"{rated.get('before', 0):7,.0f}",
                f"{mine_rate or 0:7,.0f}",
                f"{tc_text:>13}",
                f"{copy or 0:6,.0f}",
                f"{mine_rate / tc:9.2f}" if tc and mine_rate else f"{'-':>9}",
                f"{mine_rate / copy:6.2f}" if copy and mine_rate else f"{'-':>6}",
                f"{liger:9,.0f}" if liger else f"{'-':>9}",
            ]
            print(" ".join(cells), flush=True)

    # 4. The tables to paste
    print("\n# The launch tables as chosen, to paste into tutorials/14-modern-block.py")
    for (module, table), entries in before.items():
        print(f"# {module.__name__}\n{table} = {{")
        for key in entries:
            launch = every_chosen[module, table, key]
            args_text = ", ".join(f"{k}={v}" for k, v in launch.items())
            key_text = ", ".join(json.dumps(part) for part in key)
            print(f"    ({key_text}): dict({args_text}),")
        print("}")
    print("\n# Each entry")
    for (module, table), entries in before.items():
        for key in entries:
            note = notes.get((module, table, key), "swept" if (module, table, key) in chosen else "not swept")
            print(f"{table}[{', '.join(json.dumps(part) for part in key)}]: {note}")
    if skipped:
        print(f"\nOut of budget ({args.budget:.0f} s), not measured: {'; '.join(skipped)}")
    print(f"\n# {elapsed():.0f} s")


def check_candidates(layer, backward, dtype, n, module, table, key) -> None:
    """Without a GPU: every candidate against eager PyTorch, forward and backward."""
    spec = LAYERS[layer]
    torch.manual_seed(0)
    leaves = [
        torch.randn(shape, device=DEVICE, dtype=dtype).requires_grad_(wants) for shape, wants in spec["shapes"](n)
    ]
    tables = rope_tables(leaves[0].shape[2], HEAD_DIM, dtype, DEVICE) if layer == "rotary" else ()
    expected = spec["theirs"](*(t.double() for t in leaves), *(t.double() for t in tables))
    expected = expected if isinstance(expected, tuple) else (expected,)
    grads = [torch.randn_like(e) for e in expected]
    want = torch.autograd.grad(expected, leaves, grads) if backward else ()
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype.itemsize < 4 else dict(atol=1e-4, rtol=1e-4)
    for launch in launches(table):
        use(module, table, key, launch)
        got = spec["ours"](*leaves, *tables)
        got = got if isinstance(got, tuple) else (got,)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g.double(), e.detach(), **tolerance)
        if backward:
            mine = torch.autograd.grad(got, leaves, [grad.to(dtype) for grad in grads])
            for g, w in zip(mine, want, strict=True):
                torch.testing.assert_close(g.double(), w.double(), **tolerance)


if __name__ == "__main__":
    main()
