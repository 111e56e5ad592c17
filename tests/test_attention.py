"""stepkernels.attention against torch's scaled_dot_product_attention in fp64, through the
public function only: odd lengths, head dims, causal and not, dtypes, strided layouts."""

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
from stepkernels import attention
from stepkernels.lessons import check_attention
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def inputs(batch, heads, n_q, n_kv, head_dim, dtype=torch.float32, layout="BHND", seed=0):
    return check_attention.inputs(batch, heads, n_q, n_kv, head_dim, dtype, DEVICE, layout, seed)


def check(q, k, v, causal=False, sm_scale=None):
    return check_attention.check(attention, q, k, v, causal=causal, sm_scale=sm_scale)


# Many blocks with a ragged end: 130 rows are 2 of the GPU's 64-row blocks and 2 rows;
# under the interpreter's 16-row blocks, 50 rows are 3 and 2 rows (130 took most of this
# file's CPU time there).
MANY = 130 if ON_GPU else 50


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("n", [1, 17, MANY])
def test_matches_sdpa(n, head_dim, causal):
    check(*inputs(2, 3, n, n, head_dim), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes(dtype, causal):
    check(*inputs(1, 2, 40, 40, 64, dtype), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q, n_kv", [(5, 40), (40, 5), (33, 50), (50, 33)])
def test_queries_and_keys_of_different_lengths(n_q, n_kv, causal):
    # causal as SDPA's is_causal: query i sees keys j <= i, whatever the lengths
    check(*inputs(2, 2, n_q, n_kv, 32), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_heads_interleaved_layout(dtype):
    # (B, N, H, D) viewed as (B, H, N, D), as a fused QKV projection gives: read in place
    q, k, v = inputs(2, 3, 37, 37, 64, dtype, layout="BNHD")
    check(q, k, v, causal=True)
    out = attention(q, k, v, causal=True)  # written in q's layout: (B, N, H·D) is a view
    assert out.stride() == q.stride() and out.transpose(1, 2).reshape(2, 37, 192)._base is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 7, 20, 24])
def test_head_dims_a_descriptor_cannot_describe(head_dim, dtype):
    # rows of D values not a multiple of 16 bytes: copied into a padded layout first
    check(*inputs(1, 2, 19, 23, head_dim, dtype), causal=True)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 1), (torch.bfloat16, 4)])
def test_repeated_calls_of_a_layout_a_descriptor_cannot_describe(dtype, head_dim):
    # q, k, v split from one packed projection, heads 4 or 8 bytes apart: each call copies them
    # (a repeated call took its bound launch on the GPU and described them as they were)
    for seed in range(3):
        qkv = torch.randn(2, 16, 3 * 2 * head_dim, dtype=dtype, device=DEVICE)
        q, k, v = (t.unflatten(-1, (2, head_dim)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        check(q, k, v, causal=seed % 2 == 1)
        check(q, k, v, causal=seed % 2 == 1)


def test_last_dimension_not_contiguous():
    q, k, v = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in inputs(1, 2, 24, 24, 32))
    assert q.stride(3) != 1
    check(q, k, v)


@pytest.mark.parametrize("sm_scale", [1e-45, 0.01, 0.5, 2.0])
def test_sm_scale(sm_scale):
    check(*inputs(1, 2, 33, 33, 64), causal=True, sm_scale=sm_scale)


def test_large_scores_stay_finite():
    q, k, v = inputs(1, 1, 40, 40, 64)
    out, grads = check(q * 30, k * 30, v)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_rows_of_very_negative_scores_have_finite_gradients(causal):
    """Every score of a row far below zero: L < -128 in base 2, where exp2(0 - L) of a key
    past n_kv (read as zeros) overflows; unmasked, inf x 0 made dQ NaN."""
    n_q, n_kv = (13, 5) if causal else (3, 5)  # causal: more queries than keys, unmasked before
    q = torch.full((1, 1, n_q, 8), -40.0, device=DEVICE, requires_grad=True)
    k = torch.ones(1, 1, n_kv, 8, device=DEVICE, requires_grad=True)
    v = check_attention.inputs(1, 1, 1, n_kv, 8, torch.float32, DEVICE)[2].requires_grad_()
    dq, dk, dv = torch.autograd.grad(attention(q, k, v, causal=causal).sum(), (q, k, v))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*exact, is_causal=causal)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(expected.sum(), exact), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    n_q=st.integers(1, 48),
    n_kv=st.integers(1, 48),
    head_dim=st.integers(1, 72),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(n_q, n_kv, head_dim, causal, seed):
    check(*inputs(1, 2, n_q, n_kv, head_dim, seed=seed), causal=causal)


