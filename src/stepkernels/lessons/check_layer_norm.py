"""The harness of chapter 03 (layer normalization): one call checks y, dx, dW and dB of a
``layer_norm`` against PyTorch's in fp64, another compares the two dW/dB reductions, as the
chapter describes. Hand-written; the functions it takes are the chapter's (in the notebook) or
the package's, which are generated from the chapter."""

from __future__ import annotations

import itertools

from stepkernels.lessons.bench import measure_ms
from stepkernels.runtime.core import DEVICE, FLOAT_DTYPES, ON_GPU
import torch

# One rounding of the dtype relative to the tensor's largest value: ours are fp32 computations
# rounded once (two units for bf16: the interpreter truncates where a GPU rounds).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


def check(
    layer_norm, cases, reductions=("two-stage", "lock"), dtypes=FLOAT_DTYPES, seed=0
) -> None:
    """Check ``layer_norm(x, normalized_shape, weight, bias, reduction=, block_size=)`` and its
    gradients against ``torch.nn.functional.layer_norm`` in fp64, for every dtype, reduction
    and case ``(shape, normalized dimensions, view, block_size)``: ``view`` turns a tensor of
    ``shape`` into the input (a slice, a transpose), whose strides reach ``layer_norm`` as they
    are. Raises on the first mismatch; prints one line when all agree."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda size, dtype: torch.randn(size, generator=generator).to(DEVICE, dtype)  # noqa: E731
    for dtype, reduction, (shape, dims, view, block_size) in itertools.product(
        dtypes, reductions, cases
    ):
        x = view(rand(shape, dtype))
        normalized = tuple(x.shape[x.dim() - dims :])
        inputs = [x, rand(normalized, dtype), rand(normalized, dtype)]
        ours = [t.detach().requires_grad_() for t in inputs]  # detach keeps the strides
        exact = [t.double().requires_grad_() for t in inputs]
        y = layer_norm(
            ours[0], normalized, *ours[1:], reduction=reduction, block_size=block_size
        )
        y_exact = torch.nn.functional.layer_norm(exact[0], normalized, *exact[1:])
        dy = rand(x.shape, dtype)
        y.backward(dy)
        y_exact.backward(dy.double())
        got, wanted = [y, *(t.grad for t in ours)], [y_exact, *(t.grad for t in exact)]
        for name, mine, expected in zip(
            ("y", "dx", "dW", "dB"), got, wanted, strict=True
        ):
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(
                mine.double(),
                expected,
                rtol=tol,
                atol=tol * expected.abs().max().item(),
                msg=lambda m, where=f"{name}, {shape}, {dtype}, {reduction}": (
                    f"{where}: {m}"
                ),
            )
    print(
        f"y, dx, dW, dB as torch's: {len(cases)} shapes x {len(dtypes)} dtypes x {len(reductions)} reductions"
    )


def compare_reductions(
    layer_norm_forward, layer_norm_backward, n_rows, n_cols, runs=20
):
    """Run the backward of each reduction ``runs`` times on one fp32 input and print the time
    of one (GPU only), the largest change of dW between runs, and dW's largest error against
    fp64. The two-stage reduction must repeat to the bit; the lock may not, on a GPU."""
    generator = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(n_rows, n_cols, generator=generator).to(DEVICE) for _ in "xy")
    weight = (torch.rand(n_cols, generator=generator) + 0.5).to(DEVICE)
    _, mean, rstd = layer_norm_forward(x, weight, None, 1e-5)
    dw_exact = (
        dy.double() * torch.nn.functional.layer_norm(x.double(), (n_cols,))
    ).sum(0)
    print(f"backward, {n_rows} x {n_cols} fp32, {runs} runs each:")
    print("  reduction        ms   max |dW - dW_run1|   max |dW - fp64|")
    for reduction in ("two-stage", "lock"):
        call = lambda r=reduction: layer_norm_backward(
            dy, x, weight, mean, rstd, reduction=r
        )  # noqa: E731
        first = call()[1]
        spread = max((call()[1] - first).abs().max().item() for _ in range(runs - 1))
        error = (first.double() - dw_exact).abs().max().item()
        ms = f"{measure_ms(call)[0]:.4f}" if ON_GPU else "GPU only"
        print(f"  {reduction:<10} {ms:>8} {spread:>20.3g} {error:>17.3g}")
        assert reduction == "lock" or spread == 0, "two-stage must repeat to the bit"
