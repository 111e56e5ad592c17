"""linear and FusedLinear: forward and gradients against torch, empty and odd shapes, the
custom operators' registrations, torch.compile, and refusals."""

import importlib

from conftest import random_tensor
import pytest
from stepkernels import FusedLinear, linear
from stepkernels.runtime.activations import ACTIVATIONS, activation_reference
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

linear_module = importlib.import_module("stepkernels.ops.linear")  # the package's `linear` is the function

DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())  # no bf16 dot on CPU
UNIT = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def torch_linear(x, weight, bias=None, activation=None):
    return activation_reference(torch.nn.functional.linear(x, weight, bias), activation)


def assert_close(got, want, dtype):
    """Relative to the element, and in absolute terms to the largest element (dW sums rows)."""
    unit = UNIT[dtype]
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=unit, atol=unit * scale)


def inputs(shape, out_features, dtype, bias=True, seed=0):
    x = random_tensor(shape, dtype, seed=seed)
    weight = random_tensor((out_features, shape[-1]), dtype, seed=seed + 1, scale=shape[-1] ** -0.5 if shape[-1] else 1)
    return x, weight, (random_tensor(out_features, dtype, seed=seed + 2) if bias else None)


def gradients(fn, tensors, grad_y):
    """fn(*tensors) and the gradients of every tensor that is not None, for grad_y."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    present = [t for t in leaves if t is not None]
    return [y, *torch.autograd.grad(y, present, grad_y)]


def check(shape, out_features, dtype, activation, bias=True, recompute=False):
    tensors = inputs(shape, out_features, dtype, bias)
    grad_y = random_tensor((*shape[:-1], out_features), dtype, seed=9)
    got = gradients(lambda *t: linear(*t, activation=activation, recompute=recompute), tensors, grad_y)
    fp32 = [t.float() if t is not None else None for t in tensors]
    want = gradients(lambda *t: torch_linear(*t, activation=activation), fp32, grad_y.float())
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, dtype)
    return got


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_activation_and_dtype(dtype, activation):
    check((5, 17), 9, dtype, activation)


@pytest.mark.parametrize(
    "shape, out_features",
    [((1, 1), 1), ((7,), 3), ((2, 3, 20), 33), ((4, 1, 2, 8), 16), ((70, 65), 67)],
)
def test_shapes(shape, out_features):
    check(shape, out_features, torch.float32, "gelu")


@pytest.mark.parametrize("activation", [None, "relu"])
def test_without_bias(activation):
    check((6, 12), 10, torch.float32, activation, bias=False)


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("bias", [True, False])
def test_no_input_features_gives_act_of_bias(activation, bias):
    """Defect: 0 in_features crashed in reshape; torch returns act(bias) per row (0 without bias)."""
    got = check((3, 0), 5, torch.float32, activation, bias=bias)
    x, weight, b = inputs((2, 4, 0), 5, torch.float32, bias)
    y = linear(x, weight, b, activation)
    assert y.shape == (2, 4, 5)
    torch.testing.assert_close(y, torch_linear(x, weight, b, activation))
    assert got[0].shape == (3, 5)


@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6)])
def test_empty_batch(shape):
    """No rows: an empty output, and zero gradients for weight and bias."""
    got = check(shape, 4, torch.float32, "gelu")
    assert got[0].shape == (*shape[:-1], 4)
    assert not got[2].any() and not got[3].any()


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_layer_without_features_or_rows():
    for in_features, rows in ((0, 3), (4, 0)):
        layer = FusedLinear(in_features, 5, activation="relu").to(DEVICE)
        x = torch.ones(rows, in_features, device=DEVICE)
        torch.testing.assert_close(layer(x), torch.relu(torch.nn.functional.linear(x, layer.weight, layer.bias)))


@pytest.mark.parametrize("activation", ["gelu", "squared_relu"])
def test_keep_and_recompute_give_the_same_bits(activation):
    kept = check((8, 12), 5, torch.float16, activation, recompute=False)
    recomputed = check((8, 12), 5, torch.float16, activation, recompute=True)
    assert all(map(torch.equal, kept, recomputed))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("shape, out_features", [((70, 65), 67), ((1, 9), 130), ((33, 5), 1)])
def test_transposed_dz_for_tf32(monkeypatch, shape, out_features, recompute):
    # Where dW's product runs as tf32 on Hopper, the dZ kernel writes dZ^T as well; forced here
    # (on every machine), the same forward and gradients as without it.
    plain = check(shape, out_features, torch.float32, "gelu", recompute=recompute)
    written_t, activation_backward = [], linear_module.activation_backward

    def spy(*args, **kwargs):
        result = activation_backward(*args, **kwargs)
        written_t.append(result[2] is not None)
        return result

    monkeypatch.setattr(linear_module, "activation_backward", spy)
    monkeypatch.setattr(linear_module, "copies_for_tf32", lambda dtype, M, N, K: True)
    written = check(shape, out_features, torch.float32, "gelu", recompute=recompute)
    assert written_t == [True]
    for a, b in zip(plain, written, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("over_z", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (70, 65), (3, 130), (129, 2)])
def test_activation_backward_writes_dz_transposed(shape, dtype, over_z):
    grad_y, z = random_tensor(shape, dtype, seed=3), random_tensor(shape, dtype, seed=4)
    want, want_bias, none = linear_module.activation_backward(grad_y, z.clone(), "gelu", True)
    grad_z, grad_bias, grad_z_t = linear_module.activation_backward(
        grad_y, z, "gelu", True, over_z=over_z, transposed=True
    )
    assert none is None and grad_z_t.is_contiguous() and grad_z_t.shape == shape[::-1]
    assert torch.equal(grad_z, want) and torch.equal(grad_z_t, want.T)
    torch.testing.assert_close(grad_bias, want_bias)
    assert (grad_z.data_ptr() == z.data_ptr()) == over_z


def test_strided_input_and_broadcast_gradient():
    """x a transposed view, and dY the zero-stride gradient of y.sum()."""
    x, weight, bias = inputs((12, 9), 7, torch.float32)
    x = x.t().contiguous().t().requires_grad_()
    weight.requires_grad_()
    linear(x, weight, bias, "leaky_relu").sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    torch_linear(x_ref, w_ref, bias, "leaky_relu").sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(weight.grad, w_ref.grad, rtol=1e-4, atol=1e-4)


def test_fp32_follows_matmul_precision():
    """Defect: fp32 was always tf32 on a GPU; under 'highest' it must match torch's fp32 linear."""
    x, weight, bias = inputs((64, 256), 48, torch.float32, seed=3)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        got, want = linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias)
    finally:
        torch.set_float32_matmul_precision(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, False, True)])
