"""rms_norm and RMSNorm against an fp64 reference and PyTorch's, through the public API."""

from conftest import random_tensor
import pytest
from stepkernels import RMSNorm, rms_norm
from stepkernels.lessons.check_modern_block import check
from stepkernels.ops import rms_norm as rms_module
from stepkernels.ops.rms_norm import rms_norm_forward_op
from stepkernels.runtime.core import DEVICE, FLOAT_DTYPES, ON_GPU
import torch
import torch.nn.functional as F

FP32_EPS = torch.finfo(torch.float32).eps  # PyTorch's default eps, for every dtype here


def reference(x, shape, weight=None, eps=None):
    eps = FP32_EPS if eps is None else eps
    dims = tuple(range(-len(shape), 0))
    y = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    return y if weight is None else y * weight


def leaf(t):
    return t.requires_grad_()


CASES = {  # label -> make(rand, dtype): (x, normalized_shape, weight)
    "one row, odd": lambda r, d: (leaf(r(1, 513)), (513,), leaf(r(513))),
    "odd rows": lambda r, d: (leaf(r(19, 781)), (781,), leaf(r(781))),
    "many programs": lambda r, d: (leaf(r(300, 40)), (40,), leaf(r(40))),
    "three dims": lambda r, d: (leaf(r(2, 9, 48)), (48,), leaf(r(48))),
    "two normalized dims": lambda r, d: (leaf(r(4, 6, 10)), (6, 10), leaf(r(6, 10))),
    "rows 2N apart": lambda r, d: (leaf(r(16, 200))[:, :100], (100,), leaf(r(100))),
    "transposed": lambda r, d: (leaf(r(24, 8)).t(), (24,), leaf(r(24))),
    "fp32 weight": lambda r, d: (leaf(r(5, 64)), (64,), leaf(r(64, dtype=torch.float32))),
    "no weight": lambda r, d: (leaf(r(7, 96)), (96,), None),
    "weight frozen": lambda r, d: (leaf(r(7, 96)), (96,), r(96)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64_reference_forward_and_backward(case, dtype):
    check("rms_norm", rms_norm, reference, {case: CASES[case]}, dtypes=(dtype,))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_default_eps_is_torchs(dtype):
    """PyTorch's default is fp32's epsilon for 16-bit x too (the dtype it computes in), not
    finfo(x.dtype).eps: on values whose mean square is near it, the two differ."""
    x = random_tensor((6, 32), dtype, scale=3e-4)
    torch.testing.assert_close(rms_norm(x, (32,)), F.rms_norm(x, (32,)), rtol=2e-2, atol=2e-2)
    wrong = reference(x.double(), (32,), eps=torch.finfo(dtype).eps)
    assert dtype == torch.float32 or (rms_norm(x, (32,)).double() - wrong).abs().max() > 0.1


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_one_column(dtype):
    """Rows of one value: y = w x / sqrt(x^2 + eps), about w sign(x), and dx a difference of
    terms of size rstd |w dy| that cancel to about eps: close to 0 on their scale."""
    x = random_tensor((37, 1), dtype, scale=2.0).requires_grad_()
    w = random_tensor((1,), dtype, seed=1).requires_grad_()
    dy = random_tensor((37, 1), dtype, seed=2)
    y = rms_norm(x, (1,), w)
    exact = [t.detach().double().requires_grad_() for t in (x, w)]
    want = reference(exact[0], (1,), exact[1])
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_want, dw_want = torch.autograd.grad(want, exact, dy.double())
    terms = (exact[0].detach().abs().min() ** -1 * (w.double() * dy.double()).abs().max()).item()
    torch.testing.assert_close(dx.double(), dx_want, rtol=tol, atol=tol * terms)
    torch.testing.assert_close(dw.double(), dw_want, rtol=tol, atol=tol * dw_want.abs().max().item())


def test_dw_repeats_to_the_bit():
    x = random_tensor((513, 64)).requires_grad_()
    w = random_tensor((64,), seed=1).requires_grad_()
    dy = random_tensor((513, 64), seed=2)
    grads = [torch.autograd.grad(rms_norm(x, (64,), w), (x, w), dy) for _ in range(3)]
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other, strict=True))


