"""The Python path of a call (chapter 08): host arithmetic without Triton's constexpr functions,
lean launches for every kernel of the public operations (tensor descriptors too), and
arguments checked once per call."""

import inspect
import json
import os
from pathlib import Path
import subprocess
import sys

from conftest import random_tensor
import pytest
import stepkernels
from stepkernels.lessons import calls
from stepkernels.runtime import arguments
from stepkernels.runtime.core import DEVICE, ON_GPU
from stepkernels.runtime.launch import LeanKernel, cdiv, next_power_of_2, triton_launches
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor


def test_host_cdiv_and_next_power_of_2_are_tritons():
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**40 + 1) == triton.next_power_of_2(2**40 + 1)


def descriptor(t, block, **options):  # options: padding, where Triton has it (3.4+)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, **options)


def test_launch_key_of_tensor_descriptors():
    """A descriptor specializes a kernel by its dtype, block shape and padding; its shape,
    strides and address are runtime values (and its object is no dict key)."""
    kernel = sys.modules["stepkernels.ops.attention"].attention_forward_kernel
    key = lambda *args: kernel.key(args, {"BLOCK_M": 16}, 0)
    a, b = torch.zeros(32, 64), torch.zeros(128, 64)
    base = key(descriptor(a, [16, 64]), 7)
    assert hash(base) == hash(key(descriptor(a, [16, 64]), 7))
    assert key(descriptor(b, [16, 64]), 7) == base  # another tensor, another shape
    assert key(descriptor(a, [32, 64]), 7) != base  # block shape
    assert key(descriptor(a.half(), [16, 64]), 7) != base  # dtype
    if "padding" in TensorDescriptor.__dataclass_fields__:
        assert key(descriptor(a, [16, 64], padding="nan"), 7) != base


@pytest.mark.parametrize(
    "module, kernels",
    [
        ("softmax", ["softmax_kernel", "softmax_backward_kernel"]),
        ("layer_norm", ["layer_norm_forward_kernel", "layer_norm_backward_kernel"]),
        ("matmul", ["matmul_portable_tuned"]),
        ("matmul_hopper", ["matmul_tma_tuned"]),
        ("linear", ["activation_backward_kernel"]),
        ("dropout", ["dropout_kernel", "bias_act_dropout_kernel"]),
        (
            "cross_entropy",
            [
                "cross_entropy_kernel",
                "scale_unless_one_kernel",
                "mean_scale_kernel",
                "reduce_losses_kernel",
            ],
        ),
        (
            "attention",
            [
                "attention_forward_kernel",
                "attention_key_grads_kernel",
                "attention_query_grad_kernel",
            ],
        ),
    ],
)
def test_public_operations_launch_lean_kernels(module, kernels):
    found = sys.modules[f"stepkernels.ops.{module}"]
    for name in kernels:
        assert isinstance(getattr(found, name), LeanKernel), f"{module}.{name}"


def test_linear_checks_its_arguments_once(monkeypatch):
    """linear's forward and backward run three products: their arguments are linear's,
    checked once, not again by matmul at each."""
    seen = []
    checked = arguments.matmul_arguments
    monkeypatch.setattr(arguments, "matmul_arguments", lambda *a, **k: seen.append(1) or checked(*a, **k))
    tiles = sys.modules["stepkernels.runtime.tiles"]
    monkeypatch.setattr(tiles, "matmul_arguments", arguments.matmul_arguments)
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(8, device=DEVICE, requires_grad=True)
    y = stepkernels.linear(x, w, b, "gelu")
    torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    assert seen == []
    stepkernels.matmul(x.detach(), w.detach().T)  # matmul itself still checks
    assert seen == [1]


def one_node_calls():
    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(16, device=DEVICE, requires_grad=True)
    q = torch.randn(1, 2, 8, 16, device=DEVICE, requires_grad=True)
    target = torch.randint(8, (4,), device=DEVICE)
    return {
        "softmax": lambda: stepkernels.softmax(x),
        "log_softmax": lambda: stepkernels.log_softmax(x),
        "layer_norm": lambda: stepkernels.layer_norm(x, (16,), b, b),
        "linear": lambda: stepkernels.linear(x, w),
        "linear+gelu": lambda: stepkernels.linear(x, w, None, "gelu"),
        "dropout": lambda: stepkernels.dropout(x, 0.1, 3),
        "dropout_bias_act": lambda: stepkernels.dropout_bias_act(x, b, 0.1, "gelu", 3),
        "cross_entropy": lambda: stepkernels.cross_entropy(x, torch.randint(16, (4,), device=DEVICE)),
        "linear_cross_entropy": lambda: stepkernels.linear_cross_entropy(x, w, target),
        "attention": lambda: stepkernels.attention(q, q, q, causal=True),
    }


