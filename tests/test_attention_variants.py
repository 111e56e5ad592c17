"""Chapter 11's attention with grouped heads (GQA, MQA), sliding windows and packed
sequences (varlen_attention), against SDPA in fp64 (enable_gqa, a boolean mask, a loop over
the sequences: lessons/check_attention.py), through the public functions. Small shapes under
the interpreter, whose blocks are 16 x 16: lengths off the blocks, windows of one key, under,
at and over a block."""

import pytest
from stepkernels import attention, varlen_attention
from stepkernels.lessons import check_attention
from stepkernels.ops.attention import default_launches, padded_head_dim
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def grouped(batch, heads, kv_heads, n_q, n_kv, head_dim, dtype=torch.float32, layout="BHND", seed=0):
    """q with ``heads`` heads, k and v with ``kv_heads``."""
    q = check_attention.inputs(batch, heads, n_q, n_kv, head_dim, dtype, DEVICE, layout, seed)[0]
    _, k, v = check_attention.inputs(batch, kv_heads, n_q, n_kv, head_dim, dtype, DEVICE, layout, seed + 1)
    return q, k, v


def packed(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """(total, heads, head_dim) q, k, v and the keyword arguments of varlen_attention."""
    generator = torch.Generator().manual_seed(seed)
    make = lambda n, h: torch.randn(n, h, head_dim, generator=generator).to(DEVICE, dtype)
    starts = lambda lengths: torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    options = dict(
        cu_seqlens_q=starts(lengths_q).to(DEVICE),
        cu_seqlens_k=starts(lengths_k).to(DEVICE),
        max_seqlen_q=max(lengths_q),
        max_seqlen_k=max(lengths_k),
    )
    return (make(sum(lengths_q), heads), make(sum(lengths_k), kv_heads), make(sum(lengths_k), kv_heads)), options


@pytest.mark.parametrize(
    "heads, kv_heads, n_q, n_kv, head_dim, causal",
    [
        (4, 2, 33, 33, 16, False),
        (4, 2, 33, 33, 32, True),
        (4, 1, 17, 40, 32, True),  # MQA: one kv head
        (8, 2, 35, 21, 64, False),
        (3, 3, 1, 1, 16, True),  # group of 1, a single row
    ],
)
def test_grouped_heads_match_sdpa(heads, kv_heads, n_q, n_kv, head_dim, causal):
    check_attention.check(attention, *grouped(1, heads, kv_heads, n_q, n_kv, head_dim), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_grouped_heads_interleaved_16_bit(dtype):
    # (B, N, H, D) viewed as (B, H, N, D), as a fused QKV projection gives, in place
    check_attention.check(attention, *grouped(1, 4, 2, 37, 37, 32, dtype, "BNHD"), causal=True)


@pytest.mark.parametrize(
    "heads, kv_heads, n_q, n_kv, head_dim, window",
    [
        (2, 2, 40, 40, 16, 1),  # each query its own key
        (2, 1, 45, 45, 16, 5),  # under a block
        (4, 2, 48, 48, 32, 16),  # a block
        (4, 4, 50, 50, 64, 23),  # over a block, lengths off the blocks
        (2, 1, 30, 30, 16, 100),  # longer than the sequence: causal attention
        (2, 2, 20, 44, 16, 7),  # more keys than queries
        (4, 2, 45, 12, 16, 3),  # more queries: rows from 14 on see no key (0, as SDPA)
    ],
)
def test_window_matches_masked_sdpa(heads, kv_heads, n_q, n_kv, head_dim, window):
    q, k, v = grouped(1, heads, kv_heads, n_q, n_kv, head_dim)
    check_attention.check(attention, q, k, v, causal=True, window=window)


def test_window_equals_causal_attention_when_it_covers_the_sequence():
    q, k, v = grouped(1, 2, 1, 33, 33, 16)
    torch.testing.assert_close(attention(q, k, v, causal=True, window=33), attention(q, k, v, causal=True))


def test_blocks_outside_the_window_are_not_read():
    """NaN in the blocks no query of a block sees: visited and masked, 0 x NaN would spread
    it (p = 0 meets V = NaN; dS = 0 meets Q = NaN); skipped, it stays out. With B the
    largest block of the launches (16 under the interpreter, 64 on a GPU) and 4 B rows, a
    window of 4: the queries of [2B, 4B) start past key block [0, B), and the keys of
    [0, B) end before query block [2B, 4B) (before 2B in any block size up to B)."""
    launches = default_launches(padded_head_dim(16), 4, True)  # fp32
    B = max(max(launch.block_m, launch.block_n) for launch in launches)
    q, k, v = (t.requires_grad_() for t in grouped(1, 2, 1, 4 * B, 4 * B, 16))
    poisoned_v = v.detach().clone()
    poisoned_v[:, :, :B] = float("nan")
    out = attention(q, k, poisoned_v, causal=True, window=4)
    want = check_attention.reference(q, k, v, causal=True, window=4).detach()
    torch.testing.assert_close(out[:, :, 2 * B :], want[:, :, 2 * B :], rtol=1e-4, atol=1e-5)
    poisoned_q = q.detach().clone()
    poisoned_q[:, :, 3 * B :] = float("nan")
    poisoned_q.requires_grad_()
    seen = slice(0, 2 * B)
    dk, dv = torch.autograd.grad(attention(poisoned_q, k, v, causal=True, window=4)[:, :, seen].sum(), (k, v))
    reference = check_attention.reference(q, k, v, causal=True, window=4)
    want = torch.autograd.grad(reference[:, :, seen].sum(), (k, v))
    torch.testing.assert_close(dk[:, :, :B], want[0][:, :, :B], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv[:, :, :B], want[1][:, :, :B], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "lengths_q, lengths_k, heads, kv_heads, head_dim, causal, window",
    [
        ([5, 17, 1], [5, 17, 1], 2, 2, 16, False, None),  # a sequence of one row
        ([20, 3, 33], [20, 3, 33], 4, 2, 32, True, None),
        ([30, 0, 18], [30, 4, 18], 4, 1, 16, True, 7),  # a sequence without queries
        ([7, 40], [12, 9], 2, 1, 16, True, None),  # queries and keys of other lengths
        ([40, 21], [40, 21], 2, 2, 64, True, 1),
        ([16, 32], [16, 32], 2, 1, 16, False, None),  # lengths on the blocks
    ],
)
def test_packed_sequences_match_sdpa_sequence_by_sequence(
    lengths_q, lengths_k, heads, kv_heads, head_dim, causal, window
):
    (q, k, v), options = packed(lengths_q, lengths_k, heads, kv_heads, head_dim)
    out, _ = check_attention.check(varlen_attention, q, k, v, causal=causal, window=window, **options)
    assert out.shape == q.shape


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_packed_sequences_16_bit(dtype):
    (q, k, v), options = packed([9, 25], [9, 25], 4, 2, 32, dtype)
    check_attention.check(varlen_attention, q, k, v, causal=True, **options)


def test_packed_sequences_do_not_see_each_other():
    # the second sequence's keys changed: the first's output and gradients stay
    (q, k, v), options = packed([20, 20], [20, 20], 2, 1, 16)
    first = varlen_attention(q, k, v, **options)[:20]
    k2 = k.clone()
    k2[20:] *= 3
    torch.testing.assert_close(varlen_attention(q, k2, v, **options)[:20], first, rtol=0, atol=0)


def test_packed_sequences_no_grad_and_empty():
    (q, k, v), options = packed([9, 4], [9, 4], 2, 2, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            varlen_attention(q, k, v, **options),
            check_attention.packed_reference(q, k, v, options["cu_seqlens_q"], options["cu_seqlens_k"]),
            rtol=1e-4,
            atol=1e-5,
        )
    empty = torch.zeros(0, 2, 16, device=DEVICE, requires_grad=True)
    starts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = varlen_attention(empty, empty, empty, starts, starts, 0, 0)
    assert out.shape == (0, 2, 16)


def test_compiled_matches_eager():
    q, k, v = (t.requires_grad_() for t in grouped(1, 4, 2, 24, 24, 16))
    window = 5
    call = lambda q, k, v: attention(q, k, v, causal=True, window=window)
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v), call(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    wanted = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(grads, wanted, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_packed_compiled_matches_eager():
    (q, k, v), options = packed([9, 20], [9, 20], 4, 2, 16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    call = lambda q, k, v: varlen_attention(q, k, v, causal=True, **options)
    got = torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, call(q, k, v), rtol=0, atol=0)
    torch.autograd.grad(got.sum(), (q, k, v))


def test_operator_schema_and_fake():
    ops = torch.ops.stepkernels
    q, k, v = grouped(1, 4, 2, 20, 20, 16)
    torch.library.opcheck(ops.attention.default, (q, k, v, True, 0.25, 3))
    (q, k, v), options = packed([9, 20], [9, 20], 4, 2, 16)
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)]
    torch.library.opcheck(ops.attention.default, (*views, True, 0.25, None, *options.values()))


@pytest.mark.skipif(not ON_GPU, reason="full sizes: on the GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1, 100, 1000])
def test_full_size_grouped_and_windowed(dtype, window):
    q, k, v = grouped(2, 8, 2, 1500, 1500, 128, dtype)
    check_attention.check(attention, q, k, v, causal=True, window=window)
    check_attention.check(attention, *grouped(2, 8, 1, 1000, 700, 64, dtype), causal=False)


@pytest.mark.skipif(not ON_GPU, reason="full sizes and races: on the GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 256)])
def test_full_size_packed_and_repeatable(dtype, causal, window):
    lengths = [1, 700, 2049, 64, 333, 1000]
    (q, k, v), options = packed(lengths, lengths, 16, 4, 128, dtype)
    _, grads = check_attention.check(varlen_attention, q, k, v, causal=causal, window=window, **options)
    again = check_attention.check(varlen_attention, q, k, v, causal=causal, window=window, **options)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True)), "not bitwise repeatable"