def test_empty_batch_gives_zero_dw():
    x = torch.empty(0, 8, device=DEVICE, requires_grad=True)
    w = random_tensor((8,)).requires_grad_()
    y = rms_norm(x, (8,), w)
    assert y.shape == (0, 8)
    (dw,) = torch.autograd.grad(y.sum(), w)
    assert torch.equal(dw, torch.zeros_like(w))


def test_double_backward_is_refused():
    x = random_tensor((4, 16)).requires_grad_()
    y = rms_norm(x, (16,))
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_module_is_a_drop_in_for_torch():
    torch.manual_seed(0)
    theirs = torch.nn.RMSNorm(48, eps=1e-6, device=DEVICE)
    with torch.no_grad():
        theirs.weight.normal_()
    ours = RMSNorm(48, eps=1e-6, device=DEVICE)
    ours.load_state_dict(theirs.state_dict())
    x = random_tensor((3, 5, 48))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert RMSNorm(48, elementwise_affine=False).weight is None


def test_the_operator_and_its_autograd_match_the_eager_path():
    """What torch.compile traces: the registered operator, its autograd registered."""
    x = random_tensor((9, 40)).requires_grad_()
    w = random_tensor((40,), seed=1).requires_grad_()
    dy = random_tensor((9, 40), seed=2)
    y, rstd = rms_norm_forward_op(x, w, 1e-6)
    assert rstd.shape == (9,) and rstd.dtype == torch.float32
    want = rms_norm(x, (40,), w, 1e-6)
    assert torch.equal(y, want)
    assert all(
        torch.equal(a, b)
        for a, b in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(want, (x, w), dy), strict=True)
    )


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of Triton kernels needs a GPU")
def test_compiled_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: rms_norm(x, (256,), w), fullgraph=True)
    x = random_tensor((64, 256), torch.bfloat16).requires_grad_()
    w = random_tensor((256,), torch.bfloat16, seed=1).requires_grad_()
    dy = random_tensor((64, 256), torch.bfloat16, seed=2)
    got, want = compiled(x, w), rms_norm(x, (256,), w)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(want, (x, w), dy), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU, reason="full sizes: on a GPU")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(4096, 4096), (8193, 8192), (128, 65536), (100_000, 128)])
def test_full_size_on_the_gpu(shape, dtype):
    make = lambda r, d: (leaf(r(*shape)), shape[-1:], leaf(r(shape[-1])))  # noqa: E731
    check("rms_norm", rms_norm, reference, {str(shape): make}, dtypes=(dtype,))


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("elements", [2**24, 2**27])
def test_launch_tables_hold_every_size(itemsize, elements):
    """Each element size and call size finds its entry of the tables lab/modern_sweep.py fills."""
    config = rms_module.forward_config(4096, elements // 4096, itemsize)
    assert config["BLOCK_N"] == 4096 and 1 <= config["num_warps"] <= 32
    rows_per_program, config = rms_module.backward_config(4096, elements // 4096, itemsize)
    assert 1 <= rows_per_program <= 256 and 1 <= config["NUM_STAGES"] and 4 <= config["num_warps"] <= 16


def test_launches_are_read_from_the_tables():
    """An entry changed (as the sweep changes them) changes the launch."""
    tables = rms_module.FORWARD_LAUNCH, rms_module.BACKWARD_LAUNCH
    kept = [dict(table) for table in tables]
    try:
        tables[0][2, "large"] = dict(tile=8192, per_thread=16)
        tables[1][4, "large"] = dict(programs_per_sm=1, stages=1, per_thread=32)
        rms_module.forward_config.cache_clear()
        rms_module.backward_config.cache_clear()
        forward = rms_module.forward_config(4096, 2**27 // 4096, 2)
        assert (forward["ROWS_PER_PROGRAM"], forward["num_warps"]) == (2, 16)
        _, backward = rms_module.backward_config(4096, 2**27 // 4096, 4)
        assert (backward["NUM_STAGES"], backward["num_warps"]) == (1, 4)
        small = rms_module.FORWARD_LAUNCH[2, "small"]  # unchanged
        rows = max(1, small["tile"] // 4096)
        assert rms_module.forward_config(4096, 2**24 // 4096, 2)["ROWS_PER_PROGRAM"] == rows
    finally:
        for table, entries in zip(tables, kept, strict=True):
            table.clear()
            table.update(entries)
        rms_module.forward_config.cache_clear()
        rms_module.backward_config.cache_clear()
