import kit
import pytest
import torch
from conftest import load_chapter, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

chapter = load_chapter("02")
# Under the interpreter NumPy warns where a GPU silently makes NaN: in the padding rows of a
# tile past the last row, and in the all -inf rows we test on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
DTYPES = chapter.SUPPORTED_DTYPES
FUNCTIONS = {"softmax": (chapter.softmax, False), "log_softmax": (chapter.log_softmax, True)}
# Small chunks, so that the looped (online) kernels run over several chunks at tiny sizes.
LOOPED = chapter.Launch(16, looped=True, programs_per_sm=2)
SPLIT = chapter.Launch(16, num_warps=4, split=True)


def random_input(shape, dtype, seed=0, scale=4.0):
    return random_tensor(shape, dtype, seed, scale)


def reference_grad(x, dy, log):
    x64 = x.detach().double().requires_grad_()
    fn = torch.log_softmax if log else torch.softmax
    (dx,) = torch.autograd.grad(fn(x64, dim=-1), x64, dy.double())
    return dx


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [(1, 1), (1,), (1, 781), (37, 100), (5, 3), (2, 3, 4, 65), (1, 1, 16), (4, 1024)],
)
def test_matches_torch(shape, dtype, name):
    fn, log = FUNCTIONS[name]
    x = random_input(shape, dtype)
    y = fn(x)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, chapter.reference(x, log), **chapter.TOLERANCES[dtype])


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    log=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_any_shape(rows, cols, dtype, log, seed):
    x = random_input((rows, cols), dtype, seed)
    torch.testing.assert_close(chapter.softmax_forward(x, log), chapter.reference(x, log), **chapter.TOLERANCES[dtype])


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 15, 16, 17, 100, 257])
@pytest.mark.parametrize("launch", [LOOPED, SPLIT], ids=["looped", "split"])
def test_long_row_kernels_over_several_chunks(launch, cols, dtype, log):
    x = random_input((3, cols), dtype)
    y = chapter.softmax_forward(x, log, launch)
    torch.testing.assert_close(y, chapter.reference(x, log), **chapter.TOLERANCES[dtype])


def test_split_kernel_leaves_its_row_counters_complete():
    """Every program of a row publishes once: the counter ends at the number of chunks."""
    x = random_input((5, 100), torch.float32)
    counters = []
    real_zeros = torch.zeros

    def spy(*args, **kwargs):
        tensor = real_zeros(*args, **kwargs)
        if tensor.dtype == torch.int32:
            counters.append(tensor)
        return tensor

    torch.zeros = spy
    try:
        chapter.softmax_forward(x, launch=SPLIT)
    finally:
        torch.zeros = real_zeros
    assert [c.tolist() for c in counters] == [[7] * 5]  # 100 columns in chunks of 16


def test_rows_longer_than_one_fused_block_take_the_long_row_kernels():
    n_cols = chapter.MAX_FUSED_BLOCK + 5
    assert chapter.default_launch(n_cols, 4).split  # forward: x read once
    assert chapter.default_launch(n_cols, 2, backward=True).looped
    assert not chapter.default_launch(chapter.MAX_FUSED_BLOCK, 4).split
    x = random_input((2, n_cols), torch.float32)
    for fn, log in FUNCTIONS.values():
        torch.testing.assert_close(fn(x), chapter.reference(x, log), **chapter.TOLERANCES[torch.float32])


def test_fused_block_must_cover_the_row():
    with pytest.raises(ValueError, match="shorter"):
        chapter.softmax_forward(random_input((2, 40), torch.float32), launch=chapter.Launch(32))


@pytest.mark.parametrize("launch", ["default", "one row", "persistent", "looped", "split"])
def test_every_launch_gives_the_same_answer(launch):
    x = random_input((13, 200), torch.float32)
    launches = {
        "default": None,
        "one row": chapter.Launch(256, 1, num_warps=4),
        "persistent": chapter.Launch(256, 4, num_warps=4, num_stages=2, programs_per_sm=1),
        "looped": chapter.Launch(64, looped=True, num_stages=2, programs_per_sm=1),
        "split": chapter.Launch(64, num_warps=4, split=True),
    }
    torch.testing.assert_close(
        chapter.softmax_forward(x, launch=launches[launch]), torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-6
    )


def test_non_contiguous_inputs():
    base = random_input((12, 40), torch.float32)
    views = {
        "strided slice": base[:, 5:30],
        "every other row": base[::2],
        "transposed": base.t(),
        "expanded row": base[0].expand(5, 40),
        "permuted 3-d": base.view(3, 4, 40).permute(1, 0, 2),
    }
    for name, view in views.items():
        for fn, log in FUNCTIONS.values():
            torch.testing.assert_close(fn(view), chapter.reference(view, log), rtol=1e-5, atol=1e-6, msg=name)


