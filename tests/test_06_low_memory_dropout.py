import kit
import pytest
import torch
from conftest import load_chapter, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

chapter = load_chapter("06")
DTYPES = chapter.SUPPORTED_DTYPES
DEVICE = kit.DEVICE
BLOCK = chapter.BLOCK_SIZE


def within_binomial_bound(kept, n, p, sigmas=5.0):
    return abs(kept - n * (1 - p)) <= sigmas * (n * p * (1 - p)) ** 0.5 + 1e-9


def correlation_bound(n):
    """Five standard deviations of the correlation of two independent samples of size n."""
    return 5.0 / n**0.5


# ----------------------------------------------------------------- statistics of the mask
@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bound(p):
    n = 2**16
    keep = chapter.dropout_keep_mask((n,), p, seed=99)
    assert within_binomial_bound(keep.sum().item(), n, p)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_fused_keep_rate_within_binomial_bound(p):
    keep = chapter.fused_keep_mask(256, 129, p, seed=5)
    assert within_binomial_bound(keep.sum().item(), keep.numel(), p)


def test_blocks_are_uncorrelated():
    # The repeating-mask bug makes every block draw the same mask; ours must not.
    n_blocks = 16
    keep = chapter.dropout_keep_mask((n_blocks * BLOCK,), 0.5, seed=1).view(n_blocks, BLOCK)
    correlation = torch.corrcoef(keep.float().cpu())
    off_diagonal = correlation[~torch.eye(n_blocks, dtype=torch.bool)]
    assert off_diagonal.abs().max() < correlation_bound(BLOCK)
    assert len({tuple(row.tolist()) for row in keep}) == n_blocks


def test_lanes_of_one_philox_call_are_uncorrelated():
    # Elements 4g, 4g+1, 4g+2, 4g+3 share one Philox call and take its four outputs.
    keep = chapter.dropout_keep_mask((2**16,), 0.5, seed=2).view(-1, 4).float().cpu()
    correlation = torch.corrcoef(keep.t())
    off_diagonal = correlation[~torch.eye(4, dtype=torch.bool)]
    assert off_diagonal.abs().max() < correlation_bound(keep.shape[0])


def test_fused_rows_and_columns_are_uncorrelated():
    keep = chapter.fused_keep_mask(64, 1000, 0.5, seed=4).float().cpu()
    for masks in (keep, keep.t()):
        correlation = torch.corrcoef(masks)
        off_diagonal = correlation[~torch.eye(len(masks), dtype=torch.bool)]
        assert off_diagonal.abs().max() < correlation_bound(masks.shape[1])


def test_the_bug_demo_repeats_and_the_fix_does_not():
    buggy = chapter.row_masks(16, 64, global_offsets=False)
    fixed = chapter.row_masks(16, 64, global_offsets=True)
    assert all(torch.equal(row, buggy[0]) for row in buggy)
    assert chapter.row_correlation(buggy) == pytest.approx(1.0)
    assert chapter.row_correlation(fixed) < 0.3


def test_seeds_reproduce_and_differ():
    a = chapter.dropout_keep_mask((5000,), 0.5, seed=7)
    assert torch.equal(a, chapter.dropout_keep_mask((5000,), 0.5, seed=7))
    b = chapter.dropout_keep_mask((5000,), 0.5, seed=8)
    agreement = (a == b).float().mean().item()
    assert abs(agreement - 0.5) < 5 * 0.5 / 5000**0.5  # independent masks agree half the time


def test_large_seeds_work():
    a = chapter.dropout_keep_mask((4000,), 0.5, seed=2**40 + 3)
    b = chapter.dropout_keep_mask((4000,), 0.5, seed=3)
    assert within_binomial_bound(a.sum().item(), 4000, 0.5) and not torch.equal(a, b)


def test_mask_does_not_depend_on_block_size(monkeypatch):
    x = random_tensor(3 * BLOCK + 17)
    reference = chapter.dropout(x, 0.3, 5)
    monkeypatch.setattr(chapter, "BLOCK_SIZE", 256)
    monkeypatch.setattr(chapter, "NUM_WARPS", 2)
    assert torch.equal(chapter.dropout(x, 0.3, 5), reference)


def test_mask_is_a_prefix_property():
    # Position i gets the same decision whatever the tensor's length.
    long = chapter.dropout_keep_mask((3000,), 0.5, seed=9)
    short = chapter.dropout_keep_mask((1001,), 0.5, seed=9)
    assert torch.equal(long[:1001], short)


