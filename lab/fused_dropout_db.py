"""Where chapter 06's fused backward spent its time at 2^24 elements, and db in one kernel.

Run from the repository root (``PYTHONPATH=src``)::

    python lab/fused_dropout_db.py      # GPU: time; CPU (interpreter): check

At 2^24 elements the fused bias + GELU + dropout forward + backward was at 79% (fp16) and 86%
(fp32) of a copy of the same bytes, against 88 to 93% from 2^26. Its backward ran three
kernels: ours, writing dx and a row of partial db sums for each program's strip of rows;
torch's ``partial.sum(0)``; and a cast to db's dtype. The package now adds db in the kernel
(``DETERMINISTIC=False``): each program adds its sums into fp32 sums with atomics, and the
last program of each column block casts them into db and zeroes them; the three kernels
remain for ``torch.use_deterministic_algorithms(True)``. This script times, on 4,096 and
16,384 rows of 4,096 (GB/s of the backward's compulsory bytes: dy and x read, dx written):

* ``package``: one kernel, db by atomics (its additions' order, and so db's last bits, vary
  from run to run);
* ``three kernels``: the partial sums, ``sum(0)`` and the cast (the package before, and now
  in deterministic mode); ``kernel``: the first of them alone;
* ``tree G/U``: one kernel, the same bits every run: a program stores its partial sums and
  counts itself in to its group of G strips; the last of a group sums the group's partials in
  order (U loads issued at a time) and counts the group in; the last group sums the groups'
  totals in order and casts into db;

over launches of 8 or 4 strips an SM (the package: 4; at 80 registers a thread only 6
programs of 4 warps fit an SM) and 3 or 4 stages (the package: 4 for 16-bit, 3 for fp32).
The log's first runs timed the package before the change as ``package``, its kernel alone,
``+ sum`` (without the cast), ``sum-cast`` (one Triton kernel summing and casting) and the
atomic way as ``atomic``.
"""

import itertools
import re

from fused_dropout_cheaper import launch_rule
import sm90
from stepkernels.lessons import bench
from stepkernels.ops.dropout import BACKWARD_STAGES, bias_act_dropout_backward_kernel, fused_launch, scale_for
from stepkernels.runtime import core
import torch
import triton

P, SEED = round(0.1 * 2**16) / 2**16, 1234  # a p the 16-bit mask draws exactly
TREES = ((16, 4), (12, 6), (16, 8))  # (strips a group, loads issued at once)
STORE_PARTIAL = """        partial_row = tl.program_id(0).to(tl.int64) * n_cols
        tl.store(bias_sum_ptr + partial_row + cols, bias_sum, mask=cols_in)
"""
TREE = """        strip = tl.program_id(0)
        tl.store(bias_sum_ptr + strip.to(tl.int64) * n_cols + cols, bias_sum, mask=cols_in)
        tl.debug_barrier()  # every thread of this program has stored
        n_groups = (tl.num_programs(0) + GROUP - 1) // GROUP
        counters = counter_ptr + tl.program_id(1) * (n_groups + 1)
        group = strip // GROUP
        first = group * GROUP
        members = tl.minimum(GROUP, tl.num_programs(0) - first)
        arrived = tl.atomic_add(counters + group, 1, sem="acq_rel")
        if arrived == members - 1:  # the last of its group: sum the group's strips in order
            total = tl.zeros_like(bias_sum)
            for base in range(0, GROUP, UNROLL):  # UNROLL loads issued before their sums
                for step in tl.static_range(UNROLL):
                    member = base + step
                    row = (first + member).to(tl.int64) * n_cols
                    wanted = cols < tl.where(member < members, n_cols, 0)
                    total += tl.load(bias_sum_ptr + row + cols, mask=wanted, other=0.0, cache_modifier=".cg")
            tl.store(counters + group, 0)
            tl.store(bias_sum_ptr + first.to(tl.int64) * n_cols + cols, total, mask=cols_in)
            tl.debug_barrier()
            done = tl.atomic_add(counters + n_groups, 1, sem="acq_rel")
            if done == n_groups - 1:  # the last group: sum the groups' totals in order, cast
                total = tl.zeros_like(bias_sum)
                for base in range(0, n_groups, UNROLL):
                    for step in tl.static_range(UNROLL):
                        other = base + step
                        row = tl.cast(other * GROUP, tl.int64) * n_cols
                        wanted = cols < tl.where(other < n_groups, n_cols, 0)
                        total += tl.load(bias_sum_ptr + row + cols, mask=wanted, other=0.0, cache_modifier=".cg")
                tl.store(grad_bias_ptr + cols, total.to(grad_bias_ptr.dtype.element_ty), mask=cols_in)
                tl.store(counters + n_groups, 0)
"""
VARIANTS = {
    f"tree {group}/{unroll}": sm90.kernel_variant(
        bias_act_dropout_backward_kernel,
        f"db_tree_{group}_{unroll}",
        [(STORE_PARTIAL, re.sub(r"\bGROUP\b", str(group), TREE).replace("UNROLL", str(unroll)), 1)],
    )
    for group, unroll in TREES
}