def test_only_the_gradients_asked_for(needs):
    leaves = [t.requires_grad_(n) for t, n in zip(inputs((9, 6), 4, torch.float32), needs, strict=True)]
    linear(*leaves, activation="relu").sum().backward()
    for tensor, need in zip(leaves, needs, strict=True):
        assert (tensor.grad is not None) == need


def test_no_graph_without_gradients():
    x, weight, bias = inputs((4, 6), 3, torch.float32)
    with torch.no_grad():
        y = linear(x, weight.requires_grad_(), bias, activation="gelu")
    assert y.grad_fn is None


def test_state_dict_interchange_with_nn_linear():
    torch.manual_seed(0)
    theirs = torch.nn.Linear(10, 7).to(DEVICE)
    ours = FusedLinear(10, 7, activation="squared_relu").to(DEVICE)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = random_tensor((3, 10), seed=5)
    torch.testing.assert_close(ours(x), torch.relu(theirs(x)).square(), rtol=1e-4, atol=1e-4)
    theirs.load_state_dict(FusedLinear(10, 7, bias=True).to(DEVICE).state_dict())
    assert "activation='squared_relu', recompute=" in repr(ours)
    torch.manual_seed(1)
    fresh_theirs = torch.nn.Linear(4, 3)
    torch.manual_seed(1)
    fresh_ours = FusedLinear(4, 3, activation="gelu")
    assert all(map(torch.equal, fresh_ours.parameters(), fresh_theirs.parameters()))


def test_module_dtype_and_recompute():
    layer = FusedLinear(6, 4, False, "gelu", recompute=True, device=DEVICE, dtype=torch.float16)
    assert layer.weight.dtype == torch.float16 and layer.bias is None and layer.recompute
    x = random_tensor((2, 6), torch.float16).requires_grad_()
    layer(x).sum().backward()
    assert x.grad.dtype == torch.float16
    positional = FusedLinear(6, 4, True, "relu", True, DEVICE, torch.float32)  # as before the package
    assert positional.recompute and positional.weight.device.type == DEVICE.type


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_opcheck(activation):
    x, weight, bias = (t.requires_grad_() for t in inputs((5, 6), 3, torch.float32))
    forward = torch.ops.stepkernels.fused_linear.default
    torch.library.opcheck(forward, (x, weight, bias, activation, True))
    torch.library.opcheck(forward, (x, weight, None, activation, False))
    backward = torch.ops.stepkernels.fused_linear_backward.default
    grad_y, z = random_tensor((5, 3), seed=7), random_tensor((5, 3), seed=8)
    torch.library.opcheck(backward, (grad_y, x.detach(), weight.detach(), bias.detach(), z, "gelu", [True, True, True]))
    torch.library.opcheck(backward, (grad_y, x.detach(), weight.detach(), None, None, None, [False, True, False]))