# ----------------------------------------------------------------- values and gradients
@pytest.mark.parametrize("shape", [(1,), (BLOCK - 1,), (BLOCK + 1,), (7, 13), (2, 3, 5, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_exact_on_kept_and_zero_on_dropped(shape, dtype):
    p, seed = 0.3, 17
    x = random_tensor(shape, dtype) + 0.5
    keep = chapter.dropout_keep_mask(shape, p, seed)
    out = chapter.dropout(x, p, seed)
    assert out.shape == x.shape and out.dtype == dtype
    assert (out[~keep] == 0).all()
    expected = chapter.dropout_reference(x, keep, p)
    torch.testing.assert_close(out, expected, **chapter.tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_uses_the_regenerated_mask(dtype):
    p, seed = 0.4, 23
    x = random_tensor((33, 65), dtype).requires_grad_()
    out = chapter.dropout(x, p, seed)
    grad_out = random_tensor(out.shape, dtype, seed=1)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    keep = chapter.dropout_keep_mask(x.shape, p, seed)
    expected = chapter.dropout_reference(grad_out, keep, p)
    torch.testing.assert_close(grad, expected, **chapter.tolerance(dtype))
    # Also through x.grad, as a training loop would use it.
    out.backward(grad_out)
    torch.testing.assert_close(x.grad, expected, **chapter.tolerance(dtype))


def test_gradient_matches_torch_autograd_of_the_mask():
    p, seed = 0.25, 3
    x = random_tensor((500,)).requires_grad_()
    keep = chapter.dropout_keep_mask(x.shape, p, seed)
    ours = chapter.dropout(x, p, seed).square().sum()
    theirs = (x * keep / (1 - p)).square().sum()
    grad_ours, grad_theirs = (torch.autograd.grad(y, x)[0] for y in (ours, theirs))
    torch.testing.assert_close(grad_ours, grad_theirs)


def test_stored_mask_and_seeded_agree():
    x = random_tensor((4, 1000)).requires_grad_()
    grad_out = random_tensor(x.shape, seed=2)
    seeded = chapter.dropout(x, 0.5, 77)
    stored = chapter.dropout_stored_mask(x, 0.5, 77)
    assert torch.equal(seeded, stored)
    grads = [torch.autograd.grad(y, x, grad_out)[0] for y in (seeded, stored)]
    assert torch.equal(*grads)


def test_rand_per_element_version_is_dropout_too():
    x = random_tensor(3 * BLOCK + 5) + 3.0  # no zeros in x
    out = chapter.RandPerElementDropout.apply(x, 0.2, 4)
    keep = out != 0
    assert within_binomial_bound(keep.sum().item(), x.numel(), 0.2)
    torch.testing.assert_close(out, chapter.dropout_reference(x, keep, 0.2), rtol=0, atol=0)


def test_p_zero_is_identity_and_p_one_gives_zeros():
    x = random_tensor((3, 333)).requires_grad_()
    assert torch.equal(chapter.dropout(x, 0.0, 1), x)
    out = chapter.dropout(x, 1.0, 1)
    assert torch.equal(out, torch.zeros_like(x)) and torch.isfinite(out).all()
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(x))
    assert torch.equal(grad, torch.zeros_like(x))
    assert torch.equal(chapter.dropout(x, 0, 1), x)  # an int p works too


def test_p_zero_with_inf_and_nan_passes_them_through():
    x = torch.tensor([float("inf"), float("nan"), -1.0], device=DEVICE)
    out = chapter.launch_dropout(x, 0.0, 1)  # the kernel itself, not the shortcut
    assert torch.equal(out[[0, 2]], x[[0, 2]]) and out[1].isnan()


def test_eval_mode_and_training_false_are_identity():
    x = random_tensor((8, 100))
    module = chapter.Dropout(0.5).eval()
    assert module(x) is x
    assert chapter.dropout(x, 0.5, 3, training=False) is x


def test_empty_input():
    x = torch.empty(0, 5, device=DEVICE)
    assert chapter.dropout(x, 0.5, 1).shape == (0, 5)
    bias = torch.zeros(5, device=DEVICE)
    assert chapter.dropout_bias_act(x, bias, 0.5, "relu", 1).shape == (0, 5)


def test_non_contiguous_input_gets_the_mask_of_its_contiguous_copy():
    x = random_tensor((64, 48))
    view = x.t()
    torch.testing.assert_close(
        chapter.dropout(view, 0.5, 9), chapter.dropout(view.contiguous(), 0.5, 9), rtol=0, atol=0
    )
    bias = random_tensor((64,), seed=3)
    torch.testing.assert_close(
        chapter.dropout_bias_act(view, bias, 0.5, "gelu", 9),
        chapter.dropout_bias_act(view.contiguous(), bias, 0.5, "gelu", 9),
        rtol=0,
        atol=0,
    )


def test_non_contiguous_gradient_is_handled():
    x = random_tensor((32, 40)).requires_grad_()
    out = chapter.dropout(x, 0.5, 6)
    grad_out = random_tensor((40, 32), seed=1).t()  # a transposed view
    (grad,) = torch.autograd.grad(out, x, grad_out)
    (expected,) = torch.autograd.grad(out, x, grad_out.contiguous())
    assert torch.equal(grad, expected)


def test_inputs_are_left_untouched():
    x = random_tensor((3000,))
    x0 = x.clone()
    chapter.dropout(x, 0.5, 1)
    chapter.dropout_bias_act(x.view(30, 100), random_tensor((100,)), 0.5, "gelu", 1)
    assert torch.equal(x, x0)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 3 * 4096),
    p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(DTYPES),
)
def test_any_length_p_and_seed(n, p, seed, dtype):
    x = random_tensor((n,), dtype, seed=seed % 1000)
    keep = chapter.dropout_keep_mask((n,), p, seed)
    out = chapter.dropout(x, p, seed)
    torch.testing.assert_close(out, chapter.dropout_reference(x, keep, p), **chapter.tolerance(dtype))


# ----------------------------------------------------------------- memory
def test_seeded_dropout_saves_nothing_and_stored_mask_a_byte_per_element():
    x = random_tensor((10_000,)).requires_grad_()
    assert chapter.saved_bytes(lambda t: chapter.dropout(t, 0.3, 1), x)[0] == 0
    assert chapter.saved_bytes(lambda t: chapter.dropout_stored_mask(t, 0.3, 1), x)[0] == 10_000


def test_fused_layer_saves_only_what_it_was_given():
    x = random_tensor((100, 64)).requires_grad_()
    bias = random_tensor((64,)).requires_grad_()
    saved = {}

    def pack(tensor):
        saved[tensor.data_ptr()] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chapter.dropout_bias_act(x, bias, 0.3, "gelu", 1)
    assert set(saved) <= {x.data_ptr(), bias.data_ptr()}


# ----------------------------------------------------------------- the fused layer
@pytest.mark.parametrize("activation", kit.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (7, 13), (3, 4, 37), (40, 130)])
def test_fused_matches_torch_forward_and_backward(shape, dtype, activation):
    chapter.check_fused(shape, dtype, activation, p=0.3, seed=8)


