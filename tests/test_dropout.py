"""stepkernels.dropout through its public API: dropout, dropout_bias_act, Dropout, DropoutBiasAct."""

from pathlib import Path
import runpy

from conftest import random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
import numpy as np
import pytest
from stepkernels import Dropout, DropoutBiasAct, dropout, dropout_bias_act
from stepkernels.lessons.check_dropout import check_fused_case, fused_mask
from stepkernels.ops.dropout import fused_launch
from stepkernels.runtime.activations import ACTIVATIONS, activation_reference
from stepkernels.runtime.core import DEVICE, INTERPRET, ON_GPU, fresh_seed, zeroed
import torch

ROOT = Path(__file__).resolve().parent.parent
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def keep_mask(shape, p, seed):
    """The mask ``dropout`` draws for this shape: dropout of ones is nonzero where kept."""
    return dropout(torch.ones(shape, device=DEVICE), p, seed) != 0


def fused_keep_mask(n_rows, n_cols, p, seed):
    return fused_mask(dropout_bias_act, (n_rows, n_cols), p, seed)


def scaled(x, keep, p):
    """where(keep, x / (1 - p), 0), in fp32 and rounded once, as the kernels compute it."""
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return torch.where(keep, x.float() * scale, 0.0).to(x.dtype)


def exact(dtype):
    # The interpreter rounds fp32 to bf16 by truncation: one unit in the last place.
    return {"rtol": 2**-7 if dtype == torch.bfloat16 and INTERPRET else 0.0, "atol": 0.0}


def within_binomial_bound(kept, n, p, sigmas=5.0):
    return abs(kept - n * (1 - p)) <= sigmas * (n * p * (1 - p)) ** 0.5 + 1e-9


def max_off_diagonal_correlation(masks):
    correlation = torch.corrcoef(masks.float().cpu())
    return correlation[~torch.eye(len(masks), dtype=torch.bool)].abs().max().item()


# ----------------------------------------------------------------- the mask
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
def test_keep_rate_within_binomial_bound(p):
    assert within_binomial_bound(keep_mask((2**16,), p, seed=99).sum().item(), 2**16, p)
    assert within_binomial_bound(fused_keep_mask(256, 129, p, seed=5).sum().item(), 256 * 129, p)


def test_blocks_and_philox_lanes_are_uncorrelated():
    # A counter that restarts per block repeats the mask from block to block: not ours.
    blocks = keep_mask((16 * 4096,), 0.5, seed=1).view(16, 4096)
    assert max_off_diagonal_correlation(blocks) < 5 / 4096**0.5
    lanes = keep_mask((2**16,), 0.5, seed=2).view(-1, 4).t()  # the four outputs of a call
    assert max_off_diagonal_correlation(lanes) < 5 / lanes.shape[1] ** 0.5


def test_fused_rows_and_columns_are_uncorrelated():
    keep = fused_keep_mask(64, 1000, 0.5, seed=4)
    assert max_off_diagonal_correlation(keep) < 5 / 1000**0.5
    assert max_off_diagonal_correlation(keep.t()) < 5 / 64**0.5


def test_same_seed_same_mask_other_seed_other_mask():
    a = keep_mask((5000,), 0.5, seed=7)
    assert torch.equal(a, keep_mask((5000,), 0.5, seed=7))
    agreement = (a == keep_mask((5000,), 0.5, seed=8)).float().mean().item()
    assert abs(agreement - 0.5) < 5 * 0.5 / 5000**0.5  # independent masks agree half the time
    x, bias = random_tensor((20, 40)), random_tensor((40,), seed=1)
    b = dropout_bias_act(x, bias, 0.5, "relu", 1)
    assert torch.equal(b, dropout_bias_act(x, bias, 0.5, "relu", 1))
    assert not torch.equal(b, dropout_bias_act(x, bias, 0.5, "relu", 2))


@pytest.mark.parametrize("seed", [2**32 + 3, 2**40 + 3, 2**63 - 1])
def test_large_seeds_work_and_use_their_high_bits(seed):
    # Defect (d): the seed is 63 bits; its high bits must change the mask.
    keep = keep_mask((4000,), 0.5, seed)
    assert within_binomial_bound(keep.sum().item(), 4000, 0.5)
    assert not torch.equal(keep, keep_mask((4000,), 0.5, seed % 2**32))


