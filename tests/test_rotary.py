"""rotary_embedding and rotary_embedding_qk against an fp64 reference (Hugging Face's Llama:
x * cos + rotate_half(x) * sin), through the public API."""

from conftest import random_tensor
import pytest
from stepkernels import rotary_embedding, rotary_embedding_qk
from stepkernels.lessons.check_modern_block import check
from stepkernels.ops import rotary as rotary_module
from stepkernels.ops.rotary import rotary_op
from stepkernels.runtime.core import DEVICE, FLOAT_DTYPES, ON_GPU
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def reference(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def reference_qk(q, k, cos, sin):
    return reference(q, cos, sin), reference(k, cos, sin)


def tables(positions, dim, dtype, base=10000.0):
    """RoPE's cos and sin, (positions, dim), the angles repeated over the two halves."""
    inverse = base ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inverse
    angles = torch.cat([angles, angles], dim=-1).to(DEVICE)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def leaf(t):
    return t.requires_grad_()


def case(batch, q_heads, k_heads, positions, dim, layout="bhnd", table_dtype=None, random_tables=False):
    """A maker of (q, k, cos, sin). layout: "bhnd" contiguous; "bnhd" (batch, positions, heads,
    dim) transposed to (B, H, N, D); "qkv" views of one fused projection (B, N, 3, H, D)."""

    def make(r, dtype):
        if layout == "qkv":
            qkv = leaf(r(batch, positions, 3 * q_heads * dim))
            q, k, _ = qkv.view(batch, positions, 3, q_heads, dim).permute(2, 0, 3, 1, 4)
        elif layout == "bnhd":
            q = leaf(r(batch, positions, q_heads, dim)).transpose(1, 2)
            k = leaf(r(batch, positions, k_heads, dim)).transpose(1, 2)
        else:
            q, k = leaf(r(batch, q_heads, positions, dim)), leaf(r(batch, k_heads, positions, dim))
        if random_tables:  # halves that differ: the backward must be the transposed map
            cos, sin = r(positions, dim, dtype=table_dtype or dtype), r(positions, dim, dtype=table_dtype or dtype)
        else:
            cos, sin = tables(positions, dim, table_dtype or dtype)
        return q, k, cos, sin

    return make


CASES = {
    "one position": case(1, 1, 1, 1, 2),
    "odd sizes, grouped heads": case(2, 3, 1, 37, 64),
    "head_dim 6": case(1, 2, 2, 5, 6),
    "head_dim 80": case(1, 2, 1, 7, 80),
    "views of qkv": case(2, 4, 4, 13, 32, layout="qkv"),
    "(B, N, H, D) transposed": case(2, 3, 2, 11, 16, layout="bnhd"),
    "fp32 tables": case(1, 4, 2, 9, 16, table_dtype=torch.float32),
    "random tables": case(2, 2, 1, 6, 12, random_tables=True),
    "no positions": case(1, 2, 2, 0, 8),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_qk_matches_fp64_reference_forward_and_backward(name, dtype):
    check("rotary_embedding_qk", rotary_embedding_qk, reference_qk, {name: CASES[name]}, dtypes=(dtype,))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", ["odd sizes, grouped heads", "views of qkv", "random tables"])
def test_one_tensor_matches_fp64_reference(name, dtype):
    def make(r, d):
        q, _, cos, sin = CASES[name](r, d)
        return q, cos, sin

    check("rotary_embedding", rotary_embedding, reference, {name: make}, dtypes=(dtype,))


def test_qk_in_one_launch_is_two_single_calls_bit_for_bit():
    q, k, cos, sin = case(2, 4, 2, 19, 32, layout="bnhd")(
        lambda *s, dtype=torch.float16: random_tensor(s, dtype), torch.float16
    )
    q_out, k_out = rotary_embedding_qk(q, k, cos, sin)
    assert torch.equal(q_out, rotary_embedding(q, cos, sin))
    assert torch.equal(k_out, rotary_embedding(k, cos, sin))
    assert q_out.is_contiguous() and q_out.shape == q.shape and k_out.shape == k.shape


def test_backward_is_the_rotation_by_minus_sin():
    """With RoPE's tables (equal halves) dx = rotary_embedding(dy, cos, -sin)."""
    x = random_tensor((2, 3, 10, 16)).requires_grad_()
    dy = random_tensor((2, 3, 10, 16), seed=1)
    cos, sin = tables(10, 16, torch.float32)
    (dx,) = torch.autograd.grad(rotary_embedding(x, cos, sin), x, dy)
    torch.testing.assert_close(dx, rotary_embedding(dy, cos, -sin), rtol=1e-6, atol=1e-6)


def test_tables_that_need_a_gradient_are_refused():
    x = random_tensor((1, 2, 4, 8))
    cos, sin = tables(4, 8, torch.float32)
    with pytest.raises(RuntimeError, match="cos and sin"):
        rotary_embedding(x, cos.requires_grad_(), sin)
    with torch.no_grad():  # nothing recorded: nothing dropped
        rotary_embedding(x, cos, sin)


def test_double_backward_is_refused():
    x = random_tensor((1, 2, 4, 8)).requires_grad_()
    cos, sin = tables(4, 8, torch.float32)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(rotary_embedding(x, cos, sin).square().sum(), x, create_graph=True)


def test_the_operator_and_its_autograd_match_the_eager_path():
    q = random_tensor((2, 4, 9, 16)).requires_grad_()
    k = random_tensor((2, 2, 9, 16), seed=1).requires_grad_()
    cos, sin = tables(9, 16, torch.float32)
    dq, dk = random_tensor(q.shape, seed=2), random_tensor(k.shape, seed=3)
    got, want = rotary_op(q, k, cos, sin, False), rotary_embedding_qk(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    grads_got = torch.autograd.grad(got, (q, k), (dq, dk))
    grads_want = torch.autograd.grad(want, (q, k), (dq, dk))
    assert all(torch.equal(a, b) for a, b in zip(grads_got, grads_want, strict=True))


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of Triton kernels needs a GPU")
def test_compiled_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(rotary_embedding_qk, fullgraph=True)
    q, k, cos, sin = case(2, 8, 2, 128, 64, layout="qkv")(
        lambda *s, dtype=torch.bfloat16: random_tensor(s, dtype), torch.bfloat16
    )
    got, want = compiled(q, k, cos, sin), rotary_embedding_qk(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.skipif(not ON_GPU, reason="full sizes: on a GPU")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_full_size_on_the_gpu(dtype):
    cases = {"Llama 3 8B, 4096 positions, views of qkv": case(2, 32, 32, 4096, 128, layout="qkv")}
    check("rotary_embedding_qk", rotary_embedding_qk, reference_qk, cases, dtypes=(dtype,))


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("q_elements", [2**24, 2**27])
def test_launch_table_holds_every_size(itemsize, q_elements):
    """Chapter 14's shapes (q of 32 heads, k of 8, head_dim 128) find their entry of the table
    that lab/modern_sweep.py fills; the grid covers every position and head."""
    positions = q_elements // (32 * 128)
    grid, heads_per_program, meta = rotary_module.rotary_launch(1, 40, positions, 64, itemsize)
    assert grid[0] * meta["BLOCK_POSITIONS"] >= positions and grid[1] * heads_per_program >= 40
    assert meta["BLOCK_HALF"] == 64 and meta["NUM_STAGES"] >= 1


def test_launch_is_read_from_the_table():
    """An entry changed (as the sweep changes them) changes the launch."""
    kept = dict(rotary_module.ROTARY_LAUNCH)
    try:
        rotary_module.ROTARY_LAUNCH[2, "large"] = dict(tile=8192, programs_per_sm=4, warps=8, stages=2)
        _, _, meta = rotary_module.rotary_launch(1, 40, 2**27 // (32 * 128), 64, 2)
        assert (meta["BLOCK_POSITIONS"], meta["num_warps"], meta["NUM_STAGES"]) == (64, 8, 2)
    finally:
        rotary_module.ROTARY_LAUNCH.update(kept)


def test_head_dim_zero_rotates_nothing():
    """An even head_dim of 0 is nothing to rotate (the launch divided by it before)."""
    q = torch.randn(1, 2, 3, 0, device=DEVICE)
    cos = torch.randn(3, 0, device=DEVICE)
    assert rotary_embedding(q, cos, cos).shape == (1, 2, 3, 0)
