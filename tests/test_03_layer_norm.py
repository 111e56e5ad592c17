import kit
import pytest
import torch
from conftest import load_chapter, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

chapter = load_chapter("03")
DTYPES = chapter.SUPPORTED_DTYPES
REDUCTIONS = chapter.REDUCTIONS


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        dict(shape=(1, 1)),
        dict(shape=(1, 513)),
        dict(shape=(3, 7, 33)),
        dict(shape=(2, 3, 5, 6), n_dims=3),
        dict(shape=(9, 300), block_size=32),  # the walking path over 10 blocks
        dict(shape=(30, 48), view=lambda t: t[::3, 5:40]),  # rows 144 apart, offset start
        dict(shape=(17, 40), affine=(True, False)),
        dict(shape=(17, 40), affine=(False, True)),
        dict(shape=(17, 40), affine=(False, False)),
    ],
)
def test_matches_torch(case, dtype, reduction):
    chapter.check_against_torch(dtype=dtype, reduction=reduction, **case)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 400),
    dtype=st.sampled_from(DTYPES),
    reduction=st.sampled_from(REDUCTIONS),
    block_size=st.sampled_from([None, 16, 128]),
)
def test_any_shape(rows, cols, dtype, reduction, block_size):
    chapter.check_against_torch((rows, cols), dtype, reduction=reduction, block_size=block_size)


@pytest.mark.parametrize("block_size", [None, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows_give_the_bias_and_finite_gradients(dtype, block_size):
    x = torch.full((5, 200), 7.5, device=kit.DEVICE, dtype=dtype, requires_grad=True)
    weight = random_tensor(200, dtype, seed=1).requires_grad_()
    bias = random_tensor(200, dtype, seed=2).requires_grad_()
    y = chapter.layer_norm(x, 200, weight, bias, block_size=block_size)
    torch.testing.assert_close(y, bias.detach().expand_as(y), rtol=0, atol=0)
    y.sum().backward()
    for grad in (x.grad, weight.grad, bias.grad):
        assert torch.isfinite(grad.float()).all()


@pytest.mark.parametrize("block_size", [None, 128])
def test_large_mean_keeps_its_precision(block_size):
    x = random_tensor((6, 1000), torch.float32, seed=3, shift=10_000.0)
    y = chapter.layer_norm(x, 1000, block_size=block_size)
    expected = chapter.layer_norm_reference(x.double(), None, None, 1e-5)
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=2e-3)


def test_two_stage_reduction_repeats_to_the_bit():
    x, dy = random_tensor((50, 300), torch.float32, seed=4), random_tensor((50, 300), torch.float32, seed=5)
    weight = random_tensor(300, torch.float32, seed=6)
    _, mean, rstd = chapter.layer_norm_forward(x, weight, None, 1e-5)
    runs = [chapter.layer_norm_backward(dy, x, weight, mean, rstd, reduction="two-stage") for _ in range(3)]
    for dx, dw, db in runs[1:]:
        assert torch.equal(dx, runs[0][0]) and torch.equal(dw, runs[0][1]) and torch.equal(db, runs[0][2])


@pytest.mark.parametrize("group_size_m", [1, 2, 5, 64])
def test_lock_reduction_any_group_size(group_size_m):
    """Fewer buffers than programs (contention), and more (some buffers never touched)."""
    x, dy = random_tensor((40, 100), torch.float32, seed=7), random_tensor((40, 100), torch.float32, seed=8)
    weight = random_tensor(100, torch.float32, seed=9)
    _, mean, rstd = chapter.layer_norm_forward(x, weight, None, 1e-5)
    _, dw_ref, db_ref = chapter.layer_norm_backward(dy, x, weight, mean, rstd, reduction="two-stage")
    _, dw, db = chapter.layer_norm_backward(
        dy, x, weight, mean, rstd, reduction="lock", group_size_m=group_size_m, rows_per_program=1
    )
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, db_ref, rtol=1e-5, atol=1e-5)


def test_module_is_a_drop_in_for_torch():
    torch.manual_seed(0)
    ours = chapter.LayerNorm((4, 25), device=kit.DEVICE)
    theirs = torch.nn.LayerNorm((4, 25), device=kit.DEVICE)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = random_tensor((3, 4, 25), torch.float32, seed=10)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert not list(chapter.LayerNorm(8, elementwise_affine=False).parameters())
    assert chapter.LayerNorm(8, bias=False).bias is None


