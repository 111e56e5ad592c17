from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
from stepkernels import add
from stepkernels.runtime.core import DEVICE, FLOAT_DTYPES, INTERPRET
import torch

DTYPES = FLOAT_DTYPES
BLOCK_SIZE = 1024  # the chapter's block: sizes around it catch off-by-one masks


def tolerance(dtype: torch.dtype) -> dict:
    """Exact, except bf16 under the interpreter, which truncates where a GPU rounds."""
    if dtype == torch.bfloat16 and INTERPRET:
        return {"rtol": 2**-7, "atol": 0.0}
    return {"rtol": 0.0, "atol": 0.0}


def random_pair(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(shape, generator=generator).to(dtype) * 100 for _ in range(2))
    return x.to(DEVICE), y.to(DEVICE)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5000), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_matches_torch_for_any_length(n, dtype, seed):
    x, y = random_pair((n,), dtype, seed)
    torch.testing.assert_close(add(x, y), x + y, **tolerance(dtype))


@pytest.mark.parametrize(
    "shape",
    [(1,), (BLOCK_SIZE - 1,), (BLOCK_SIZE,), (3 * BLOCK_SIZE + 5,), (7, 13), (2, 3, 5, 7)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_and_dtypes(shape, dtype):
    x, y = random_pair(shape, dtype)
    out = add(x, y)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, x + y, **tolerance(dtype))


def test_exact_in_fp32_and_fp16():
    for dtype in (torch.float32, torch.float16):
        x, y = random_pair((10_007,), dtype)
        assert torch.equal(add(x, y), x + y)


def test_bf16_within_one_unit_in_the_last_place():
    x, y = random_pair((4099,), torch.bfloat16)
    error = (add(x, y).float() - (x + y).float()).abs()
    assert (error <= (x + y).float().abs() * 2**-7).all()


def test_empty_input():
    x = torch.empty(0, device=DEVICE)
    assert add(x, x).numel() == 0


def test_inputs_are_left_untouched():
    x, y = random_pair((3000,), torch.float32)
    x0, y0 = x.clone(), y.clone()
    add(x, y)
    assert torch.equal(x, x0) and torch.equal(y, y0)


x, y = random_pair((64,), torch.float32)
BAD_INPUTS = {
    "strided view": ((x[::2], y[::2]), ValueError, "contiguous"),
    "transposed": ((x.view(8, 8).t(), y.view(8, 8).t()), ValueError, "contiguous"),
    "shapes differ": ((x, y[:-1]), ValueError, "broadcast"),
    "dtypes differ": ((x, y.half()), TypeError, "dtype"),
    "integer dtype": ((x.int(), y.int()), TypeError, "supported"),
    "float64": ((x.double(), y.double()), TypeError, "supported"),
    "wrong device": ((x.to("meta"), y.to("meta")), ValueError, "move it"),
    "not a tensor": (([1.0], [2.0]), TypeError, "torch.Tensor"),
    "needs a gradient": ((x.clone().requires_grad_(), y), RuntimeError, "no backward"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_with_advice(case):
    args, error, advice = BAD_INPUTS[case]
    with pytest.raises(error, match=advice):
        add(*args)