@pytest.mark.parametrize("activation", kit.ACTIVATIONS)
def test_fused_backward_spans_several_programs(activation, monkeypatch):
    # Few programs force each one to walk many rows and reduce the bias over them.
    monkeypatch.setattr(chapter, "FUSED_PROGRAMS_PER_SM", 1)
    chapter.check_fused((300, 20), torch.float32, activation, p=0.2, seed=1)


def test_fused_with_no_activation_is_dropout_of_the_sum():
    x, bias = random_tensor((9, 50)), random_tensor((50,), seed=1)
    out = chapter.dropout_bias_act(x, bias, 0.5, None, 12)
    keep = chapter.fused_keep_mask(9, 50, 0.5, 12)
    torch.testing.assert_close(out, chapter.dropout_reference(x + bias, keep, 0.5))


def test_fused_p_zero_and_p_one():
    x, bias = random_tensor((10, 30)).requires_grad_(), random_tensor((30,), seed=1).requires_grad_()
    torch.testing.assert_close(
        chapter.dropout_bias_act(x, bias, 0.0, "gelu", 1),
        torch.nn.functional.gelu(x + bias),
    )
    out = chapter.dropout_bias_act(x, bias, 1.0, "gelu", 1)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out, (x, bias), torch.ones_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_fused_seeds_reproduce_and_differ():
    x, bias = random_tensor((20, 40)), random_tensor((40,), seed=1)
    a = chapter.dropout_bias_act(x, bias, 0.5, "relu", 1)
    assert torch.equal(a, chapter.dropout_bias_act(x, bias, 0.5, "relu", 1))
    assert not torch.equal(a, chapter.dropout_bias_act(x, bias, 0.5, "relu", 2))


def test_fused_module_eval_is_bias_and_activation_only():
    layer = chapter.DropoutBiasAct(24, p=0.5, activation="squared_relu")
    with torch.no_grad():
        layer.bias.copy_(random_tensor((24,), seed=2))
    x = random_tensor((6, 24))
    layer.eval()
    torch.testing.assert_close(layer(x), torch.relu(x + layer.bias).square())
    layer.train()
    out = layer(x)
    assert (out == 0).any()
    out.sum().backward()
    assert layer.bias.grad is not None and layer.bias.grad.shape == (24,)


def test_fused_module_half_input_trains_the_float_bias():
    layer = chapter.DropoutBiasAct(16, p=0.1, activation="relu")
    x = random_tensor((4, 16), torch.float16)
    out = layer(x)
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert layer.bias.grad.dtype == torch.float32


