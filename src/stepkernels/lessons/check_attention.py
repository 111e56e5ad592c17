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


def sdpa(backend=None, **options):
    """SDPA called as ``attention(q, k, v, causal)``, held to one ``SDPBackend`` if given;
    ``options`` (``enable_gqa=True``, say) passed on."""

    def call(q, k, v, causal=False):
        with sdpa_kernel(backend) if backend is not None else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **options)

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


def reference(q, k, v, causal=False, sm_scale=None, window=None):
    """SDPA (k and v may have fewer heads than q); ``window``: query i sees keys
    i - window < j <= i, a boolean mask."""
    if window is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=True
        )
    rows = torch.arange(q.shape[-2], device=q.device)[:, None]
    columns = torch.arange(k.shape[-2], device=q.device)[None, :]
    mask = (columns <= rows) & (columns > rows - window)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True
    )


def packed_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """``reference`` of each packed sequence in turn: (total, heads, head_dim) tensors,
    sequence s at rows [cu_seqlens[s], cu_seqlens[s + 1])."""
    heads = lambda t, a, b: t[a:b].transpose(0, 1)[None]  # (1, H, n, D)
    outs = []
    for s in range(len(cu_seqlens_q) - 1):
        (a, b), (c, d) = (
            cu_seqlens_q[s : s + 2].tolist(),
            cu_seqlens_k[s : s + 2].tolist(),
        )
        if b == a:  # no queries
            outs.append(q[a:b] + 0 * (k[c:d].sum() + v[c:d].sum()))
            continue
        out = reference(heads(q, a, b), heads(k, c, d), heads(v, c, d), **options)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def check(
    attention,
    q,
    k,
    v,
    causal=False,
    sm_scale=None,
    tolerance=None,
    window=None,
    **packed,
):
    """``attention(q, k, v, causal, sm_scale)`` and its gradients (for a random dO) against
    SDPA in fp64 (``reference``; ``window`` passed on when given). ``packed``: the
    cumulative lengths and longest sequences for ``varlen_attention``, checked against
    ``packed_reference``. Returns the output and (dq, dk, dv)."""
    # detach keeps the strides
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    options = dict(causal=causal, sm_scale=sm_scale)
    options |= {} if window is None else dict(window=window)
    out = attention(q, k, v, **packed, **options)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if packed:
        starts = (packed["cu_seqlens_q"], packed["cu_seqlens_k"])
        want = packed_reference(*exact, *starts, **options)
    else:
        want = reference(*exact, **options)
    assert out.shape == want.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(q.device, q.dtype))
    wanted = torch.autograd.grad(want, exact, grad_out.to(want.device, torch.float64))
    tolerance = tolerance or TOLERANCE[q.dtype]
    names = ("out", "dq", "dk", "dv")
    for name, ours, expected in zip(names, (out, *grads), (want, *wanted), strict=True):
        assert ours.shape == expected.shape, (name, ours.shape, expected.shape)
        error = worst_relative_error(ours, expected)
        assert error <= tolerance, (
            f"{name} is off by {error:.2e} of its largest value (allowed {tolerance:.0e}): "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, {q.dtype}, causal={causal}, "
            f"window={window}"
        )
    return out, grads
