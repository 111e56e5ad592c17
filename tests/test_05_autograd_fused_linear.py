import kit
import pytest
import torch
from conftest import load_chapter, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

chapter = load_chapter("05")
DTYPES = (torch.float32, torch.float16)  # bf16 products are checked on a GPU only


@pytest.mark.parametrize("activation", kit.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, out_features",
    [((1, 1), 1), ((1, 7), 3), ((5, 17), 9), ((2, 3, 20), 33), ((4, 1, 2, 8), 16)],
)
def test_forward_and_gradients_match_torch(shape, out_features, dtype, activation):
    chapter.gradients_match(shape, out_features, dtype, activation)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_without_bias(activation):
    chapter.gradients_match((6, 12), 10, torch.float32, activation, bias=False)


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.integers(1, 40),
    out_features=st.integers(1, 40),
    activation=st.sampled_from(kit.ACTIVATIONS),
)
def test_any_shape(rows, in_features, out_features, activation):
    chapter.gradients_match((rows, in_features), out_features, torch.float32, activation)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, False, True)])
def test_only_the_gradients_asked_for(needs):
    x, weight, bias = random_tensor((9, 6), seed=1), random_tensor((4, 6), seed=2), random_tensor(4, seed=3)
    leaves = [t.requires_grad_(need) for t, need in zip((x, weight, bias), needs, strict=True)]
    y = chapter.linear(*leaves, activation="relu")
    y.sum().backward()
    for tensor, need in zip(leaves, needs, strict=True):
        assert (tensor.grad is not None) == need


def test_recompute_gives_the_same_bits_and_keeps_less():
    x = random_tensor((8, 12), seed=4).requires_grad_()
    layer = chapter.FusedLinear(12, 5, activation="gelu").to(kit.DEVICE)
    grads = []
    for recompute in (False, True):
        layer.recompute = recompute
        x.grad = None
        layer(x).square().sum().backward()
        grads.append(x.grad.clone())
    assert torch.equal(*grads)


def test_module_loads_an_nn_linear_checkpoint():
    torch.manual_seed(0)
    theirs = torch.nn.Linear(10, 7).to(kit.DEVICE)
    ours = chapter.FusedLinear(10, 7, activation="squared_relu").to(kit.DEVICE)
    ours.load_state_dict(theirs.state_dict())
    x = random_tensor((3, 10), seed=5)
    expected = torch.relu(theirs(x)).square()
    torch.testing.assert_close(ours(x), expected, rtol=1e-4, atol=1e-4)
    assert "activation=squared_relu" in repr(ours)


def test_no_graph_without_gradients():
    x, weight = random_tensor((4, 6)), random_tensor((3, 6), seed=1)
    with torch.no_grad():
        y = chapter.linear(x, weight, activation="gelu")
    assert y.grad_fn is None


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, w: chapter.linear(x, w.t()), ValueError, "features"),
        (lambda x, w: chapter.linear(x.half(), w), TypeError, "convert"),
        (lambda x, w: chapter.linear(x, w, torch.zeros(5)), ValueError, "bias must have shape"),
        (lambda x, w: chapter.linear(x, w, activation="tanh"), ValueError, "unknown"),
        (lambda x, w: chapter.linear(x.int(), w.int()), TypeError, "supported"),
        (lambda x, w: chapter.linear(x, w[0]), ValueError, "2-D"),
        (lambda x, w: chapter.linear(x.to("meta"), w.to("meta")), ValueError, "move it"),
        (lambda x, w: chapter.FusedLinear(4, 4, activation="tanh"), ValueError, "unknown"),
    ],
)
def test_bad_input_is_refused_with_a_message(call, error, match):
    with pytest.raises(error, match=match):
        call(random_tensor((8, 16)), random_tensor((4, 16), seed=1))


def test_custom_op_registration():
    x, weight, bias = random_tensor((5, 6)), random_tensor((3, 6), seed=1), random_tensor(3, seed=2)
    args = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), "gelu", True)
    torch.library.opcheck(chapter.fused_linear_op, args, test_utils=("test_schema", "test_faketensor"))