def test_inputs_are_left_untouched():
    x = random_input((5, 70), torch.float16)
    x0 = x.clone()
    chapter.softmax(x)
    chapter.log_softmax(x)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("launch", [None, LOOPED, SPLIT])
def test_minus_infinity(name, launch):
    fn, log = FUNCTIONS[name]
    x = random_input((4, 50), torch.float32)
    x[0, ::3] = -float("inf")  # masked entries: probability 0
    x[1] = -float("inf")  # nothing left: NaN, as in torch
    x[2, 7] = -float("inf")
    y = fn(x) if launch is None else chapter.softmax_forward(x, log, launch)
    expected = chapter.reference(x, log)
    assert torch.isnan(y[1]).all() and torch.isnan(expected[1]).all()
    torch.testing.assert_close(y, expected, equal_nan=True)
    if not log:
        assert (y[0, ::3] == 0).all()


def test_large_inputs_do_not_overflow():
    x = torch.tensor([[1000.0, 999.0, -1000.0], [-1e4, -1e4, -1e4]], device=kit.DEVICE)
    for fn, log in FUNCTIONS.values():
        torch.testing.assert_close(fn(x), chapter.reference(x, log))


def test_rows_sum_to_one():
    x = random_input((8, 999), torch.float32, scale=20.0)
    torch.testing.assert_close(chapter.softmax(x).sum(-1), torch.ones(8), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (4, 37), (2, 3, 130)])
def test_gradients_match_torch(shape, dtype, name):
    fn, log = FUNCTIONS[name]
    x = random_input(shape, dtype).requires_grad_()
    dy = random_input(shape, dtype, seed=1, scale=1.0)
    (dx,) = torch.autograd.grad(fn(x), x, dy)
    expected = reference_grad(x, dy, log)
    assert dx.dtype == dtype
    torch.testing.assert_close(dx, expected.to(dtype), **chapter.gradient_tolerance(dtype, expected))


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_looped_backward(dtype, log):
    x = random_input((3, 100), dtype)
    dy = random_input((3, 100), dtype, seed=1, scale=1.0)
    y = chapter.softmax_forward(x, log)
    dx = chapter.softmax_backward(y, dy, log, LOOPED)
    expected = reference_grad(x, dy, log)
    torch.testing.assert_close(dx, expected.to(dtype), **chapter.gradient_tolerance(dtype, expected))


def test_backward_through_a_loss_and_non_contiguous_input():
    base = random_input((6, 30), torch.float32).requires_grad_()
    view = base.t()  # 30 rows of 6, not contiguous
    loss = (chapter.softmax(view) * torch.arange(6.0)).sum() + chapter.log_softmax(view).sum()
    loss.backward()
    base64 = base.detach().double().requires_grad_()
    expected = (torch.softmax(base64.t(), -1) * torch.arange(6.0)).sum() + torch.log_softmax(base64.t(), -1).sum()
    expected.backward()
    torch.testing.assert_close(base.grad, base64.grad.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_gradcheck_in_fp32():
    x = random_input((3, 11), torch.float32, scale=1.0).requires_grad_()
    for fn, _ in FUNCTIONS.values():
        # Finite differences in fp32: coarse steps and loose tolerances.
        assert torch.autograd.gradcheck(fn, (x,), eps=1e-2, atol=1e-2, rtol=1e-2)


def test_empty_input():
    for shape in [(0, 5), (3, 0), (2, 0, 4)]:
        x = torch.empty(shape, device=kit.DEVICE)
        assert chapter.softmax(x).shape == shape
        assert chapter.log_softmax(x).shape == shape


x = random_input((8, 10), torch.float32)
BAD_INPUTS = {
    "integer dtype": (x.int(), TypeError, "supported"),
    "bool": (x > 0, TypeError, "supported"),
    "float64": (x.double(), TypeError, "supported"),
    "0-dim": (x[0, 0], ValueError, "reshape"),
    "wrong device": (x.to("meta"), ValueError, "move it"),
    "not a tensor": ([1.0, 2.0], TypeError, "torch.Tensor"),
}


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_with_advice(case, name):
    fn, _ = FUNCTIONS[name]
    bad, error, advice = BAD_INPUTS[case]
    with pytest.raises(error, match=advice):
        fn(bad)


@pytest.mark.parametrize("launch", [LOOPED, SPLIT], ids=["looped", "split"])
def test_masked_chunk_before_very_negative_values(launch):
    """A chunk of -inf, then values below -88 (whose exp underflows): no NaN, no overflow."""
    x = torch.full((2, 48), -100.0, device=kit.DEVICE)
    x[:, :16] = -float("inf")
    x[1, 20] = -90.0
    for log in (False, True):
        y = chapter.softmax_forward(x, log, launch)
        torch.testing.assert_close(y, chapter.reference(x, log))