def test_mask_is_a_function_of_position():
    # Element i gets the same decision whatever the tensor's length or shape.
    long = keep_mask((3000,), 0.5, seed=9)
    assert torch.equal(long[:1001], keep_mask((1001,), 0.5, seed=9))
    assert torch.equal(long.view(30, 100), keep_mask((30, 100), 0.5, seed=9))


# ----------------------------------------------------------------- values and gradients
SHAPES = [(), (1,), (4095,), (4097,), (7, 13), (2, 3, 5, 7)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_is_the_scaled_mask_forward_and_backward(shape, dtype):
    p, seed = 0.3, 17
    x = (random_tensor(shape, dtype) + 0.5).requires_grad_()
    keep = keep_mask(shape, p, seed)
    out = dropout(x, p, seed)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, scaled(x, keep, p), **exact(dtype))
    grad_out = random_tensor(shape, dtype, seed=1)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    torch.testing.assert_close(grad, scaled(grad_out, keep, p), **exact(dtype))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3 * 4096), p=st.floats(0.0, 1.0), seed=st.integers(0, 2**63 - 1))
def test_any_length_p_and_seed(n, p, seed):
    x = random_tensor((n,), seed=seed % 1000)
    torch.testing.assert_close(dropout(x, p, seed), scaled(x, keep_mask((n,), p, seed), p), rtol=0, atol=0)


def test_non_contiguous_input_and_gradient():
    x = random_tensor((64, 48)).requires_grad_()
    view = x.t()
    out = dropout(view, 0.5, 9)
    assert torch.equal(out, dropout(view.detach().contiguous(), 0.5, 9))
    grad_out = random_tensor((64, 48), seed=1).t()  # a transposed view
    (grad,) = torch.autograd.grad(out, x, grad_out)
    (expected,) = torch.autograd.grad(dropout(view, 0.5, 9), x, grad_out.contiguous())
    assert torch.equal(grad, expected)
    bias = random_tensor((64,), seed=3)
    fused = dropout_bias_act(view, bias, 0.5, "gelu", 9)
    assert torch.equal(fused, dropout_bias_act(view.detach().contiguous(), bias, 0.5, "gelu", 9))


def test_p_zero_is_identity_and_p_one_gives_zeros():
    x = random_tensor((3, 333)).requires_grad_()
    assert dropout(x, 0.0, 1) is x and dropout(x, 0, 1) is x  # an int p works too
    out = dropout(x, 1.0, 1)
    assert torch.equal(out, torch.zeros_like(x))
    assert torch.equal(torch.autograd.grad(out, x, torch.ones_like(x))[0], torch.zeros_like(x))
    assert dropout(x, 0.5, 3, training=False) is x


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (2, 0, 3)])
def test_empty_inputs_forward_and_backward(shape):
    x = torch.zeros(shape, device=DEVICE, requires_grad=True)
    out = dropout(x, 0.5, 1)
    assert out.shape == x.shape
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.shape == x.shape


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (2, 0, 3), (3, 4, 0)])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_fused_empty_inputs_match_torch(shape, activation):
    # Defect (c): 0 features crashed with a reshape error; torch gives an empty output.
    x = torch.zeros(shape, device=DEVICE, requires_grad=True)
    bias = torch.zeros(shape[-1], device=DEVICE, requires_grad=True)
    out = dropout_bias_act(x, bias, 0.5, activation, 1)
    expected = torch.nn.functional.dropout(activation_reference(x + bias, activation), 0.5)
    assert out.shape == expected.shape
    grads = torch.autograd.grad(out.sum(), (x, bias))
    assert grads[0].shape == x.shape and torch.equal(grads[1], torch.zeros_like(bias))


def test_inputs_are_left_untouched_and_nothing_is_saved():
    x = random_tensor((30, 100)).requires_grad_()
    bias = random_tensor((100,), seed=1).requires_grad_()
    x0 = x.detach().clone()
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dropout(x, 0.5, 1)
        assert saved == []  # the mask is regenerated, never stored
        dropout_bias_act(x, bias, 0.5, "gelu", 1)
    assert all(t.data_ptr() in (x.data_ptr(), bias.data_ptr()) for t in saved)
    assert torch.equal(x.detach(), x0)


