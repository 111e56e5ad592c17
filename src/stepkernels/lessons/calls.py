"""Every public operation called as a user calls it, ours beside torch's: chapter 08's
benchmarks of the CPU time per call and of the call's rate.

A call is named ``"name"`` (forward alone, no input requiring a gradient) or
``"name fwd+bwd"`` (forward and backward through ``torch.autograd.grad`` with respect to the
inputs a layer trains). ``make_call`` returns the zero-argument call on fresh inputs.
"""

from collections.abc import Callable

import stepkernels
import torch
import torch.nn.functional as F

SEED = 1234  # dropout's
# name: (ours, torch's, the inputs that get a gradient; None: no backward). Each takes the
# dict of inputs ``operands`` makes.
OPERATIONS = {
    "softmax": (
        lambda t: stepkernels.softmax(t["x"]),
        lambda t: torch.softmax(t["x"], -1),
        ("x",),
    ),
    "log_softmax": (
        lambda t: stepkernels.log_softmax(t["x"]),
        lambda t: torch.log_softmax(t["x"], -1),
        ("x",),
    ),
    "layer_norm": (
        lambda t: stepkernels.layer_norm(t["x"], t["x"].shape[-1:], t["w_ln"], t["b"]),
        lambda t: F.layer_norm(t["x"], t["x"].shape[-1:], t["w_ln"], t["b"]),
        ("x", "w_ln", "b"),
    ),
    "matmul": (
        lambda t: stepkernels.matmul(t["x"], t["w"].mT),
        lambda t: torch.mm(t["x"], t["w"].mT),
        None,
    ),
    "linear": (
        lambda t: stepkernels.linear(t["x"], t["w"], t["b"]),
        lambda t: F.linear(t["x"], t["w"], t["b"]),
        ("x", "w", "b"),
    ),
    "linear+gelu": (
        lambda t: stepkernels.linear(t["x"], t["w"], t["b"], "gelu"),
        lambda t: F.gelu(F.linear(t["x"], t["w"], t["b"])),
        ("x", "w", "b"),
    ),
    "dropout": (
        lambda t: stepkernels.dropout(t["x"], 0.1, SEED),
        lambda t: F.dropout(t["x"], 0.1),
        ("x",),
    ),
    "dropout_bias_act": (
        lambda t: stepkernels.dropout_bias_act(t["x"], t["b"], 0.1, "gelu", SEED),
        lambda t: F.dropout(F.gelu(t["x"] + t["b"]), 0.1),
        ("x", "b"),
    ),
    "cross_entropy": (
        lambda t: stepkernels.cross_entropy(t["x"], t["target"]),
        lambda t: F.cross_entropy(t["x"], t["target"]),
        ("x",),
    ),
    "linear_cross_entropy": (
        lambda t: stepkernels.linear_cross_entropy(t["x"], t["w"], t["target"]),
        lambda t: F.cross_entropy(F.linear(t["x"], t["w"]), t["target"]),
        ("x", "w"),
    ),
    "attention": (
        lambda t: stepkernels.attention(t["q"], t["k"], t["v"], causal=True),
        lambda t: F.scaled_dot_product_attention(
            t["q"], t["k"], t["v"], is_causal=True
        ),
        ("q", "k", "v"),
    ),
}


def labels(names=None) -> dict:
    """x value -> call, forward then forward and backward, for ``names`` (all by default)."""
    calls = [
        label
        for name, (_, _, grads) in OPERATIONS.items()
        if names is None or name in names
        for label in (name, f"{name} fwd+bwd")[: 1 if grads is None else 2]
    ]
    return dict(enumerate(calls))


def operands(rows, width, heads, device, dtype, requires_grad) -> dict:
    """Fresh inputs: x (rows, width), a square weight, a bias, a layer norm's weight, the
    attention's q, k, v of shape ``heads`` and a target of ``width`` classes."""
    make = lambda *shape, scale=1.0: (
        torch.randn(*shape, device=device, dtype=dtype) * scale
    ).requires_grad_(requires_grad)
    t = dict(x=make(rows, width), w=make(width, width, scale=width**-0.5))
    t.update(b=make(width), w_ln=make(width), q=make(*heads), k=make(*heads))
    t.update(v=make(*heads), target=torch.randint(width, (rows,), device=device))
    return t


def make_call(label, ours, rows, width, heads, device, dtype=torch.float16) -> Callable:
    """The call ``label`` (``"softmax"``, ``"softmax fwd+bwd"``...), ours or torch's."""
    name, backward = label.split()[0], label.endswith("fwd+bwd")
    mine, theirs, grads = OPERATIONS[name]
    fn = mine if ours else theirs
    t = operands(rows, width, heads, device, dtype, requires_grad=backward)
    if not backward:
        return lambda: fn(t)
    leaves, grad = [t[g] for g in grads], torch.ones_like(fn(t))
    return lambda: torch.autograd.grad(fn(t), leaves, grad)
