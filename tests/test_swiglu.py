"""silu_mul (SwiGLU's product) against an fp64 reference, through the public API."""

from conftest import random_tensor
import pytest
from stepkernels import silu_mul
from stepkernels.lessons.check_modern_block import check
from stepkernels.ops import swiglu as swiglu_module
from stepkernels.ops.swiglu import silu_mul_forward_op
from stepkernels.runtime.core import FLOAT_DTYPES, ON_GPU
import torch
import torch.nn.functional as F


def reference(gate, up):
    return F.silu(gate) * up


def leaf(t):
    return t.requires_grad_()


def halves(r, rows, cols):
    """gate and up as the two halves of one projection's output: rows 2 * cols apart."""
    return leaf(r(rows, 2 * cols)).chunk(2, dim=-1)


CASES = {
    "0-dim": lambda r, d: (leaf(r()), leaf(r())),
    "one value": lambda r, d: (leaf(r(1, 1)), leaf(r(1, 1))),
    "odd shape": lambda r, d: (leaf(r(3, 19, 37)), leaf(r(3, 19, 37))),
    "halves of one tensor": lambda r, d: halves(r, 23, 300),
    "long rows": lambda r, d: (leaf(r(2, 5000)), leaf(r(2, 5000))),
    "gate transposed": lambda r, d: (leaf(r(24, 8)).t(), leaf(r(8, 24))),
    "no rows": lambda r, d: (leaf(r(0, 8)), leaf(r(0, 8))),
    "no columns": lambda r, d: (leaf(r(3, 0)), leaf(r(3, 0))),
    "empty 1-D": lambda r, d: (leaf(r(0)), leaf(r(0))),
    "large values": lambda r, d: (leaf(r(4, 64) * 30), leaf(r(4, 64))),
    "up frozen": lambda r, d: (leaf(r(5, 33)), r(5, 33)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64_reference_forward_and_backward(case, dtype):
    check("silu_mul", silu_mul, reference, {case: CASES[case]}, dtypes=(dtype,))


def test_output_is_new_and_contiguous():
    both = random_tensor((6, 20))
    gate, up = both.chunk(2, dim=-1)
    out = silu_mul(gate, up)
    assert out.is_contiguous() and out.shape == (6, 10)
    assert out.untyped_storage().data_ptr() != both.untyped_storage().data_ptr()


def test_double_backward_is_refused():
    gate, up = random_tensor((4, 8)).requires_grad_(), random_tensor((4, 8), seed=1)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(silu_mul(gate, up).square().sum(), gate, create_graph=True)


def test_the_operator_and_its_autograd_match_the_eager_path():
    gate = random_tensor((7, 30)).requires_grad_()
    up = random_tensor((7, 30), seed=1).requires_grad_()
    dy = random_tensor((7, 30), seed=2)
    got, want = silu_mul_forward_op(gate, up), silu_mul(gate, up)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (gate, up), dy), torch.autograd.grad(want, (gate, up), dy), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of Triton kernels needs a GPU")
def test_compiled_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(silu_mul, fullgraph=True)
    gate, up = (random_tensor((64, 300), torch.bfloat16, seed=s).requires_grad_() for s in (0, 1))
    got, want = compiled(gate, up), silu_mul(gate, up)
    assert torch.equal(got, want)
    dy = torch.ones_like(got)
    for a, b in zip(torch.autograd.grad(got, (gate, up), dy), torch.autograd.grad(want, (gate, up), dy), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU, reason="full sizes: on a GPU")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_full_size_on_the_gpu(dtype):
    cases = {"halves of (8192, 2 x 14336)": lambda r, d: halves(r, 8192, 14336)}
    check("silu_mul", silu_mul, reference, cases, dtypes=(dtype,))


@pytest.mark.parametrize("kernel", ["forward", "backward"])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("elements", [2**24, 2**27])
def test_launch_table_holds_every_size(kernel, itemsize, elements):
    """Rows of 8,192 find their entry of the table that lab/modern_sweep.py fills; the grid
    covers every value."""
    meta, grid = swiglu_module.swiglu_launch(elements // 8192, 8192, itemsize, kernel)
    assert grid[0] * meta["BLOCK_ROWS"] >= elements // 8192 and grid[1] * meta["BLOCK_COLS"] >= 8192


def test_launch_is_read_from_the_table():
    """An entry changed (as the sweep changes them) changes the launch, of that kernel only."""
    kept = dict(swiglu_module.SWIGLU_LAUNCH)
    try:
        swiglu_module.SWIGLU_LAUNCH["backward", 2, "large"] = dict(tile=2048, warps=8)
        meta, _ = swiglu_module.swiglu_launch(2**27 // 8192, 8192, 2, "backward")
        assert (meta["BLOCK_COLS"], meta["num_warps"]) == (2048, 8)
        forward = swiglu_module.SWIGLU_LAUNCH["forward", 2, "large"]
        meta, _ = swiglu_module.swiglu_launch(2**27 // 8192, 8192, 2, "forward")
        assert (meta["BLOCK_COLS"], meta["num_warps"]) == (min(forward["tile"], 8192), forward["warps"])
    finally:
        swiglu_module.SWIGLU_LAUNCH.update(kept)
