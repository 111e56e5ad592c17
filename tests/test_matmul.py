"""stepkernels.matmul: shapes, layouts, dtypes, the fused epilogue, fp32 precision, refusals.

Through ``matmul`` (the dispatcher) and ``matmul_portable`` (the portable kernel, with a small
fixed ``config`` so that small shapes span several tiles, groups and K-steps without
autotuning). The descriptor kernel (chapter 07) runs where it can: on Hopper and under the
interpreter. bf16 only on a GPU: the interpreter's bf16 ``tl.dot`` returns garbage.
"""

from contextlib import contextmanager
import importlib

from conftest import random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
from stepkernels import matmul
from stepkernels.lessons import check_matmul
from stepkernels.lessons.check_matmul import matmul_reference, tolerance
from stepkernels.ops import matmul_tuning
from stepkernels.ops.matmul import ON_HOPPER, matmul_portable
from stepkernels.ops.matmul_hopper import TMA_CONFIGS, launch_tma, matmul_tma, row_major, sm_count, tma_operands
from stepkernels.ops.matmul_tuning import keep_tma_configs, programs, splits_k, tail_shares
from stepkernels.runtime.activations import ACTIVATIONS
from stepkernels.runtime.core import DEVICE, INTERPRET, ON_GPU, zeroed
from stepkernels.runtime.tiles import FP8_DTYPES
import torch

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])
HAS_FP8 = bool(FP8_DTYPES)  # the device profile's (STEPKERNELS_DEVICE_PROFILE=sm80: none)
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4, "num_stages": 2}


def portable_small_tiles(*args, **kwargs):
    return matmul_portable(*args, config=SMALL, **kwargs)


def tma_small_tiles(*args, **kwargs):
    return matmul_tma(*args, config=SMALL, **kwargs)


KERNELS = {"matmul": matmul, "portable (16x16x16 tiles)": portable_small_tiles}
if ON_HOPPER or INTERPRET:
    KERNELS["descriptor (16x16x16 tiles)"] = tma_small_tiles


