"""Chapter 15's fusions of the GPT step's glue: attention on the heads of one QKV product,
its gradient written in the product's layout (no join, no copy back), checked against fp64
PyTorch; and lab/step_glue.py's map of the step's operators."""

import importlib.util
from pathlib import Path

import pytest
import small_text
from stepkernels.models import gpt
from stepkernels.ops.adamw import FusedAdamW
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def reference(qkv, n_head):
    """Causal attention of a (B, T, 3C) product in fp64, as the model's PyTorch layers."""
    return gpt.TorchLayers().qkv_attention(qkv.double(), n_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, time, n_head, head_dim",
    [(1, 1, 1, 16), (2, 37, 3, 16), (1, 20, 2, 24), (2, 9, 4, 8)],
)
def test_qkv_attention_matches_fp64(batch, time, n_head, head_dim, dtype):
    torch.manual_seed(0)
    width = n_head * head_dim
    qkv = torch.randn(batch, time, 3 * width, device=DEVICE, dtype=dtype, requires_grad=True)
    y = gpt.TritonLayers().qkv_attention(qkv, n_head)
    grad_y = torch.randn_like(y)
    (grad_qkv,) = torch.autograd.grad(y, qkv, grad_y)
    qkv64 = qkv.detach().double().requires_grad_()
    want = reference(qkv64, n_head)
    (want_grad,) = torch.autograd.grad(want, qkv64, grad_y.double())
    assert y.shape == (batch, time, width) and y.dtype == dtype
    assert grad_qkv.shape == qkv.shape and grad_qkv.is_contiguous()
    torch.testing.assert_close(y.double(), want, **TOLERANCES[dtype])
    torch.testing.assert_close(grad_qkv.double(), want_grad, **TOLERANCES[dtype])


def test_a_product_it_cannot_read_in_place_takes_the_general_path():
    """A non-contiguous QKV product goes through split views and chapter 11's attention."""
    torch.manual_seed(0)
    wide = torch.randn(2, 10, 2 * 48, device=DEVICE, requires_grad=True)
    qkv = wide[..., ::2]  # every other column: not contiguous
    y = gpt.TritonLayers().qkv_attention(qkv, 2)
    y.sum().backward()
    want = reference(qkv.detach(), 2)
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
    assert wide.grad[..., 1::2].abs().max() == 0


class Operators(TorchDispatchMode):
    """The names of the operators called inside, with the shape of the first tensor; and
    the casts among them (``_to_copy`` of a floating-point tensor: not a table of integers
    copied to the GPU)."""

    def __init__(self):
        super().__init__()
        self.calls, self.casts = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        shape = None if first is None else tuple(first.shape)
        self.calls.append((func.overloadpacket.__name__, shape))
        if func.overloadpacket.__name__ == "_to_copy" and first is not None:
            self.casts += first.is_floating_point()
        return func(*args, **(kwargs or {}))


def test_the_backward_neither_joins_nor_copies_the_qkv_gradient():
    """The GPT's backward on our layers: no stack or cat of dQ, dK, dV, and no copy of a
    (B, T, 3, H, D) gradient into the QKV product's layout (both ran before the fusion)."""
    config = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = gpt.GPT(config).to(DEVICE)
    idx = torch.randint(11, (2, 8), device=DEVICE)
    _, loss = model(idx, idx)
    operators = Operators()
    with operators:
        loss.backward()
    names = [name for name, _ in operators.calls]
    assert "stack" not in names and "cat" not in names
    assert not [c for c in operators.calls if c[0] == "clone" and c[1] == (2, 8, 3, 2, 8)]


def test_the_map_charges_each_operator_to_a_line_of_the_package(tmp_path):
    spec = importlib.util.spec_from_file_location("step_glue", ROOT / "lab" / "step_glue.py")
    step_glue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_glue)
    found = step_glue.main(["--layers", "1", "--width", "8", "--data", str(small_text.prepare(tmp_path))])
    casts = [where for (name, where, _) in found if name == "_to_copy"]
    # the weights and their gradients cast by cast_joined's kernel, no join nor cast of PyTorch
    # (on a GPU its tables of int32 and int64 rows are copied there: no cast)
    ours = [(name, shape) for (name, where, shape) in found if "cast_all" in where]
    assert not [(n, shape) for n, shape in ours if n == "cat" or (n == "_to_copy" and not shape.startswith("int"))]
    assert any("gpt.py" in where and "[backward: ToCopyBackward0" in where for where in casts)
    assert not any("(linear)" in where and "gpt.py" in where for where in casts), "no cast apiece"
    assert all(count > 0 for count in found.values())
    # clipping runs in FusedAdamW's kernels: none of clip_grad_norm_'s operators
    assert not [name for (name, _, _) in found if name in ("_foreach_norm", "_foreach_mul_")]


def test_cast_all_is_each_tensors_cast_and_its_backward_casts_back():
    torch.manual_seed(0)
    tensors = [torch.randn(shape, requires_grad=True) for shape in [(3, 5), (7,), (1, 1), (2, 3, 4)]]
    casts = gpt.cast_all(torch.bfloat16, *tensors)
    for t, cast in zip(tensors, casts, strict=True):
        assert cast.dtype == torch.bfloat16 and torch.equal(cast, t.detach().to(torch.bfloat16))
    weights = [torch.randn(c.shape, dtype=torch.bfloat16) for c in casts]
    # the third copy unused: no gradient for its tensor, as with .to()
    sum((c.float() * w.float()).sum() for i, (c, w) in enumerate(zip(casts, weights, strict=True)) if i != 2).backward()
    for i, (t, w) in enumerate(zip(tensors, weights, strict=True)):
        if i == 2:
            assert t.grad is None
        else:
            assert t.grad.dtype == torch.float32 and torch.equal(t.grad, w.float())