# Inductor on a GPU: chapter 05's quick run compiles with aot_eager, STEPKERNELS_FULL=1 with it.
@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if ON_GPU else []))
def test_torch_compile_fullgraph_gradients(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(FusedLinear(8, 16, activation="gelu"), FusedLinear(16, 3)).to(DEVICE)
    x = random_tensor((5, 2, 8), seed=3)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    grads = []
    for fn in (model, compiled):
        grads.append(torch.autograd.grad(fn(x).square().sum(), list(model.parameters())))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_double_backward_is_refused():
    x, weight, bias = inputs((4, 6), 3, torch.float32)
    y = linear(x, weight.requires_grad_(), bias, activation="gelu")
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(y.sum(), weight, create_graph=True)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, w: linear(x, w.t()), ValueError, "in_features.*the transposed weight"),
        (lambda x, w: linear(x[:, :6], w), ValueError, "x has 6 features where the weight takes 16"),
        (lambda x, w: linear(x.half(), w), TypeError, "dtype"),
        (lambda x, w: FusedLinear(16, 4, device=DEVICE)(x.half()), TypeError, "one dtype for all"),
        (lambda x, w: linear(x, w, torch.zeros(5, device=DEVICE)), ValueError, r"bias \(out_features,\)"),
        (lambda x, w: linear(x, w, torch.zeros(4, device=DEVICE, dtype=torch.float16)), TypeError, "bias"),
        (lambda x, w: linear(x, w, activation="tanh"), ValueError, "unknown"),
        (lambda x, w: linear(x.int(), w.int()), TypeError, "supported"),
        (lambda x, w: linear(x, w[0]), ValueError, "weight"),
        (lambda x, w: linear(x[0, 0], w), ValueError, "x must be"),
        (lambda x, w: linear(x.to("meta"), w.to("meta")), ValueError, "move it"),
        (lambda x, w: linear(x.tolist(), w), TypeError, "torch.Tensor"),
        (lambda x, w: FusedLinear(4, 4, activation="tanh"), ValueError, "unknown"),
    ],
)
def test_bad_input_is_refused_with_a_message(call, error, match):
    with pytest.raises(error, match=match):
        call(random_tensor((8, 16)), random_tensor((4, 16), seed=1))


def test_dtype_mismatch_under_autocast_says_autocast_does_not_cast_for_us():
    """nn.Linear's bf16 output under autocast into FusedLinear's fp32 weight: the message
    names autocast, which casts torch's layers and not ours."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), FusedLinear(16, 4)).to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="autocast does not cast for our kernels"):
            model(random_tensor((8, 16)))


matmul_module = importlib.import_module("stepkernels.ops.matmul")
SPLIT_16 = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_on_the_descriptor_kernel_split_along_k(monkeypatch, dtype, activation):
    # As on Hopper (the interpreter's 4 SMs): dW = dYᵀ X over 1,024 tokens (a 16 x 24 weight)
    # goes to chapter 07's kernel, dYᵀ read column-major in place, its two 16 x 16 tiles split
    # along K; the gradients as torch's, and the same bits twice.
    from stepkernels.ops.matmul_hopper import launch_tma, tma_layout
    from stepkernels.ops.matmul_tuning import programs, tail_shares

    monkeypatch.setattr(matmul_module, "ON_HOPPER", True)
    split = {**SPLIT_16, "SPLIT_TAIL": True}
    weight_gradients = []

    def launch_split(a, b, *args):
        (M, K), N = a.shape, b.shape[1]
        if tma_layout(a) == "column":  # dYᵀ: the weight gradient
            weight_gradients.append(tail_shares(M, N, K, split, programs(split)))
        return launch_tma(a, b, *args[:3], split, *args[4:])

    monkeypatch.setattr(matmul_module, "launch_tma", launch_split)
    first = check((1024, 24), 16, dtype, activation)
    second = check((1024, 24), 16, dtype, activation)
    assert len(weight_gradients) == 2 and all(shares > 1 for shares in weight_gradients)
    assert all(map(torch.equal, first, second))


@pytest.mark.skipif(not ON_GPU, reason="the GPT step's sizes: a GPU")
@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("features", [(384, 1152), (384, 384), (384, 1536), (1536, 384)], ids=str)
def test_the_steps_layers_in_bf16(features, activation):
    # Chapter 12's Shakespeare step: 16,384 tokens; on Hopper dW splits along K (issue 41).
    in_features, out_features = features
    first = check((16384, in_features), out_features, torch.bfloat16, activation)
    second = check((16384, in_features), out_features, torch.bfloat16, activation)
    assert all(map(torch.equal, first, second))