def test_no_gradient_for_frozen_parameters():
    x = random_tensor((4, 16), torch.float32).requires_grad_()
    weight = random_tensor(16, torch.float32, seed=1)  # requires_grad False
    chapter.layer_norm(x, 16, weight).sum().backward()
    assert x.grad is not None and weight.grad is None


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: chapter.layer_norm(x, 32), ValueError, "trailing dimensions"),
        (lambda x: chapter.layer_norm(x.int(), 64), TypeError, "supported"),
        (lambda x: chapter.layer_norm(x.double(), 64), TypeError, "supported"),
        (lambda x: chapter.layer_norm(x, 64, torch.ones(32)), ValueError, "normalized_shape"),
        (lambda x: chapter.layer_norm(x, 64, torch.ones(64).half()), TypeError, "convert"),
        (lambda x: chapter.layer_norm(x, 64, eps=-1.0), ValueError, "non-negative"),
        (lambda x: chapter.layer_norm(x, 64, reduction="atomic"), ValueError, "choose one"),
        (lambda x: chapter.layer_norm(x, 64, block_size=100), ValueError, "power of two"),
        (lambda x: chapter.layer_norm(x.to("meta"), 64), ValueError, "move it"),
    ],
)
def test_bad_input_is_refused_with_a_message(call, error, match):
    with pytest.raises(error, match=match):
        call(random_tensor((8, 64), torch.float32))


@pytest.mark.skipif(not kit.ON_GPU, reason="races show only on a GPU, where programs run at once")
@pytest.mark.parametrize("group_size_m", [1, 8, chapter.GROUP_SIZE_M])
def test_lock_reduction_has_no_race_on_the_gpu(group_size_m):
    """Many programs, few buffers: a lost update or a torn read would show as a wrong dW/dB."""
    rows, cols, runs = 16384, 4096, 100
    x, dy = random_tensor((rows, cols), torch.float16, seed=11), random_tensor((rows, cols), torch.float16, seed=12)
    weight = random_tensor(cols, torch.float32, seed=13).half()
    _, mean, rstd = chapter.layer_norm_forward(x, weight, None, 1e-5)
    _, dw_ref, db_ref = chapter.layer_norm_backward(dy, x, weight, mean, rstd, reduction="two-stage")
    worst = 0.0
    for _ in range(runs):
        _, dw, db = chapter.layer_norm_backward(
            dy, x, weight, mean, rstd, reduction="lock", group_size_m=group_size_m, rows_per_program=4
        )
        # The order of additions differs from run to run: one fp16 rounding of slack, no more.
        for mine, ref in ((dw, dw_ref), (db, db_ref)):
            torch.testing.assert_close(mine.float(), ref.float(), rtol=2e-3, atol=2e-3 * ref.abs().max().item())
            worst = max(worst, (mine.float() - ref.float()).abs().max().item())
    print(f"GROUP_SIZE_M={group_size_m}: {runs} runs, largest |dW or dB - two-stage| {worst:.3g}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_explicit_launch_configs(reduction):
    """The configs a launch sweep passes: any rows per program, warps, stages and grid cap
    (a capped grid makes programs loop over several blocks of rows), one block or walked."""
    x, dy = random_tensor((13, 100), torch.float32, seed=14), random_tensor((13, 100), torch.float32, seed=15)
    weight = random_tensor(100, torch.float32, seed=16)
    y_ref, mean_ref, rstd_ref = chapter.layer_norm_forward(x, weight, None, 1e-5)
    grads_ref = chapter.layer_norm_backward(dy, x, weight, mean_ref, rstd_ref, reduction="two-stage")
    launches = ((128, True, 1, None), (128, True, 4, None), (128, True, 2, 3), (128, True, 1, 1), (32, False, 1, None))
    for block, single, rows, programs in launches:
        config = dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, SINGLE_BLOCK=single, NUM_STAGES=2, num_warps=2)
        y, mean, rstd = chapter.layer_norm_forward(x, weight, None, 1e-5, config={**config, "programs": programs})
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rstd, rstd_ref, rtol=1e-5, atol=1e-5)
        for backward_rows in (1, 4):
            config["ROWS_PER_PROGRAM"] = backward_rows
            grads = chapter.layer_norm_backward(dy, x, weight, mean, rstd, reduction=reduction, config=config)
            for mine, ref in zip(grads, grads_ref, strict=True):
                torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    walking = dict(BLOCK_N=32, ROWS_PER_PROGRAM=4, SINGLE_BLOCK=False, NUM_STAGES=1, num_warps=2)
    with pytest.raises(ValueError, match="one row per program"):
        chapter.layer_norm_forward(x, weight, None, 1e-5, config=walking)