# ----------------------------------------------------------------- the fused layer
def check_fused(shape, dtype, activation, p, seed):
    x = random_tensor(shape, dtype)
    bias = random_tensor(shape[-1:], dtype, seed=1)
    grad_out = random_tensor(shape, dtype, seed=2)
    check_fused_case(dropout_bias_act, x, bias, grad_out, p, activation, seed)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (7, 13), (3, 4, 37)])
def test_fused_matches_torch_forward_and_backward(shape, dtype, activation):
    check_fused(shape, dtype, activation, p=0.3, seed=8)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_fused_rows_spread_over_several_programs_and_column_blocks(activation):
    # Rows enough for several per program (about 8 programs per SM; the interpreter counts
    # 4 SMs), the bias gradient reduced across programs; 1,030 columns: two column blocks,
    # the second ragged.
    shape = (3000 if ON_GPU else 40, 20)
    _, rows_per_program, (row_blocks, _) = fused_launch(*shape, backward=True)
    assert rows_per_program > 1 and row_blocks > 1  # db summed over programs of several rows
    check_fused(shape, torch.float32, activation, p=0.2, seed=1)
    check_fused((6, 1030), torch.float32, activation, p=0.2, seed=1)


# Several programs of several rows a column block, two column blocks, the second ragged.
SCRATCH_SHAPE = (3000 if ON_GPU else 24, 1030)


def test_the_scratch_shape_spreads_over_programs_and_column_blocks():
    _, rows_per_program, grid = fused_launch(*SCRATCH_SHAPE, backward=True)
    assert rows_per_program > 1 and grid[0] > 1 and grid[1] == 2