@contextmanager
def fp32_precision(precision):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def operands(M, N, K, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=generator).to(DEVICE, dtype)
    b = torch.randn(K, N, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(N, generator=generator).to(DEVICE)
    return a, b, bias


def assert_matches(kernel, a, b, activation=None, bias=None):
    out, pre = kernel(a, b, activation, bias=bias, return_preactivation=True)
    expected, expected_pre = matmul_reference(a, b, activation, bias)
    tol = tolerance(out.dtype, a.shape[1])
    assert out.shape == expected.shape and out.is_contiguous() and pre.shape == out.shape
    torch.testing.assert_close(out.double(), expected, **tol)
    torch.testing.assert_close(pre.double(), expected_pre, **tol)


def descriptor_can_take(kernel_name, a, b):
    from stepkernels.ops.matmul_hopper import tma_operands

    return "descriptor" not in kernel_name or tma_operands(a, b) is not None


SHAPES = [
    (1, 1, 1),
    (1, 40, 24),  # M = 1
    (40, 1, 24),  # N = 1
    (24, 40, 1),  # K = 1
    (19, 23, 7),  # odd, smaller than a tile
    (37, 56, 33),  # no multiple of any block, odd K
    (64, 48, 32),  # exact multiples of the small tiles
    (130, 72, 100),  # past one 128-row tile
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_shapes_and_dtypes_with_bias_and_preactivation(kernel_name, dtype, shape):
    a, b, bias = operands(*shape, dtype)
    activation = ACTIVATIONS[sum(shape) % len(ACTIVATIONS)]
    if descriptor_can_take(kernel_name, a, b):
        assert_matches(KERNELS[kernel_name], a, b, activation, bias)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_every_activation_with_and_without_bias(kernel_name, activation):
    a, b, bias = operands(45, 48, 40, torch.float16)
    assert_matches(KERNELS[kernel_name], a, b, activation, bias)
    assert_matches(KERNELS[kernel_name], a, b, activation)


LAYOUTS = {
    "a.t()": lambda a, b: (a.t().contiguous().t(), b),
    "b.t()": lambda a, b: (a, b.t().contiguous().t()),
    "both .t()": lambda a, b: (a.t().contiguous().t(), b.t().contiguous().t()),
    "row-strided slices": lambda a, b: (
        torch.cat([a, a], dim=1)[:, : a.shape[1]],
        torch.cat([b, b], dim=1)[:, : b.shape[1]],
    ),
    "every other row": lambda a, b: (
        torch.repeat_interleave(a, 2, dim=0)[::2],
        torch.repeat_interleave(b, 2, dim=0)[::2],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_strided_inputs_are_read_in_place(kernel_name, dtype, layout):
    a, b, bias = operands(40, 56, 24, dtype)
    a_view, b_view = LAYOUTS[layout](a, b)
    assert torch.equal(a_view, a) and torch.equal(b_view, b)
    if descriptor_can_take(kernel_name, a_view, b_view):
        assert_matches(KERNELS[kernel_name], a_view, b_view, "gelu", bias)


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
def test_bias_of_another_dtype_and_stride(bias_dtype):
    a, b, _ = operands(20, 24, 16, torch.float32)
    bias = torch.randn(48, device=DEVICE).to(bias_dtype)[::2]
    assert_matches(matmul, a, b, "relu", bias)


def test_linear_layer_with_a_transposed_weight():
    x, _, bias = operands(33, 40, 24, torch.float32)
    weight = torch.randn(40, 24, device=DEVICE)
    out = matmul(x, weight.t(), "relu", bias=bias)
    expected = torch.relu(torch.nn.functional.linear(x.double(), weight.double(), bias.double()))
    torch.testing.assert_close(out.double(), expected, **tolerance(torch.float32, 24))


def test_return_preactivation_returns_a_pair_only_when_asked():
    a, b, bias = operands(9, 8, 7, torch.float32)
    out = matmul(a, b, "relu", bias=bias)
    assert isinstance(out, torch.Tensor)
    pair = matmul(a, b, "relu", bias=bias, return_preactivation=True)
    assert isinstance(pair, tuple) and torch.equal(pair[0], out)
    torch.testing.assert_close(pair[1].double(), matmul_reference(a, b, None, bias)[0], **tolerance(a.dtype, 7))


@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (0, 0, 3)], ids=str)
@pytest.mark.parametrize("function", [matmul, matmul_portable])
def test_empty_outputs(function, shape):
    M, N, K = shape
    a, b = torch.randn(M, K, device=DEVICE), torch.randn(K, N, device=DEVICE)
    out, pre = function(a, b, "gelu", bias=torch.randn(N, device=DEVICE), return_preactivation=True)
    assert out.shape == pre.shape == (M, N)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("function", [matmul, matmul_portable])
def test_k_zero_gives_the_activation_of_the_bias(function, activation):
    a, b = torch.randn(6, 0, device=DEVICE), torch.randn(0, 5, device=DEVICE)
    bias = torch.randn(5, device=DEVICE)
    out, pre = function(a, b, activation, bias=bias, return_preactivation=True)
    expected, expected_pre = matmul_reference(a, b, activation, bias)
    torch.testing.assert_close(pre.double(), expected_pre)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(function(a, b), torch.zeros(6, 5, device=DEVICE))  # as torch: zeros


def test_fp32_is_exact_under_highest_precision():
    # Before fp32 followed torch's setting, a GPU always multiplied fp32 as tf32 (2^-11 per
    # input): these products, with a tolerance of 1e-5, failed there.
    a, b, bias = operands(96, 80, 512, torch.float32)
    with fp32_precision("highest"):
        for out in (matmul(a, b, bias=bias), portable_small_tiles(a, b, bias=bias)):
            expected = matmul_reference(a, b, None, bias)[0]
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * 512**0.5)


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_fp32_within_tf32_tolerance_under_high_precision(precision):
    a, b, bias = operands(96, 80, 512, torch.float32)
    before = torch.get_float32_matmul_precision()
    with fp32_precision(precision):
        out = matmul(a.t().contiguous().t(), b.t().contiguous().t(), "gelu", bias=bias)
    assert torch.get_float32_matmul_precision() == before
    expected = matmul_reference(a, b, "gelu", bias)[0]
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=2**-8 * 512**0.5)