# ----------------------------------------------------------------- modules and seeds
def test_module_is_reproducible_under_manual_seed():
    x = random_tensor((1000,))
    module = chapter.Dropout(0.5)
    torch.manual_seed(0)
    first = [module(x) for _ in range(3)]
    torch.manual_seed(0)
    second = [module(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], first[1])  # a fresh mask on each call


def test_module_backward_uses_the_mask_of_its_own_call():
    x = random_tensor((2000,)).requires_grad_()
    module = chapter.Dropout(0.5)
    out_a, out_b = module(x), module(x)
    (grad_a,) = torch.autograd.grad(out_a, x, torch.ones_like(out_a))
    assert torch.equal(grad_a != 0, out_a != 0)
    assert not torch.equal(out_a != 0, out_b != 0)


def test_module_works_under_activation_checkpointing():
    layer = chapter.DropoutBiasAct(32, p=0.5, activation="gelu")
    x = random_tensor((8, 32)).requires_grad_()
    torch.manual_seed(1)
    plain = layer(x)
    (grad_plain,) = torch.autograd.grad(plain.sum(), x)
    torch.manual_seed(1)
    checkpointed = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    (grad_checkpointed,) = torch.autograd.grad(checkpointed.sum(), x)
    assert torch.equal(plain, checkpointed) and torch.equal(grad_plain, grad_checkpointed)


def test_module_reprs():
    assert "p=0.25" in repr(chapter.Dropout(0.25))
    assert "gelu" in repr(chapter.DropoutBiasAct(8, 0.1, "gelu"))


# ----------------------------------------------------------------- bad input
x = random_tensor((4, 8))
bias = random_tensor((8,))
BAD_DROPOUT = {
    "p above one": ((x, 1.01, 0), ValueError, "0 <= p <= 1"),
    "p negative": ((x, -0.5, 0), ValueError, "0 <= p <= 1"),
    "p nan": ((x, float("nan"), 0), ValueError, "0 <= p <= 1"),
    "p a tensor": ((x, torch.tensor(0.5), 0), TypeError, "Python float"),
    "p a bool": ((x, True, 0), TypeError, "Python float"),
    "seed a tensor": ((x, 0.5, torch.tensor(3)), TypeError, "int\\(seed\\)"),
    "seed a float": ((x, 0.5, 3.0), TypeError, "Python int"),
    "seed negative": ((x, 0.5, -1), ValueError, "2\\*\\*63"),
    "integer dtype": ((x.int(), 0.5, 0), TypeError, "supported"),
    "float64": ((x.double(), 0.5, 0), TypeError, "supported"),
    "wrong device": ((x.to("meta"), 0.5, 0), ValueError, "move it"),
    "not a tensor": (([1.0, 2.0], 0.5, 0), TypeError, "torch.Tensor"),
}


@pytest.mark.parametrize("case", BAD_DROPOUT)
def test_dropout_refuses_bad_input(case):
    args, error, advice = BAD_DROPOUT[case]
    with pytest.raises(error, match=advice):
        chapter.dropout(*args)


BAD_FUSED = {
    "bias too short": ((x, bias[:-1], 0.5, "relu", 0), ValueError, "one value per feature"),
    "bias 2-D": ((x, bias[None], 0.5, "relu", 0), ValueError, "one value per feature"),
    "bias dtype": ((x, bias.half(), 0.5, "relu", 0), ValueError, "to\\(x.dtype\\)"),
    "bias integer": ((x, bias.int(), 0.5, "relu", 0), TypeError, "supported"),
    "bias on meta": ((x, bias.to("meta"), 0.5, "relu", 0), ValueError, "move it"),
    "x a scalar": ((x[0, 0], bias[:1], 0.5, "relu", 0), ValueError, "one value per feature"),
    "unknown activation": ((x, bias, 0.5, "tanh", 0), ValueError, "choose one of"),
    "p above one": ((x, bias, 2.0, "relu", 0), ValueError, "0 <= p <= 1"),
    "x integer": ((x.int(), bias, 0.5, "relu", 0), TypeError, "supported"),
    "x wrong device": ((x.to("meta"), bias, 0.5, "relu", 0), ValueError, "move it"),
}


@pytest.mark.parametrize("case", BAD_FUSED)
def test_fused_refuses_bad_input(case):
    args, error, advice = BAD_FUSED[case]
    with pytest.raises(error, match=advice):
        chapter.dropout_bias_act(*args)


def test_modules_refuse_bad_arguments():
    with pytest.raises(ValueError, match="0 <= p <= 1"):
        chapter.Dropout(1.5)
    with pytest.raises(ValueError, match="choose one of"):
        chapter.DropoutBiasAct(8, 0.1, "swish")
