"""add_layer_norm (chapter 15): h = x + residual and layer_norm(h), forward and backward,
against PyTorch's addition and layer norm in fp64, through the public API."""

from conftest import random_tensor
import pytest
from stepkernels import add_layer_norm
from stepkernels.ops import add_layer_norm as module
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

# One rounding of the dtype (two units for bf16: the interpreter truncates where a GPU rounds).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def close(actual, expected, dtype, what):
    # at least 1e-6: a row of one value normalizes to 0, whose fp64 reference is rounding noise
    scale = max(1e-6, expected.abs().max().item() if expected.numel() else 0.0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def check(
    shape,
    x_dtype,
    residual_dtype=None,
    n_dims=1,
    affine=(True, True),
    sliced=False,
    grads=("h", "y"),
    seed=0,
    out_dtype=None,
):
    """h, y and every gradient against fp64 PyTorch; ``sliced``: x's rows are a strided slice;
    ``grads``: which outputs get an incoming gradient; ``out_dtype``: y's."""
    residual_dtype = residual_dtype or x_dtype
    wide = (*shape[:-1], 2 * shape[-1]) if sliced else shape
    x = random_tensor(wide, torch.float32, seed=seed, scale=2.0, shift=0.5).to(x_dtype)
    x = x[..., : shape[-1]] if sliced else x
    residual = random_tensor(shape, residual_dtype, seed=seed + 1)
    normalized = tuple(shape[len(shape) - n_dims :])
    params = [
        random_tensor(normalized, torch.float32, seed=seed + 2 + i) if on else None for i, on in enumerate(affine)
    ]
    inputs = (x, residual, *params)
    ours = [None if t is None else t.detach().requires_grad_() for t in inputs]
    exact = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    h, y = add_layer_norm(ours[0], ours[1], normalized, ours[2], ours[3], out_dtype=out_dtype)
    h_exact = exact[0] + exact[1]
    y_exact = torch.nn.functional.layer_norm(h_exact, normalized, exact[2], exact[3])
    h_dtype = torch.promote_types(x_dtype, residual_dtype)
    y_dtype = out_dtype or h_dtype
    assert h.dtype == h_dtype and y.dtype == y_dtype and h.shape == y.shape == tuple(shape)
    close(h, h_exact, h_dtype, "h")
    close(y, y_exact, y_dtype, "y")
    pairs = [(o, e) for name, o, e in (("h", h, h_exact), ("y", y, y_exact)) if name in grads]
    incoming = [random_tensor(tuple(shape), o.dtype, seed=seed + 7 + i) for i, (o, _) in enumerate(pairs)]
    torch.autograd.backward([o for o, _ in pairs], incoming)
    torch.autograd.backward([e for _, e in pairs], [g.double() for g in incoming])
    for name, mine, theirs in zip(("dx", "dresidual", "dW", "dB"), ours, exact, strict=True):
        if mine is None:
            continue
        if theirs.grad is None:  # y unused: no gradient for the weight and bias
            assert mine.grad is None, name
            continue
        assert mine.grad.dtype == mine.dtype, name
        close(mine.grad, theirs.grad, mine.dtype if name in ("dx", "dresidual") else h_dtype, name)


@pytest.mark.parametrize("shape", [(1, 1), (1, 384), (3, 5, 100), (37, 768), (2, 3, 1000), (130, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_pytorch(shape, dtype):
    check(shape, dtype)


@pytest.mark.parametrize("x_dtype,residual_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
def test_update_of_another_dtype(x_dtype, residual_dtype):
    """Under autocast the stream is fp32 and the update bf16: h is the wider dtype."""
    check((9, 96), x_dtype, residual_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_y_in_the_next_products_dtype(out_dtype):
    """Under autocast: an fp32 stream, a bf16 update, y written in bf16 (its gradient too)."""
    check((9, 96), torch.float32, torch.bfloat16, out_dtype=out_dtype)


def test_long_rows_give_y_in_out_dtype(monkeypatch):
    monkeypatch.setattr(module, "MAX_BLOCK", 64)
    check((3, 100), torch.float32, out_dtype=torch.bfloat16)


def test_strided_rows_and_several_normalized_dims():
    check((6, 4, 50), torch.float32, sliced=True)
    check((5, 4, 6), torch.float32, n_dims=2)


@pytest.mark.parametrize("affine", [(False, False), (True, False)])
def test_without_weight_or_bias(affine):
    check((7, 33), torch.float32, affine=affine)


@pytest.mark.parametrize("grads", [("h",), ("y",)])
def test_one_output_used(grads):
    """dh or dy None: the backward takes the other alone."""
    check((11, 40), torch.float32, grads=grads)


def test_long_rows_take_the_sum_then_layer_norm(monkeypatch):
    monkeypatch.setattr(module, "MAX_BLOCK", 64)
    check((3, 100), torch.float32)


def test_no_rows():
    x = torch.zeros(0, 8, device=DEVICE)
    h, y = add_layer_norm(x, x, (8,))
    assert h.shape == y.shape == (0, 8)


def test_in_the_gpt_equals_add_then_norm():
    """The GPT's blocks on our layers against PyTorch's, in fp32: logits and gradients."""
    from stepkernels import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(30, block_size=8, n_layer=2, n_head=2, n_embd=16)).to(DEVICE)
    idx = torch.randint(30, (2, 8), device=DEVICE)
    results = []
    for use_triton in (True, False):
        model.use_triton = use_triton
        model.zero_grad()
        logits, loss = model(idx, idx)
        loss.backward()
        results.append((logits, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ours, our_grads), (theirs, their_grads) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_refusals():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_layer_norm(x, torch.zeros(4, 9, device=DEVICE), (8,))
    with pytest.raises(TypeError, match="residual"):
        add_layer_norm(x, torch.zeros(4, 8, device=DEVICE, dtype=torch.int32), (8,))
    with pytest.raises(ValueError, match="trailing"):
        add_layer_norm(x, x, (5,))
    with pytest.raises(TypeError, match="out_dtype"):
        add_layer_norm(x, x, (8,), out_dtype=torch.int8)


@pytest.mark.skipif(not ON_GPU, reason="full size needs a GPU")
@pytest.mark.parametrize("width", [384, 768])
def test_full_size(width):
    """A batch of the Shakespeare model (64 x 256 tokens) and of GPT-2 small's width: fp32
    stream, bf16 update, as under autocast."""
    check((64 * 256, width), torch.float32, torch.bfloat16)