def step_of(model, idx, cast_at_once: bool, monkeypatch):
    """Loss, gradients and the operators of a forward and backward under bf16 autocast."""
    if not cast_at_once:  # each weight cast where a product uses it, as before the fusion
        monkeypatch.setattr(gpt.TritonLayers, "__init__", lambda self, model=None: setattr(self, "casts", {}))
    model.zero_grad(set_to_none=True)
    operators = Operators()
    with operators, torch.autocast(DEVICE.type, torch.bfloat16):
        _, loss = model(idx, idx)
        loss.backward()
    monkeypatch.undo()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, operators.casts


def test_weights_cast_at_once_give_the_same_step_in_fewer_casts(monkeypatch):
    """Under autocast our layers' products take bf16 weights: cast all at once (three
    operators forward, three backward) they give the step, loss and every gradient, that one
    cast per weight gives (two operators per weight)."""
    torch.manual_seed(0)
    config = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = gpt.GPT(config).to(DEVICE)
    idx = torch.randint(11, (2, 8), device=DEVICE)
    loss, grads, casts = step_of(model, idx, True, monkeypatch)
    want_loss, want_grads, want_casts = step_of(model, idx, False, monkeypatch)
    assert torch.equal(loss, want_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name
    weights = 1 + 4 * 2 * config.n_layer  # the output layer's, and each linear's w and b
    # (on a GPU cast_joined also copies its tables there: integers, not counted)
    assert want_casts - casts >= 2 * weights - 2


@pytest.mark.parametrize("x_dtype, residual_dtype", [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])
def test_add_layer_norm_writes_the_updates_gradient_in_its_dtype(x_dtype, residual_dtype):
    """The update's gradient (bf16 under autocast) comes from the backward kernel, rounded
    once as dx.to() would, with no cast after it; inputs of two dtypes both narrower than h
    (fp16 + bf16: h in fp32) get one from the kernel and one cast."""
    from stepkernels import add_layer_norm
    from test_add_layer_norm import check

    check((37, 96), x_dtype, residual_dtype)  # against fp64
    torch.manual_seed(0)
    x = torch.randn(37, 96, device=DEVICE, dtype=x_dtype, requires_grad=True)
    residual = torch.randn(37, 96, device=DEVICE, dtype=residual_dtype, requires_grad=True)
    h, y = add_layer_norm(x, residual, (96,))
    operators = Operators()
    with operators:
        torch.autograd.backward([h, y], [torch.ones_like(h), torch.randn_like(y)])
    casts = [c for c in operators.calls if c[0] == "_to_copy"]
    assert len(casts) == (0 if x_dtype == h.dtype else 1)
    if x_dtype == torch.float32:  # dx itself: the update's gradient is its rounding,
        rounded = x.grad.to(residual_dtype)  # bit for bit on a GPU; the interpreter
        ulp = 0 if ON_GPU else 2**-7  # truncates where a GPU rounds: one unit at most
        torch.testing.assert_close(residual.grad, rounded, rtol=ulp, atol=0)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_in_the_update_is_clip_grad_norm_then_adamw(max_norm):
    """FusedAdamW.clip_grad_norm then step: torch's clip_grad_norm_ then AdamW, over steps
    with new gradients at new addresses, a parameter without one, two groups."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (1,), (3, 2, 9), (1300,), (4,)]
    ours = [torch.nn.Parameter(torch.randn(s, device=DEVICE)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    groups = lambda ps: [dict(params=ps[::2], weight_decay=0.1), dict(params=ps[1::2], weight_decay=0.0)]
    fused = FusedAdamW(groups(ours), lr=1e-2, betas=(0.9, 0.99))
    reference = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=(0.9, 0.99))
    for _ in range(3):
        fused.zero_grad()
        reference.zero_grad()
        for p, q in zip(ours[:-1], theirs[:-1], strict=True):  # the last: no gradient
            p.grad = 3 * torch.randn(p.shape, device=DEVICE)
            q.grad = p.grad.clone()
        kept = [p.grad.clone() for p in ours[:-1]]
        norm = fused.clip_grad_norm(max_norm)
        want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
        fused.step()
        reference.step()
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, kept, strict=False)), "left as they are"
    fused.zero_grad()
    assert fused.clip_grad_norm(1.0).item() == 0.0  # no gradient at all


def test_a_clip_applies_to_the_next_step_only():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(10, device=DEVICE))
    q = torch.nn.Parameter(torch.zeros(10, device=DEVICE))
    fused = FusedAdamW([p], lr=1.0, betas=(0.0, 0.0), weight_decay=0.0)
    reference = FusedAdamW([q], lr=1.0, betas=(0.0, 0.0), weight_decay=0.0)
    for clip in (True, False):  # with beta 0, a step moves each element by lr * sign(g)
        p.grad = torch.full((10,), 1e-3, device=DEVICE)
        q.grad = p.grad.clone()
        if clip:
            fused.clip_grad_norm(1e-9)
        fused.step()
        reference.step()
    # Each unclipped step moves an element by -1; the clipped one, its g scaled to about
    # 3e-10 beside eps = 1e-8, by about -0.03: p moved once by a full step, q twice.
    assert (p - q).min() > 0.9 and p.max() < -0.99


@pytest.mark.parametrize(
    "max_norm, error", [(0.0, ValueError), (-1.0, ValueError), (True, TypeError), ("1", TypeError)]
)
def test_clip_refuses_a_bad_max_norm(max_norm, error):
    fused = FusedAdamW([torch.nn.Parameter(torch.zeros(3, device=DEVICE))])
    with pytest.raises(error, match="max_norm"):
        fused.clip_grad_norm(max_norm)
