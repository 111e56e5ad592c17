"""Chapter 08's operators: layer norm as triton_ops that torch.compile traces, with autograd."""

import os
import subprocess
import sys

from conftest import random_tensor
import pytest
from stepkernels.ops.compiler_ops import TracedLayerNorm, traced_layer_norm
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch
import torch.nn.functional as F


def leaves(dtype, shape=(37, 3, 96)):
    x = random_tensor(shape, dtype).requires_grad_()
    w = random_tensor(shape[-1], dtype, seed=1).requires_grad_()
    b = random_tensor(shape[-1], dtype, seed=2).requires_grad_()
    return x, w, b


def check_against_torch(layer_norm, dtype=torch.float32):
    x, w, b = leaves(dtype)
    dy = random_tensor(x.shape, dtype, seed=3)
    ours = layer_norm(x, (x.shape[-1],), w, b)
    expected = F.layer_norm(x.double(), (x.shape[-1],), w.double(), b.double())
    torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(ours, (x, w, b), dy)
    expected_grads = torch.autograd.grad(expected, (x, w, b), dy.double())
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-3, atol=1e-3)


def test_traced_layer_norm_eager_matches_torch():
    check_against_torch(traced_layer_norm)


def test_traced_layer_norm_without_bias_and_weight_gradients():
    x, w, _ = leaves(torch.float32)
    y = traced_layer_norm(x, (x.shape[-1],), w.detach(), None)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert dx.shape == x.shape and torch.isfinite(dx).all()


def test_traced_layer_norm_refuses_double_backward():
    x, w, b = leaves(torch.float32, (4, 16))
    y = traced_layer_norm(x, (16,), w, b)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_traced_layer_norm_takes_strided_parameters_and_refuses_bad_input():
    """It checks its arguments as layer_norm does (it skipped them: a (6,) normalized_shape
    on rows of 8 normalized groups of 6, a short weight was read past its end), and copies
    strided parameters, which the kernels read as contiguous."""
    x = random_tensor((3, 8))
    pair = random_tensor((8, 2), seed=1)
    weight, bias = pair[:, 0], pair[:, 1]  # stride 2
    want = F.layer_norm(x, (8,), weight, bias)
    torch.testing.assert_close(traced_layer_norm(x, (8,), weight, bias), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="trailing dimensions"):
        traced_layer_norm(random_tensor((2, 6, 8)), (6,))
    with pytest.raises(ValueError, match="normalized_shape"):
        traced_layer_norm(x, (8,), torch.ones(4, device=DEVICE))
    with pytest.raises(TypeError, match="supported"):
        traced_layer_norm(x.double(), (8,))


def test_module_is_the_packages_layer_norm_in_eager_mode():
    module = TracedLayerNorm(96, device=DEVICE)
    x = random_tensor((5, 96))
    torch.testing.assert_close(module(x), F.layer_norm(x, (96,)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of Triton kernels needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_layer_norm_matches_eager(dtype):
    torch._dynamo.reset()
    compiled = torch.compile(traced_layer_norm, fullgraph=True)
    x, w, b = leaves(dtype)
    dy = random_tensor(x.shape, dtype, seed=3)
    y = compiled(x, (96,), w, b)
    # Inductor compiles the same kernel with its own flags: equal to a few ulp, not bitwise.
    torch.testing.assert_close(y, traced_layer_norm(x, (96,), w, b), rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(y, (x, w, b), dy)
    want = torch.autograd.grad(traced_layer_norm(x, (96,), w, b), (x, w, b), dy)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def train_compiled_blocks(width=384, depth=4, sizes=(1024, 4096)):
    """Chapter 08's model (blocks of our layer norm and fused linears, bf16) under
    torch.compile's CUDA graphs: a few SGD steps at each size, a fresh compile for each."""
    from stepkernels import FusedLinear

    factory = dict(device=DEVICE, dtype=torch.bfloat16)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = TracedLayerNorm(width, **factory)
            self.up = FusedLinear(width, 4 * width, activation="gelu", **factory)
            self.down = FusedLinear(4 * width, width, **factory)

        def forward(self, x):
            return x + self.down(self.up(self.norm(x)))

    for n_tokens in sizes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[Block() for _ in range(depth)])
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(n_tokens, width, **factory)
        for _ in range(4):  # warm-up, recording, replays
            optimizer.zero_grad(set_to_none=True)
            loss = compiled(x).float().square().mean()
            loss.backward()
            optimizer.step()
        assert torch.isfinite(loss), n_tokens


@pytest.mark.skipif(not ON_GPU, reason="torch.compile's CUDA graphs need a GPU")
def test_reduce_overhead_training_steps_at_two_sizes():
    """Scratch our kernels keep (the Hopper matmul's counters) must not come from the private
    memory pool of torch.compile's CUDA graphs: made while they warmed up, it failed the next
    size's recording ("tensor(s) in the cudagraph pool not tracked as outputs"). In a fresh
    process, as chapter 08 runs: in this one, earlier tests made that scratch already."""
    tests = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {tests!r}); import test_compiler_ops as t; "
    run = subprocess.run(
        [sys.executable, "-c", code + "t.train_compiled_blocks()"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