def fused_gradients(shape, dtype, seed=3):
    x = random_tensor(shape, dtype).requires_grad_()
    bias = random_tensor(shape[-1:], dtype, seed=1).requires_grad_()
    out = dropout_bias_act(x, bias, 0.2, "gelu", seed)
    return torch.autograd.grad(out, (x, bias), random_tensor(shape, dtype, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_backward_leaves_its_scratch_zeroed_and_calls_do_not_accumulate(dtype):
    shape = SCRATCH_SHAPE
    first = fused_gradients(shape, dtype)
    second = fused_gradients(shape, dtype)
    assert torch.equal(first[0], second[0])
    torch.testing.assert_close(first[1], second[1], rtol=1e-3, atol=1e-3)  # not twice as large
    assert not zeroed(DEVICE, shape[1], torch.float32).any()  # db's sums, left at zero
    assert not zeroed(DEVICE, 2).any()  # the two column blocks' counters


def test_fused_deterministic_mode_gives_the_same_db_bits_every_run():
    shape = SCRATCH_SHAPE
    atomic = fused_gradients(shape, torch.float32)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [fused_gradients(shape, torch.float32) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(run[0], atomic[0]) for run in runs)  # dx never depended on it
    assert all(torch.equal(run[1], runs[0][1]) for run in runs[1:])
    torch.testing.assert_close(runs[0][1], atomic[1], rtol=1e-4, atol=1e-4)


def test_fused_p_zero_one_and_eval():
    x = random_tensor((10, 30)).requires_grad_()
    bias = random_tensor((30,), seed=1).requires_grad_()
    gelu = torch.nn.functional.gelu(x + bias)
    torch.testing.assert_close(dropout_bias_act(x, bias, 0.0, "gelu", 1), gelu)
    torch.testing.assert_close(dropout_bias_act(x, bias, 0.5, "gelu", 1, training=False), gelu)
    out = dropout_bias_act(x, bias, 1.0, "gelu", 1)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out, (x, bias), torch.ones_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_fused_scale_is_that_of_the_p_its_mask_draws():
    """The mask drops with p rounded to a multiple of 2^-16; the kept values must be scaled
    by 1 / (1 - that p), or the mean is off (by 8% at p = 1 - 1.4 / 2^16)."""
    x, bias = random_tensor((64, 48)), random_tensor((48,), seed=1)
    p = 0.3 + 0.4 / 2**16  # between two multiples of 2^-16
    drawn = round(p * 2**16) / 2**16
    out = dropout_bias_act(x, bias, p, None, 5)
    kept = out != 0
    assert 0 < kept.sum() < out.numel()
    want = (x + bias) * (1.0 / (1.0 - drawn))
    torch.testing.assert_close(out[kept], want[kept], rtol=2e-7, atol=0)


# ----------------------------------------------------------------- seeds in memory
def seed_tensor(seed, shape=()):
    return torch.full(shape, seed, dtype=torch.int64, device=DEVICE)


def apply(kind, x, bias, seed, p=0.4):
    """``dropout`` (kind "dropout"), or the fused layer with no activation ("fused") or GELU."""
    if kind == "dropout":
        return dropout(x, p, seed)
    return dropout_bias_act(x, bias, p, None if kind == "fused" else kind, seed)


def output_and_grads(kind, x, bias, seed):
    out = apply(kind, x, bias, seed)
    inputs = (x,) if kind == "dropout" else (x, bias)
    return (out, *torch.autograd.grad(out, inputs, random_tensor(out.shape, out.dtype, seed=2)))


def assert_same_outputs(ours, theirs):
    """Output and dx bit for bit; db (third, if any) to its dtype's rounding: its fp32 sums
    go in with atomics, in arrival order, so its last bits vary from run to run."""
    for i, (mine, wanted) in enumerate(zip(ours, theirs, strict=True)):
        if i < 2:
            assert torch.equal(mine, wanted)
        else:
            tol = torch.finfo(mine.dtype).eps if mine.dtype != torch.float32 else 1e-5
            torch.testing.assert_close(mine, wanted, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["dropout", "fused", "gelu"])
@pytest.mark.parametrize(
    ("shape", "dtype", "seed_shape"),
    [((97,), torch.float32, ()), ((7, 13), torch.float16, (1,)), ((3, 4, 37), torch.bfloat16, ())],
)
def test_a_seed_tensor_draws_the_mask_of_its_value(shape, dtype, seed_shape, kind):
    # The kernel loads the int64 and gives it to Philox as it would the integer argument: the
    # same random numbers, so the same outputs and gradients, bit for bit. 2**40 + 3 needs the
    # seed's high word.
    x = random_tensor(shape, dtype).requires_grad_()
    bias = random_tensor(shape[-1:], dtype, seed=1).requires_grad_()
    for seed in (5, 2**40 + 3):
        ours = output_and_grads(kind, x, bias, seed_tensor(seed, seed_shape))
        assert_same_outputs(ours, output_and_grads(kind, x, bias, seed))
    with torch.no_grad():  # the launch without autograd reads the tensor too
        assert torch.equal(apply(kind, x, bias, seed_tensor(9, seed_shape)), apply(kind, x, bias, 9))


@pytest.mark.parametrize("kind", ["dropout", "gelu"])
def test_advancing_the_seed_tensor_after_the_forward_keeps_the_backwards_mask(kind):
    # A training step replayed by a CUDA graph advances its seeds in place, maybe before the
    # backward of the step before runs: that backward still uses its own forward's mask.
    x = random_tensor((6, 40)).requires_grad_()
    bias = random_tensor((40,), seed=1).requires_grad_()
    seeds = torch.tensor([11, 12], device=DEVICE)
    out = apply(kind, x, bias, seeds[1])  # a view: the kernel reads seeds' storage
    seeds.add_(2)
    inputs = (x,) if kind == "dropout" else (x, bias)
    grads = torch.autograd.grad(out, inputs, random_tensor(out.shape, seed=2))
    assert_same_outputs((out, *grads), output_and_grads(kind, x, bias, 12))
    assert torch.equal(apply(kind, x, bias, seeds[1]), apply(kind, x, bias, 14))  # the next mask
    assert not torch.equal(apply(kind, x, bias, seeds[1]), out)


def test_a_seed_tensor_in_place_and_nothing_saved():
    leaf = random_tensor((30,)).requires_grad_()
    hidden = leaf * 2
    out = dropout(hidden, 0.5, seed_tensor(4), inplace=True)
    assert out is hidden and torch.equal(out, dropout(leaf.detach() * 2, 0.5, 4))
    (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    assert torch.equal(grad, 2 * dropout(torch.ones_like(leaf), 0.5, 4))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        dropout(leaf, 0.5, seed_tensor(4))
    assert saved == []  # the seed's copy is held by the backward, not saved as a mask would be


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_a_cuda_graph_draws_a_new_mask_at_every_replay():
    # No host synchronization on the tensor path (capture would fail), lean launches of a
    # pointer seed, and replays that read the seeds as they are at each replay.
    x = random_tensor((64, 1000)).requires_grad_()
    bias = random_tensor((1000,), seed=1).requires_grad_()
    grad_out = random_tensor((64, 1000), seed=2)
    seeds = torch.tensor([3, 4], device=DEVICE)

    def step(first, second):
        out = dropout(dropout_bias_act(x, bias, 0.3, "gelu", first), 0.2, second)
        return (out.detach(), *torch.autograd.grad(out, (x, bias), grad_out))  # no graph kept

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, and fill lean's launch caches
            step(seeds[0], seeds[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(seeds[0], seeds[1])
    masks = []
    for first in (3, 20, 2**40 + 1):
        seeds.copy_(torch.tensor([first, first + 1]))
        graph.replay()
        assert_same_outputs(captured, step(first, first + 1))
        masks.append(captured[0] != 0)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


# ----------------------------------------------------------------- double backward
@pytest.mark.parametrize(
    "function",
    [lambda x, b: dropout(x, 0.5, 3), lambda x, b: dropout_bias_act(x, b, 0.5, "gelu", 3)],
    ids=["dropout", "dropout_bias_act"],
)
def test_double_backward_is_refused(function):
    # Defect (a): create_graph=True silently returned a gradient with no graph.
    x = random_tensor((8, 16)).requires_grad_()
    bias = random_tensor((16,), seed=1).requires_grad_()
    out = function(x, bias)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(function(x, bias).sum(), x)  # a first derivative still works
    assert grad.shape == x.shape


# ----------------------------------------------------------------- modules
def test_dropout_module_seeds_are_63_bit_and_reproducible():
    # Defect (d): the module drew 31-bit seeds, so masks repeated within 200,000 calls.
    x = torch.ones(4000, device=DEVICE)
    module = Dropout(0.5)
    torch.manual_seed(0)
    first = [module(x) for _ in range(3)]
    torch.manual_seed(0)
    seeds = [fresh_seed() for _ in range(3)]
    assert any(seed >= 2**32 for seed in seeds)
    for out, seed in zip(first, seeds, strict=True):
        assert torch.equal(out, dropout(x, 0.5, seed))
    assert not torch.equal(first[0], first[1])  # a fresh mask on each call


def test_fused_module_seeds_are_63_bit():
    layer = DropoutBiasAct(16, p=0.5, activation=None)
    x = torch.ones(5, 16, device=DEVICE)
    torch.manual_seed(1)
    out = layer(x)
    torch.manual_seed(1)
    seed = fresh_seed()
    assert seed >= 2**32 and torch.equal(out, dropout_bias_act(x, layer.bias.detach(), 0.5, None, seed))


def test_dropout_module_is_nn_dropout_compatible():
    assert repr(Dropout(0.25)) == "Dropout(p=0.25, inplace=False)"
    assert repr(Dropout(p=0.5, inplace=True)) == repr(torch.nn.Dropout(p=0.5, inplace=True))
    x = random_tensor((8, 100))
    assert Dropout(0.5).eval()(x) is x
    assert Dropout(0.5).state_dict() == {}
    module = Dropout(0.5)
    module.load_state_dict(torch.nn.Dropout(0.5).state_dict())


def test_dropout_inplace_writes_into_x_and_returns_it():
    # Defect (e): Dropout took no ``inplace``; nn.Dropout does.
    x = random_tensor((50, 40))
    expected = dropout(x, 0.5, 3)
    assert dropout(x, 0.5, 3, inplace=True) is x and torch.equal(x, expected)
    strided = random_tensor((40, 50)).t()  # non-contiguous: written through a copy
    expected = dropout(strided, 0.5, 3)
    assert dropout(strided, 0.5, 3, inplace=True) is strided and torch.equal(strided, expected)
    x = random_tensor((50, 40))
    torch.manual_seed(3)
    expected = Dropout(0.5)(x)
    torch.manual_seed(3)
    assert Dropout(0.5, inplace=True)(x) is x and torch.equal(x, expected)


def test_dropout_inplace_under_autograd():
    leaf = random_tensor((30,)).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        Dropout(0.5, inplace=True)(leaf)  # as torch.nn.Dropout(inplace=True) refuses
    hidden = leaf * 2
    out = dropout(hidden, 0.5, 4, inplace=True)
    assert out is hidden
    (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    torch.testing.assert_close(grad, 2 * dropout(torch.ones_like(leaf), 0.5, 4), rtol=0, atol=0)
    with torch.no_grad():  # allowed for a leaf, as for any in-place op
        assert dropout(leaf, 0.5, 4, inplace=True) is leaf


def test_dropout_inplace_on_a_tensor_autograd_saved_makes_its_backward_refuse():
    """As torch's in-place ops do: a backward that needs x's old values must not get the
    dropped ones silently (x itself needs no gradient, so no autograd node of ours runs)."""
    x, weight = random_tensor((16,)), random_tensor((16,), seed=1).requires_grad_()
    product = (weight * x).sum()  # autograd saves x for weight's gradient
    dropout(x, 0.5, 2, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.backward()


def test_fused_module_train_eval_state_dict():
    layer = DropoutBiasAct(24, p=0.5, activation="squared_relu")
    with torch.no_grad():
        layer.bias.copy_(random_tensor((24,), seed=2))
    x = random_tensor((6, 24))
    torch.testing.assert_close(layer.eval()(x), torch.relu(x + layer.bias).square())
    out = layer.train()(x)
    assert (out == 0).any()
    out.sum().backward()
    assert layer.bias.grad.shape == (24,)
    copy = DropoutBiasAct(24, p=0.5, activation="squared_relu")
    copy.load_state_dict(layer.state_dict())
    assert torch.equal(copy.bias, layer.bias) and list(layer.state_dict()) == ["bias"]
    assert "activation='squared_relu'" in repr(layer) and "p=0.5" in repr(layer)


def test_fused_module_device_and_dtype():
    # Defect (e): the bias was created on the default device only, in fp32 only.
    layer = DropoutBiasAct(16, 0.1, "relu", device=DEVICE, dtype=torch.float16)
    assert layer.bias.dtype == torch.float16 and layer.bias.device.type == DEVICE.type
    assert layer(random_tensor((4, 16), torch.float16)).dtype == torch.float16
    assert DropoutBiasAct(16, device="meta").bias.device.type == "meta"
    assert DropoutBiasAct(16).bias.device.type == DEVICE.type  # default: where kernels run
    float_layer = DropoutBiasAct(16, p=0.1, activation="relu")
    float_layer(random_tensor((4, 16), torch.float16)).float().sum().backward()
    assert float_layer.bias.grad.dtype == torch.float32  # a half input trains a float bias


def test_module_backward_uses_the_mask_of_its_own_call_and_checkpointing():
    x = random_tensor((2000,)).requires_grad_()
    module = Dropout(0.5)
    out_a, out_b = module(x), module(x)
    (grad_a,) = torch.autograd.grad(out_a, x, torch.ones_like(out_a))
    assert torch.equal(grad_a != 0, out_a != 0) and not torch.equal(out_a != 0, out_b != 0)
    layer = DropoutBiasAct(32, p=0.5, activation="gelu")
    x = random_tensor((8, 32)).requires_grad_()
    torch.manual_seed(1)
    plain = layer(x)
    (grad_plain,) = torch.autograd.grad(plain.sum(), x)
    torch.manual_seed(1)
    checkpointed = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    (grad_checkpointed,) = torch.autograd.grad(checkpointed.sum(), x)
    assert torch.equal(plain, checkpointed) and torch.equal(grad_plain, grad_checkpointed)


# ----------------------------------------------------------------- bad input
x = random_tensor((4, 8))
bias = random_tensor((8,))
BAD_DROPOUT = {
    "p above one": ((x, 1.01, 0), ValueError, "0 <= p <= 1"),
    "p negative": ((x, -0.5, 0), ValueError, "0 <= p <= 1"),
    "p nan": ((x, float("nan"), 0), ValueError, "0 <= p <= 1"),
    "p a tensor": ((x, torch.tensor(0.5), 0), TypeError, "Python float"),
    "p a bool": ((x, True, 0), TypeError, "Python float"),
    "seed a float tensor": ((x, 0.5, torch.tensor(3.0, device=DEVICE)), TypeError, "one int64 on x's device"),
    "seed an int32 tensor": ((x, 0.5, torch.tensor(3, dtype=torch.int32, device=DEVICE)), TypeError, "int64"),
    "seed a tensor of two": ((x, 0.5, torch.tensor([1, 2], device=DEVICE)), ValueError, "of shape \\(2,\\)"),
    "seed on meta": ((x, 0.5, torch.tensor(3, device="meta")), ValueError, "on meta"),
    "seed a list": ((x, 0.5, [3]), TypeError, "one-element int64 tensor"),
    "seed a float": ((x, 0.5, 3.0), TypeError, "Python int"),
    "seed negative": ((x, 0.5, -1), ValueError, "2\\*\\*63"),
    "seed of 64 bits": ((x, 0.5, 2**63), ValueError, "2\\*\\*63"),
    "integer dtype": ((x.int(), 0.5, 0), TypeError, "supported"),
    "float64": ((x.double(), 0.5, 0), TypeError, "supported"),
    "wrong device": ((x.to("meta"), 0.5, 0), ValueError, "move it"),
    "not a tensor": (([1.0, 2.0], 0.5, 0), TypeError, "torch.Tensor"),
}


@pytest.mark.parametrize("case", BAD_DROPOUT)
def test_dropout_refuses_bad_input(case):
    args, error, advice = BAD_DROPOUT[case]
    with pytest.raises(error, match=advice):
        dropout(*args)


def test_p_may_be_a_numpy_float():
    assert torch.equal(dropout(x, np.float32(0.25), 7), dropout(x, 0.25, 7))


BAD_FUSED = {
    "bias too short": ((x, bias[:-1], 0.5, "relu", 0), ValueError, "one value per feature"),
    "bias 2-D": ((x, bias[None], 0.5, "relu", 0), ValueError, "one value per feature"),
    "bias dtype": ((x, bias.half(), 0.5, "relu", 0), TypeError, "to\\(x.dtype\\)"),
    "bias integer": ((x, bias.int(), 0.5, "relu", 0), TypeError, "supported"),
    "bias on meta": ((x, bias.to("meta"), 0.5, "relu", 0), ValueError, "move it"),
    "x a scalar": ((x[0, 0], bias[:1], 0.5, "relu", 0), ValueError, "one value per feature"),
    "unknown activation": ((x, bias, 0.5, "tanh", 0), ValueError, "choose one of"),
    "p above one": ((x, bias, 2.0, "relu", 0), ValueError, "0 <= p <= 1"),
    "seed of 64 bits": ((x, bias, 0.5, "relu", 2**63), ValueError, "2\\*\\*63"),
    "seed a bool tensor": ((x, bias, 0.5, "relu", torch.tensor(True, device=DEVICE)), TypeError, "int64"),
    "seed on meta": ((x, bias, 0.5, "relu", torch.tensor(3, device="meta")), ValueError, "x's device"),
    "x integer": ((x.int(), bias, 0.5, "relu", 0), TypeError, "supported"),
}


@pytest.mark.parametrize("case", BAD_FUSED)
def test_fused_refuses_bad_input(case):
    args, error, advice = BAD_FUSED[case]
    with pytest.raises(error, match=advice):
        dropout_bias_act(*args)


def test_modules_refuse_bad_arguments():
    with pytest.raises(ValueError, match="0 <= p <= 1"):
        Dropout(1.5)
    with pytest.raises(ValueError, match="choose one of"):
        DropoutBiasAct(8, 0.1, "swish")


# ----------------------------------------------------------------- the experiments
def test_experiments_agree_with_the_package():
    """lab/: the flat fused forward equals the package's bit for bit, and the
    comparison variants are dropout (the stored mask is ours, stored)."""
    for script in ("fused_dropout_sweep.py", "dropout_variants.py"):
        namespace = runpy.run_path(str(ROOT / "lab" / script), run_name="check")
        namespace["check"]()
