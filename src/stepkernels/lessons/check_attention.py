"""The harness of chapter 11 (fused attention): the specification in plain torch, SDPA by
backend (the benchmark's peers), and one call that checks an attention function's output and
gradients against PyTorch's scaled_dot_product_attention computed in fp64. Hand-written; the
function it checks is the chapter's (in the notebook) or the package's, which is generated
from the chapter."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.attention import sdpa_kernel
import torch.nn.functional as F

# Largest error allowed, relative to the reference's largest value: P is rounded to the
# inputs' dtype before it meets V (and dS before it meets Q and K), as in every fused
# attention; fp32 products run in tf32 unless matmul precision is "highest".
TOLERANCE = {torch.float32: 4e-3, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def naive_attention(q, k, v, causal=False):
    """The specification in plain torch: the N x N scores in memory, softmax in fp32."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:  # query i sees keys j <= i
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def sdpa(backend=None):
    """SDPA called as ``attention(q, k, v, causal)``, held to one ``SDPBackend`` if given."""

    def call(q, k, v, causal=False):
        with sdpa_kernel(backend) if backend is not None else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return call


def inputs(batch, heads, n_q, n_kv, head_dim, dtype, device, layout="BHND", seed=0):
    """Random (batch, heads, sequence, head_dim) q, k, v; ``layout="BNHD"``: each a
    (batch, sequence, heads, head_dim) tensor viewed as that, as a fused projection gives."""
    generator = torch.Generator().manual_seed(seed)

    def make(n):
        if layout == "BNHD":
            t = torch.randn(batch, n, heads, head_dim, generator=generator).transpose(
                1, 2
            )
        else:
            t = torch.randn(batch, heads, n, head_dim, generator=generator)
        return t.to(device=device, dtype=dtype)

    return make(n_q), make(n_kv), make(n_kv)


def worst_relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference| (0 for empty tensors). A reference that is
    zero everywhere (dQ with a single key) counts as largest value 0.01, about a hundredth of
    what standard-normal inputs give."""
    if reference.numel() == 0:
        return 0.0
    scale = reference.abs().max().clamp_min(0.01)
    return ((ours.double() - reference).abs().max() / scale).item()


def check(attention, q, k, v, causal=False, sm_scale=None, tolerance=None):
    """``attention(q, k, v, causal, sm_scale)`` and its gradients (for a random dO) against
    SDPA in fp64. Returns the output and (dq, dk, dv)."""
    # detach keeps the strides
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal=causal, sm_scale=sm_scale)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*exact, is_causal=causal, scale=sm_scale)
    assert out.shape == want.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(q.device, q.dtype))
    wanted = torch.autograd.grad(want, exact, grad_out.to(want.device, torch.float64))
    tolerance = tolerance or TOLERANCE[q.dtype]
    names = ("out", "dq", "dk", "dv")
    for name, ours, reference in zip(
        names, (out, *grads), (want, *wanted), strict=True
    ):
        assert ours.shape == reference.shape, (name, ours.shape, reference.shape)
        error = worst_relative_error(ours, reference)
        assert error <= tolerance, (
            f"{name} is off by {error:.2e} of its largest value (allowed {tolerance:.0e}): "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, {q.dtype}, causal={causal}"
        )
    return out, grads