class Backward:
    """The backward of ``dropout(gelu(x + bias))`` with db by ``how``, ``per_sm`` strips of
    rows an SM and ``stages``; scratch made once (zeroed: the kernels leave it so)."""

    def __init__(self, grad, x, bias, how, per_sm=4, stages=None):
        self.grad, self.x, self.bias, self.how = grad, x, bias, how
        self.block_cols = fused_launch(*x.shape, backward=True)[0]
        self.rows_per_program, self.grid = launch_rule(*x.shape, self.block_cols, per_sm)
        self.stages = stages or BACKWARD_STAGES[x.element_size()]
        rows = 1 if how == "package" else self.grid[0]
        self.sums = torch.zeros(rows, x.shape[1], device=x.device)
        n_groups = triton.cdiv(self.grid[0], min(group for group, _ in TREES))
        self.counters = torch.zeros(self.grid[1] * (n_groups + 1), device=x.device, dtype=torch.int32)

    def __call__(self):
        grad_in, grad_bias = torch.empty_like(self.x), torch.empty_like(self.bias)
        kernel = VARIANTS.get(self.how, bias_act_dropout_backward_kernel)
        kernel[self.grid](
            self.grad, self.x, self.bias, grad_in, self.sums, self.counters, grad_bias,
            *self.x.shape, self.rows_per_program, round(P * 2**16), scale_for(P), SEED,
            ACTIVATION="gelu", BLOCK_COLS=self.block_cols, NUM_STAGES=self.stages,
            DETERMINISTIC=self.how != "package", num_warps=4,
        )  # fmt: skip
        if self.how == "three kernels":
            grad_bias = self.sums.sum(0).to(self.bias.dtype)
        return grad_in, grad_bias


HOWS = ("package", "three kernels", "kernel", *VARIANTS)
LAUNCHES = ((8, 3), (4, 3), (4, 4))  # (strips an SM, stages)


def check():
    """Each way's dx and db against the package's (db to rounding), twice (counters reset)."""
    for dtype, n_rows in ((torch.float32, 70), (torch.float16, 300)):
        x = torch.randn(n_rows, 48, device=core.DEVICE, dtype=dtype)
        bias, grad = torch.randn(48, device=x.device, dtype=dtype), torch.randn_like(x)
        want_dx, want_db = Backward(grad, x, bias, "three kernels")()
        for how, per_sm in itertools.product(("package", *VARIANTS), (8, 1)):
            backward = Backward(grad, x, bias, how, per_sm)
            for _ in range(2):
                dx, db = backward()
                torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
                torch.testing.assert_close(db, want_db, rtol=1e-3, atol=1e-3)
            assert not backward.counters.any(), f"{how} left its counters set"
            assert how != "package" or not backward.sums.any(), "the package left its sums set"
    print(f"package, {', '.join(VARIANTS)}: the three kernels' dx and db, twice (scratch back at 0)")


def sweep():
    for n_rows in (4096, 16384):
        for dtype in (torch.float16, torch.float32):
            x = torch.randn(n_rows, 4096, device="cuda", dtype=dtype)
            bias, grad = torch.randn(4096, device="cuda", dtype=dtype), torch.randn_like(x)
            nbytes = 3 * x.numel() * x.element_size()
            copy = bench.rate(nbytes, bench.copy_of(nbytes))
            print(f"{core.dtype_name(dtype)}, {n_rows} x 4096: copy {copy:,.0f}", flush=True)
            for per_sm, stages in LAUNCHES:
                line = f"  {per_sm} an SM, {stages} stages:"
                for how in HOWS:
                    gbs = bench.rate(nbytes, Backward(grad, x, bias, how, per_sm, stages))
                    line += f"  {how} {gbs:,.0f} ({gbs / copy:.0%})"
                print(line, flush=True)


if __name__ == "__main__":
    check()
    if core.ON_GPU:
        with bench.side_stream():
            sweep()