def test_no_grad_and_partial_grad():
    q, k, v = inputs(1, 2, 20, 20, 32)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, causal=True), want, rtol=1e-4, atol=1e-4)
    v.requires_grad_()
    out = attention(q, k, v, causal=True)
    (dv,) = torch.autograd.grad(out.sum(), v)
    want_dv = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), v)[0]
    torch.testing.assert_close(dv, want_dv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(2, 3, 0, 16), (0, 3, 8, 16)])
def test_empty(shape):
    q, k, v = (torch.zeros(shape, device=DEVICE, requires_grad=True) for _ in range(3))
    out = attention(q, k, v)
    assert out.shape == shape
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    assert all(g is None or (g == 0).all() for g in grads)


def test_second_derivative_refused():
    q, k, v = (t.requires_grad_() for t in inputs(1, 1, 8, 8, 16))
    out = attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=False)
    assert dq.shape == q.shape
    out = attention(q, k, v)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def zeros(*shape, dtype=torch.float16):
    return torch.zeros(*shape, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: attention(zeros(2, 8, 16), zeros(2, 8, 16), zeros(2, 8, 16)), "batch, heads, sequence"),
        (lambda: attention(zeros(1, 2, 8, 64), zeros(1, 2, 8, 32), zeros(1, 2, 8, 32)), "same batch"),
        (lambda: attention(zeros(1, 2, 8, 64), zeros(1, 4, 8, 64), zeros(1, 4, 8, 64)), "multiple of k"),
        (lambda: attention(zeros(1, 2, 8, 64), zeros(1, 2, 9, 64), zeros(1, 2, 8, 64)), "one shape"),
        (lambda: attention(*[zeros(1, 2, 8, 256)] * 3), "head_dim must be 1 to 128"),
        (lambda: attention(zeros(1, 2, 8, 64), *[zeros(1, 2, 8, 64, dtype=torch.bfloat16)] * 2), "share a dtype"),
        (lambda: attention(*[zeros(1, 2, 8, 64, dtype=torch.int8)] * 3), "supported"),
        (lambda: attention(zeros(1, 2, 8, 64), *[zeros(1, 2, 0, 64)] * 2), "at least one key"),
        (lambda: attention(*[zeros(1, 2, 8, 64)] * 3, sm_scale=-1.0), ">= 1e-45"),
        (lambda: attention(*[zeros(1, 2, 8, 64)] * 3, sm_scale=1e-50), ">= 1e-45"),
        (lambda: attention(*[zeros(1, 2, 8, 64)] * 3, sm_scale=float("inf")), "finite"),
        (lambda: attention(*[zeros(1, 2, 8, 64)] * 3, sm_scale="0.5"), "number"),
        (lambda: attention(*[zeros(1, 2, 8, 64)] * 3, sm_scale=True), "number"),
        (lambda: attention(*[zeros(1, 2, 8, 64)] * 3, causal="no"), "True or False"),
        (lambda: attention([[0.0]], *[zeros(1, 2, 8, 64)] * 2), "torch.Tensor"),
    ],
)
def test_bad_input_is_refused(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


@pytest.mark.skipif(not ON_GPU, reason="many blocks: on the GPU (the interpreter is slow)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_many_blocks_in_every_dtype(dtype, causal):
    # Chapter 11's largest check, which its quick GPU run leaves to this test.
    check(*inputs(2, 3, 1000, 1000, 80, dtype), causal=causal)


@pytest.mark.skipif(not ON_GPU, reason="full sizes and races: on the GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_full_size_and_repeatable(head_dim, causal):
    q, k, v = inputs(2, 4, 2049, 2049, head_dim, torch.bfloat16)
    out, grads = check(q, k, v, causal=causal)
    again = check(q, k, v, causal=causal)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True)), "not bitwise repeatable"