@pytest.mark.parametrize("name", list(one_node_calls()))
def test_one_autograd_node_per_call(name):
    """An operation on matrices (attention: heads) records one node, whose inputs are the
    leaves themselves: no view or reshape nodes around it for autograd to walk."""
    node = one_node_calls()[name]().grad_fn
    try:
        edges = node.next_functions
    except RuntimeError as refused:  # torch 2.11 (the GPU machine's) on a Function's node
        pytest.skip(f"this torch does not show a Function's edges: {refused}"[:200])
    inputs = [n for n, _ in edges if n is not None]
    assert all(type(n).__name__ == "AccumulateGrad" for n in inputs), node.next_functions


@pytest.mark.skipif(not ON_GPU, reason="lean launches are taken on a GPU only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_lean_attention_matches_tritons_path(dtype):
    """Attention's descriptor kernels, lean: the same bits as through Triton's launch, for
    head dims and sequences that give other descriptors and grids, called again and again."""

    def forward_backward(q, k, v, do):
        out = stepkernels.attention(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    cases = [(1, 2, 128, 64), (2, 3, 77, 40), (1, 2, 128, 64)]  # the first again: cached
    for shape in cases:
        q, k, v = (random_tensor(shape, dtype, seed).requires_grad_() for seed in range(3))
        inputs = (q, k, v, random_tensor(shape, dtype, 3))
        with triton_launches():
            expected = forward_backward(*inputs)
        for _ in range(2):
            for got, want in zip(forward_backward(*inputs), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    attention_module = sys.modules["stepkernels.ops.attention"]
    assert attention_module.attention_forward_kernel.entries  # the lean path was taken


def test_bound_launches_pass_the_launcher_what_keyed_launches_pass():
    """A repeated call of softmax or layer_norm replays its launches bound (chapter 08):
    the same grids, integers, constexprs and tensors (by role: an input, or the call's own
    new tensor) as the launch by key. Run without a GPU and without the interpreter, with
    launchers that record what they are passed (tests/bound_launch_probe.py)."""
    probe = Path(__file__).with_name("bound_launch_probe.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
    ran = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = json.loads(ran.stdout)
    switched = {n: r for n, r in results.items() if ", then " in n}
    results = {n: r for n, r in results.items() if n not in switched}
    assert len(results) == 21 and len(switched) == 13
    for name, result in switched.items():  # another key: not the binding of the first
        assert not result["bound"] and result["same"], name
    for name, result in results.items():
        assert result == {
            "bound": True,
            "same": True,
            "launches": result["launches"],
            "off": True,
        }, name
    assert results["layer_norm fwd+bwd"]["launches"] == 3  # forward, rows, partial sums


@pytest.mark.skipif(not ON_GPU, reason="bound launches are taken on a GPU only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bound_launches_match_tritons_path(dtype):
    """softmax and layer_norm, forward and backward, called again and again (bound
    launches): the same bits as through Triton's launch."""
    x = random_tensor((64, 256), dtype, 0).requires_grad_()
    w, b = (random_tensor((256,), dtype, s).requires_grad_() for s in (1, 2))
    dy = random_tensor((64, 256), dtype, 3)
    calls = {
        "softmax": lambda: stepkernels.softmax(x),
        "log_softmax": lambda: stepkernels.log_softmax(x),
        "layer_norm": lambda: stepkernels.layer_norm(x, (256,), w, b),
    }
    for name, call in calls.items():
        leaves = (x, w, b) if name == "layer_norm" else (x,)

        def step(call=call, leaves=leaves):
            out = call()
            return (out.detach(), *torch.autograd.grad(out, leaves, dy))

        with triton_launches():
            expected = step()
        for _ in range(3):
            for got, want in zip(step(), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(call(), expected[0], rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="bound launches are taken on a GPU only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bound_cross_entropy_matches_tritons_path(dtype):
    """cross_entropy, forward and backward, called again and again (bound launches): the
    same bits as through Triton's launch, for rows on and off the 16-byte grid, an int32
    target with ignored rows, each reduction; then other shapes, which bind anew."""
    wide = random_tensor((77, 1031), dtype, 0)
    cases = [
        (random_tensor((64, 256), dtype, 1), torch.randint(256, (64,), device=DEVICE)),
        (wide[:, 3:1003], torch.randint(-1, 1000, (77,), device=DEVICE).int()),
        (random_tensor((5, 50257), dtype, 2), torch.randint(50257, (5,), device=DEVICE)),
    ]
    for logits, target in [*cases, cases[0]]:  # the first again: bound before
        for reduction in ("mean", "sum", "none"):
            options = dict(ignore_index=-1, reduction=reduction, label_smoothing=0.1)
            leaf = logits.detach().requires_grad_()

            def step(logits=logits, leaf=leaf, target=target, options=options):
                loss = stepkernels.cross_entropy(leaf, target, **options)
                grad = torch.autograd.grad(loss, leaf, torch.ones_like(loss))
                return loss.detach(), *grad, stepkernels.cross_entropy(logits, target, **options)

            with triton_launches():
                expected = step()
            for _ in range(3):
                for got, want in zip(step(), expected, strict=True):
                    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not ON_GPU, reason="bound launches are taken on a GPU only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bound_products_match_tritons_path(dtype):
    """matmul and linear (with gelu, recomputed or kept), forward and backward, called
    again and again (bound launches): the same bits as through Triton's launch, for odd
    shapes, a strided operand and bias, and 3-D x."""
    x_wide = random_tensor((77, 3, 72), dtype, 0)[:, 1, 5:70]  # rows with gaps
    w, b = random_tensor((33, 65), dtype, 1), random_tensor((66,), dtype, 2)[::2]
    x3 = random_tensor((2, 9, 65), dtype, 3)
    calls = {
        "matmul": (lambda x, w, b: stepkernels.matmul(x, w.mT, bias=b), (x_wide,)),
        "linear": (lambda x, w, b: stepkernels.linear(x, w, b), (x3,)),
        "linear+gelu": (lambda x, w, b: stepkernels.linear(x, w, b, "gelu"), (x_wide,)),
        "recompute": (
            lambda x, w, b: stepkernels.linear(x, w, b, "gelu", recompute=True),
            (x3,),
        ),
    }
    for name, (call, (x,)) in calls.items():
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]

        def step(call=call, x=x, leaves=leaves, name=name):
            if name == "matmul":
                return (call(x, w, b),)
            out = call(*leaves)
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
            return out.detach(), *grads, call(x, w, b)

        with triton_launches():
            expected = step()
        for _ in range(3):
            for got, want in zip(step(), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_floor_allocates_and_launches_what_ours_does():
    """Chapter 08's floor of layer_norm's forward and backward: ours allocates y, mean and
    rstd, then dX, dW, dB and the partial sums, and launches one kernel, then two; the
    floor's gradients have the leaves' shapes. (Under the interpreter it launches none.)"""
    call = calls.make_floor("layer_norm fwd+bwd", 8, 32, (1, 1, 8, 16), DEVICE, torch.float32)
    forward, backward = call.phases
    assert [len(p.launches) for p in call.phases] == [1, 2]
    assert len(forward.allocated) == 3 and len(backward.allocated) == 4
    assert sorted(forward.allocated.values(), key=str) == sorted(
        [((8, 32), torch.float32), ((8,), torch.float32), ((8,), torch.float32)], key=str
    )
    grads = call()
    assert [tuple(g.shape) for g in grads] == [(8, 32), (32,), (32,)]
    softmax = calls.make_floor("softmax", 8, 32, (1, 1, 8, 16), DEVICE, torch.float32)
    assert softmax().shape == (8, 32) and len(softmax.__self__.launches) == 1


def test_empty_twin_takes_the_kernels_parameters():
    softmax_kernel = sys.modules["stepkernels.ops.softmax"].softmax_kernel
    dropout_kernel = sys.modules["stepkernels.ops.dropout"].dropout_kernel
    for kernel in (softmax_kernel, dropout_kernel):
        twin = calls.empty_twin(kernel)
        layers = [kernel.kernel]
        while hasattr(layers[-1], "fn"):
            layers.append(layers[-1].fn)
        theirs = inspect.signature(layers[-1]).parameters.values()
        mine = inspect.signature(twin.fn).parameters.values()
        assert [(p.name, "constexpr" in str(p.annotation)) for p in mine] == [
            (p.name, "constexpr" in str(p.annotation)) for p in theirs
        ]
        assert calls.empty_twin(kernel) is twin  # made once
    x = torch.randn(2, 16, device=DEVICE)
    y = torch.zeros_like(x)
    calls.empty_twin(softmax_kernel)[(1,)](x, y, 2, 16, 16, 16, 2, 16, False)
    assert not y.any()  # it does nothing