@pytest.mark.skipif(not ON_GPU, reason="bf16 dot is garbage under the interpreter")
def test_bf16_on_the_gpu():
    a, b, bias = operands(130, 136, 200, torch.bfloat16)
    assert_matches(matmul, a, b, "squared_relu", bias)


@pytest.mark.skipif(not ON_GPU, reason="the descriptor path runs on Hopper with a full GPU")
@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("K", [5, 512])
def test_large_fp32_with_column_major_operands(precision, K):
    # On Hopper these outputs fill the GPU: the descriptor kernel, with K-major copies as
    # tf32. K = 5 makes a copied row 20 bytes, which a descriptor cannot describe: before
    # the copy was checked, such a product went to the descriptor kernel anyway.
    a, b, bias = operands(2048, 2048, K, torch.float32)
    a_view, b_view = a.t().contiguous().t(), b
    with fp32_precision(precision):
        out = matmul(a_view, b_view, "relu", bias=bias)
        tol = tolerance(torch.float32, K)
    torch.testing.assert_close(out.double(), matmul_reference(a, b, "relu", bias)[0], **tol)


@pytest.mark.parametrize(
    "view",
    ["column-major", "row-major", "strided", "one row", "empty"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_major_copies_any_layout(view, dtype):
    # The K-major copy for tf32: a transpose in memory, over tile edges (67 x 45, 130 x 3).
    source = random_tensor((130, 67), dtype)
    t = {
        "column-major": source[:, :45].mT,  # 45 x 130, stride (1, 67)
        "row-major": source[:67],
        "strided": source[::2, ::3],
        "one row": source[:1, :3],
        "empty": source[:0].mT,
    }[view]
    copy = row_major(t)
    assert copy.is_contiguous() and copy.shape == t.shape
    assert torch.equal(copy, t)


# Chapter 07's check at every size it names (a learner's quick run checks two of them): the
# descriptor kernel, autotuned for the two largest, each layout it can describe, bias and
# activations, the pre-activation.
CHAPTER_07_SHAPES = [(16, 16, 16), (64, 96, 128), (77, 136, 48), (200, 264, 72), (1000, 1536, 704), (2048, 3072, 4096)]


@pytest.mark.skipif(not ON_HOPPER, reason="the descriptor kernel at full size: Hopper")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_descriptor_kernel_at_chapter_07s_sizes(dtype):
    def skip(a, b):
        return tma_operands(a, b) is None

    check_matmul.check(matmul_tma, dtypes=[dtype], shapes=CHAPTER_07_SHAPES, skip=skip)


@pytest.mark.skipif(not HAS_FP8, reason="no fp8 on this GPU")
@pytest.mark.parametrize("shape", [(48, 64, 32), (77, 136, 48)], ids=str)
def test_fp8_with_b_column_major(shape):
    M, K, N = shape
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(M, K, generator=generator) * 4).to(torch.float8_e4m3fn).to(DEVICE)
    b = (torch.randn(N, K, generator=generator) * 4).to(torch.float8_e4m3fn).to(DEVICE).t()
    bias = torch.randn(N, device=DEVICE)
    out, pre = matmul(a, b, "relu", bias=bias, return_preactivation=True)
    assert out.dtype == torch.bfloat16
    expected, expected_pre = matmul_reference(a, b, "relu", bias)
    tol = tolerance(torch.bfloat16, K, scale=4.0)
    torch.testing.assert_close(out.double(), expected, **tol)
    torch.testing.assert_close(pre.double(), expected_pre, **tol)


@settings(max_examples=12, deadline=None)
@given(
    M=st.integers(1, 70),
    N=st.integers(1, 70),
    K=st.integers(1, 70),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    activation=st.sampled_from(ACTIVATIONS),
    transpose_a=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_any_small_shape(M, N, K, dtype, activation, transpose_a, seed):
    a, b, bias = operands(M, N, K, dtype, seed)
    if transpose_a:
        a = a.t().contiguous().t()
    assert_matches(portable_small_tiles, a, b, activation, bias)


@pytest.mark.parametrize("group_size_m", [1, 3, 8])
def test_every_program_order_covers_every_tile(group_size_m):
    a, b, bias = operands(7 * 16 - 3, 5 * 16 - 5, 40, torch.float32)
    out = matmul_portable(a, b, bias=bias, config=SMALL | {"GROUP_SIZE_M": group_size_m})
    torch.testing.assert_close(out.double(), matmul_reference(a, b, None, bias)[0], **tolerance(a.dtype, 40))


def test_inputs_are_left_untouched():
    a, b, bias = operands(30, 20, 10, torch.float32)
    copies = [t.clone() for t in (a, b, bias)]
    matmul(a, b, "gelu", bias=bias, return_preactivation=True)
    assert all(torch.equal(t, c) for t, c in zip((a, b, bias), copies, strict=True))


a, b, _ = operands(8, 4, 16, torch.float32)
BAD_INPUTS = {
    "inner dims differ": ((a, b[:-1]), {}, ValueError, "inner dimensions"),
    "dtypes differ": ((a, b.half()), {}, TypeError, "convert one"),
    "integer dtype": ((a.int(), b.int()), {}, TypeError, "supported"),
    "float64": ((a.double(), b.double()), {}, TypeError, "supported"),
    "1-D": ((a[0], b), {}, ValueError, r"2-D.*a\[None\]"),
    "1-D b": ((a, b[:, 0]), {}, ValueError, r"2-D.*b\[:, None\]"),
    "3-D": ((a[None], b), {}, ValueError, r"2-D.*a.reshape\(-1, a.shape\[-1\]\)"),
    "wrong device": ((a.to("meta"), b.to("meta")), {}, ValueError, "move it"),
    "not a tensor": (([[1.0]], b), {}, TypeError, "torch.Tensor"),
    "bias length": ((a, b), {"bias": torch.zeros(5)}, ValueError, "one value per"),
    "bias 2-D": ((a, b), {"bias": torch.zeros(1, 4)}, ValueError, "shape"),
    "bias int": ((a, b), {"bias": torch.zeros(4, dtype=torch.int64)}, TypeError, "bias"),
    "activation": ((a, b), {"activation": "tanh"}, ValueError, "choose one of"),
    "a needs a gradient": ((a.clone().requires_grad_(), b), {}, RuntimeError, "linear"),
    "bias needs a gradient": ((a, b), {"bias": torch.zeros(4).requires_grad_()}, RuntimeError, "no backward"),
}


def test_inputs_that_need_a_gradient_are_taken_without_autograd():
    a, b, _ = operands(8, 4, 16, torch.float32)
    with torch.no_grad():
        product = matmul(a.clone().requires_grad_(), b)
    torch.testing.assert_close(product, matmul(a, b), rtol=0, atol=0)


@pytest.mark.parametrize("case", BAD_INPUTS)
@pytest.mark.parametrize("function", [matmul, matmul_portable, matmul_tma])
def test_bad_input_is_refused_with_advice(function, case):
    args, kwargs, error, advice = BAD_INPUTS[case]
    kwargs = {k: v.detach().to(DEVICE).requires_grad_(v.requires_grad) if k == "bias" else v for k, v in kwargs.items()}
    with pytest.raises(error, match=advice):
        function(*args, **kwargs)


def test_descriptor_kernel_refuses_layouts_it_cannot_describe():
    a, b, _ = operands(8, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="portable"):
        matmul_tma(a[:, ::2], b[::2])


ACCUMULATE_SHAPES = [(1, 1, 1), (19, 23, 7), (37, 56, 33)] + ([(1536, 1536, 64)] if ON_GPU else [])


@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", ACCUMULATE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulate_adds_the_product_in_place(dtype, shape, with_bias, transpose_b):
    M, N, K = shape  # the largest fills the GPU, so that the Hopper kernel takes it there
    a, b, bias = operands(M, N, K, dtype)
    if transpose_b:  # b as (N, K).T, as a weight's gradient reads it
        b = b.t().contiguous().t()
    start = torch.randn(M, N, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    out = start.clone()
    bias = bias if with_bias else None
    with fp32_precision("highest"):
        returned = matmul(a, b, bias=bias, accumulate=out)
    product, _ = matmul_reference(a, b, None, bias)
    assert returned is out
    tol = tolerance(dtype, K)
    torch.testing.assert_close(out.double(), start.double() + product, **tol)


def test_accumulate_twice_adds_twice():
    a, b, _ = operands(24, 40, 16, torch.float32)
    out = torch.zeros(24, 40, device=DEVICE)
    with fp32_precision("highest"):
        matmul(a, b, accumulate=out)
        matmul(a, b, accumulate=out)
    expected, _ = matmul_reference(a, b, None, None)
    torch.testing.assert_close(out.double(), 2 * expected, **tolerance(torch.float32, 16))


a, b, _ = operands(8, 4, 16, torch.float32)
BAD_ACCUMULATE = {
    "shape": ({"accumulate": torch.zeros(8, 5)}, ValueError, "must be"),
    "strided": ({"accumulate": torch.zeros(4, 8).t()}, ValueError, "contiguous"),
    "dtype": ({"accumulate": torch.zeros(8, 4, dtype=torch.float16)}, TypeError, "accumulate"),
    "activation": ({"accumulate": torch.zeros(8, 4), "activation": "relu"}, ValueError, "activation"),
    "preactivation": (
        {"accumulate": torch.zeros(8, 4), "return_preactivation": True},
        ValueError,
        "return_preactivation",
    ),
}


@pytest.mark.parametrize("case", BAD_ACCUMULATE)
def test_bad_accumulate_is_refused_with_advice(case):
    kwargs, error, advice = BAD_ACCUMULATE[case]
    kwargs = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=advice):
        matmul(a.to(DEVICE), b.to(DEVICE), **kwargs)


def test_accumulate_in_place_is_seen_by_autograd_and_refuses_a_gradient():
    a, b = (t.to(DEVICE) for t in operands(8, 4, 16, torch.float32)[:2])
    out = torch.zeros(8, 4, device=DEVICE)
    weight = torch.ones(8, 4, device=DEVICE, requires_grad=True)
    product = (weight * out).sum()  # autograd saves out for weight's gradient
    matmul(a, b, accumulate=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.backward()
    with pytest.raises(RuntimeError, match="no backward"):  # it would get no gradient
        matmul(a, b, accumulate=torch.zeros(8, 4, device=DEVICE, requires_grad=True))


@pytest.mark.parametrize("m, n", [(4, 0), (0, 3)])
def test_accumulate_into_an_empty_output(m, n):
    a, b = torch.randn(m, 5, device=DEVICE), torch.randn(5, n, device=DEVICE)
    out = torch.empty(m, n, device=DEVICE)
    assert matmul(a, b, accumulate=out) is out


def test_accumulate_laid_out_otherwise_is_refused_saying_what_to_pass():
    a, b = torch.randn(1, 16, device=DEVICE), torch.randn(16, 12, device=DEVICE)
    odd_strides = torch.zeros(12, 1, device=DEVICE).t()  # (1, 12), strides (1, 1)
    storage = torch.zeros(20, device=DEVICE)
    for out in (odd_strides, storage[1:13].view(1, 12)):  # the second 4 bytes off
        with pytest.raises(ValueError, match=r"strides \(12, 1\).*out.clone\(memory_format"):
            matmul(a, b, accumulate=out)
        fresh = out.clone(memory_format=torch.contiguous_format)
        torch.testing.assert_close(matmul(a, b, accumulate=fresh), out + a @ b, rtol=1e-4, atol=1e-4)


def test_accumulate_sharing_memory_with_an_operand_is_refused():
    a = torch.randn(8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="copy"):
        matmul(a, a.clone(), accumulate=a)


# Shapes whose last wave the descriptor kernel splits along K with 16 x 16 x 16 tiles: one
# tile more than a full wave (the interpreter has 4 "SMs", an H100 132; the device
# profile's, STEPKERNELS_DEVICE_PROFILE), and a single tile.
FULL_WAVE_AND_ONE = (112, 304, 512) if sm_count() == 132 else (16 * (sm_count() + 1), 16, 256)
TAIL_SHAPES = [(16, 16, 256), FULL_WAVE_AND_ONE]
SPLIT = {**SMALL, "SPLIT_TAIL": True}


@pytest.mark.skipif(not (ON_HOPPER or INTERPRET), reason="the descriptor kernel needs Hopper")
@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("shape", TAIL_SHAPES, ids=str)
def test_split_last_wave_sums_its_shares_once_and_in_order(shape, activation):
    M, N, K = shape
    assert (M // 16) * (N // 16) % sm_count() == 1 or (M // 16) * (N // 16) == 1
    a, b, bias = operands(M, N, K, torch.float32)
    start = torch.randn(M, N, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with fp32_precision("highest"):
        split = [matmul_tma(a, b, activation, bias=bias, return_preactivation=True,
                            config=SPLIT) for _ in range(2)]  # fmt: skip
        whole = matmul_tma(a, b, activation, bias=bias, return_preactivation=True, config=SMALL)
        out = start.clone()
        launch_tma(a, b, None, bias, False, SPLIT, accumulate=out)
    expected, expected_pre = matmul_reference(a, b, activation, bias)
    tol = tolerance(torch.float32, K)
    for got, want in zip(split[0], (expected, expected_pre), strict=True):
        torch.testing.assert_close(got.double(), want, **tol)
    assert all(torch.equal(x, y) for x, y in zip(*split, strict=True))  # the same bits twice
    assert not torch.equal(split[1][1], whole[1])  # the split did happen: other roundings
    torch.testing.assert_close(out.double(), start.double() + matmul_reference(a, b, None, bias)[0], **tol)
    assert int(zeroed(a.device, sm_count()).abs().sum()) == 0  # left at zero for the next launch


@pytest.mark.skipif(not (ON_HOPPER or INTERPRET), reason="the descriptor kernel needs Hopper")
@pytest.mark.parametrize(
    "shape", [(16, 16, 256), (80, 16, 256), (48, 16, 256), (80, 16, 48), (96, 80, 256), (64, 64, 64)], ids=str
)
def test_the_host_knows_when_the_kernel_splits_the_last_wave(shape):
    """matmul_tuning.tail_shares repeats the kernel's rule: a split changes the roundings."""
    a, b, _ = operands(*shape, torch.float32)
    with fp32_precision("highest"):
        split, whole = matmul_tma(a, b, config=SPLIT), matmul_tma(a, b, config=SMALL)
    assert (tail_shares(*shape, SPLIT, sm_count()) > 1) == (not torch.equal(split, whole))


@pytest.mark.skipif(not (ON_HOPPER or INTERPRET), reason="the descriptor kernel needs Hopper")
@pytest.mark.parametrize("split", [False, True])
def test_two_programs_an_sm_give_the_product(split):
    # One 16 x 16 tile more than a full wave of two programs an SM: the split's case.
    M, N, K = 16 * (2 * sm_count() + 1), 16, 256
    a, b, bias = operands(M, N, K, torch.float32)
    two = {**(SPLIT if split else SMALL), "PROGRAMS_PER_SM": 2}
    with fp32_precision("highest"):
        got = matmul_tma(a, b, "gelu", bias=bias, config=two)
        whole = matmul_tma(a, b, "gelu", bias=bias, config=SMALL)  # one an SM, no split
    expected, _ = matmul_reference(a, b, "gelu", bias)
    torch.testing.assert_close(got.double(), expected, **tolerance(torch.float32, K))
    assert tail_shares(M, N, K, two, programs(two)) > 1  # a SPLIT_TAIL config splits here
    assert torch.equal(got, whole) != split  # and its shares round otherwise
    assert int(zeroed(a.device, programs(two)).abs().sum()) == 0


# Squares whose last wave no fp16 tile splits, and one where some do (132 SMs, or the
# interpreter's 4; a profile of another SM count skips the test).
SPLIT_SIZES = {132: [(4096, False), (3072, True)], 4: [(1024, False), (1152, True)]}.get(sm_count())


@pytest.mark.skipif(SPLIT_SIZES is None, reason=f"sizes chosen for 132 or 4 SMs, not {sm_count()}")
@pytest.mark.parametrize("size, splits_somewhere", SPLIT_SIZES or [(0, False)])
def test_the_autotuner_times_split_configs_only_where_they_split(size, splits_somewhere):
    named = {"a_ptr": torch.empty(1, dtype=torch.float16), "M": size, "N": size, "K": size}
    kept = keep_tma_configs(TMA_CONFIGS, named)
    split = [c for c in kept if c.kwargs.get("SPLIT_TAIL")]
    assert all(tail_shares(size, size, size, c.kwargs, programs(c.kwargs)) > 1 for c in split)
    assert bool(split) == splits_somewhere
    assert len(kept) - len(split) == sum(c.itemsize == 2 and not c.kwargs.get("SPLIT_TAIL") for c in TMA_CONFIGS)


# Weight gradients (issue 41): dW = dYᵀ X, A the transpose of a row-major dY (column-major), an
# output as small as a layer's weight over a reduction along every token. Chapter 07's kernel
# splits the K of every tile over the SMs that the few tiles alone would leave idle.
matmul_module = importlib.import_module("stepkernels.ops.matmul")  # the package's is the function
WGRAD_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])
# The step's products at nanoGPT's Shakespeare shape (16,384 tokens, 384 wide): dW of the qkv,
# attention-out, MLP-in and MLP-out layers; and its forward and dX products (K = 384 to 1,536).
STEP_WEIGHT_GRADIENTS = [(1152, 384, 16384), (384, 384, 16384), (1536, 384, 16384), (384, 1536, 16384)]
STEP_WIDE_PRODUCTS = [(16384, 1152, 384), (16384, 384, 384), (16384, 1536, 384), (16384, 384, 1536), (16384, 384, 1152)]


def weight_gradient_operands(tokens, out_features, in_features, dtype, seed=0):
    """dYᵀ (out_features x tokens, a column-major view of dY) and X (tokens x in_features)."""
    generator = torch.Generator().manual_seed(seed)
    grad_y = torch.randn(tokens, out_features, generator=generator).to(DEVICE, dtype)
    x = torch.randn(tokens, in_features, generator=generator).to(DEVICE, dtype)
    return grad_y.mT, x


def tiles(M, N, config):
    return -(-M // config["BLOCK_M"]) * -(-N // config["BLOCK_N"])


@pytest.mark.skipif(not (ON_HOPPER or INTERPRET), reason="the descriptor kernel needs Hopper")
@pytest.mark.parametrize("programs_per_sm", [1, 2])
@pytest.mark.parametrize("dtype", WGRAD_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(256, 16, 16), (301, 24, 8), (515, 16, 24), (1000, 8, 32)], ids=str)
def test_weight_gradient_splits_every_tile_along_k(shape, dtype, programs_per_sm):
    # Fewer 16 x 16 tiles than programs (the interpreter's 4 SMs): every tile is split, its
    # shares summed in order by the last to arrive; tokens (K) off the 16-deep steps.
    tokens, out_features, in_features = shape
    a, b = weight_gradient_operands(tokens, out_features, in_features, dtype)
    config = {**SPLIT, "PROGRAMS_PER_SM": programs_per_sm}
    M, N, K = out_features, in_features, tokens
    if tiles(M, N, config) >= programs(config) or tail_shares(M, N, K, config, programs(config)) < 2:
        pytest.skip(f"{sm_count()} SMs: these tiles are not split")
    assert tma_operands(a, b) is not None and a.stride(0) == 1  # A read column-major, no copy
    with fp32_precision("highest"):
        first, second = (matmul_tma(a, b, config=config) for _ in range(2))
        whole = matmul_tma(a, b, config=SMALL)
    torch.testing.assert_close(first.double(), matmul_reference(a, b)[0], **tolerance(dtype, K))
    assert torch.equal(first, second)  # the same bits twice: the shares are summed in order
    if dtype == torch.float32:  # fp32 output: the split's other roundings show
        assert not torch.equal(first, whole)
    assert int(zeroed(a.device, programs(config)).abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if ON_GPU else []), ids=str)
@pytest.mark.parametrize("kernel", ["portable", "descriptor (split)"])
def test_accumulate_16_bit_products_into_fp32(kernel, dtype):
    # A parameter's fp32 gradient gets dYᵀ X added with one rounding, to fp32, not two.
    if kernel != "portable" and not (ON_HOPPER or INTERPRET):
        pytest.skip("the descriptor kernel needs Hopper")
    a, b = weight_gradient_operands(512, 16, 24, dtype)
    start = torch.randn(16, 24, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = start.clone()
    if kernel == "portable":
        assert matmul_portable is not None and matmul(a, b, accumulate=out) is out
    else:
        launch_tma(*tma_operands(a, b), None, None, False, SPLIT, accumulate=out)
    want = start.double() + matmul_reference(a, b)[0]
    torch.testing.assert_close(out.double(), want, **tolerance(torch.float32, 512))


def test_accumulate_of_another_dtype_names_the_ones_taken():
    a, b, _ = operands(8, 8, 8, torch.float16)
    with pytest.raises(TypeError, match="float32"):
        matmul(a, b, accumulate=torch.zeros(8, 8, device=DEVICE, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_matmul_gives_weight_gradients_to_the_descriptor_kernel(monkeypatch, dtype):
    # As on Hopper (4 SMs here): a weight gradient's shape goes to chapter 07's kernel (an
    # operand a descriptor cannot describe copied into one it can), a skinny product (K = N)
    # and a short reduction over such an operand to the portable one.
    monkeypatch.setattr(matmul_module, "ON_HOPPER", True)
    taken = []
    for name in ("launch_tma", "launch_portable"):
        real = getattr(matmul_module, name)
        spy = lambda *args, real=real, name=name, **kwargs: taken.append(name) or real(*args, **kwargs)
        monkeypatch.setattr(matmul_module, name, spy)
    cases = {
        "dW": (weight_gradient_operands(1024, 16, 24, dtype), "launch_tma"),
        "skinny": (operands(16, 256, 256, dtype)[:2], "launch_portable"),
        # the LM head's dW: dY's 65-class rows copied 16 bytes apart, K split
        "65 classes": (weight_gradient_operands(1024, 65, 24, dtype), "launch_tma"),
        "65 classes, short K": (weight_gradient_operands(96, 65, 24, dtype), "launch_portable"),
    }
    for (a, b), kernel in cases.values():
        taken.clear()
        with fp32_precision("highest"):
            out = matmul(a, b)
        assert taken == [kernel]
        torch.testing.assert_close(out.double(), matmul_reference(a, b)[0], **tolerance(dtype, a.shape[1]))


def test_the_autotuner_times_only_split_configs_for_the_steps_weight_gradients(monkeypatch):
    # On 132 SMs (H100, H200): each dW of the Shakespeare step is a weight gradient's shape,
    # and only configs that split it are timed; its forward and dX products keep every config.
    monkeypatch.setattr(matmul_tuning, "sm_count", lambda: 132)
    a_ptr = torch.empty(1, dtype=torch.bfloat16)
    whole_configs = [c for c in TMA_CONFIGS if c.itemsize == 2 and not c.kwargs.get("SPLIT_TAIL")]
    for M, N, K in STEP_WEIGHT_GRADIENTS:
        assert splits_k(M, N, K)
        kept = keep_tma_configs(TMA_CONFIGS, {"a_ptr": a_ptr, "M": M, "N": N, "K": K})
        assert kept and all(c.kwargs.get("SPLIT_TAIL") for c in kept)
        assert all(tail_shares(M, N, K, c.kwargs, programs(c.kwargs)) > 1 for c in kept)
    for M, N, K in STEP_WIDE_PRODUCTS:
        assert not splits_k(M, N, K)
        kept = keep_tma_configs(TMA_CONFIGS, {"a_ptr": a_ptr, "M": M, "N": N, "K": K})
        assert all(c in kept for c in whole_configs)
    assert not splits_k(256, 8192, 8192)  # chapter 04's skinny products stay where they were


@pytest.mark.skipif(not ON_HOPPER, reason="the step's sizes: Hopper")
@pytest.mark.parametrize("shape", STEP_WEIGHT_GRADIENTS, ids=str)
def test_the_steps_weight_gradients_on_hopper(shape):
    M, N, K = shape
    a, b = weight_gradient_operands(K, M, N, torch.bfloat16)
    assert matmul_module.on_descriptors(torch.bfloat16, M, N, K)
    first, second = matmul(a, b), matmul(a, b)
    torch.testing.assert_close(first.double(), matmul_reference(a, b)[0], **tolerance(torch.bfloat16, K))
    assert torch.equal(first, second)
    grad = torch.randn(M, N, device=DEVICE)  # into an fp32 gradient
    want = grad.double() + matmul_reference(a, b)[0]
    torch.testing.assert_close(matmul(a, b, accumulate=grad).double(), want, **tolerance(torch.float32, K, 2**0.5))
