import kit
import pytest
import torch
from conftest import load_chapter
from hypothesis import given, settings
from hypothesis import strategies as st

chapter = load_chapter("04")

# bf16 tl.dot returns garbage under the interpreter, so bf16 is checked on the GPU only
# (the chapter's own checks do that); here it appears only through the UPCAST work-around.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if kit.ON_GPU else [])
# Small tiles, so that small shapes still span several tiles, groups and K-steps.
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_SIZE_M": 2}
KERNELS = {
    "matmul": chapter.matmul,
    "portable (autotuned)": chapter.matmul_portable,
    "portable (16x16x16 tiles)": lambda *args, **kwargs: chapter.matmul_portable(*args, config=SMALL, **kwargs),
}
if chapter.ON_HOPPER or kit.INTERPRET:
    KERNELS["descriptor"] = chapter.matmul_tma


def operands(M, N, K, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=generator).to(kit.DEVICE, dtype)
    b = torch.randn(K, N, generator=generator).to(kit.DEVICE, dtype)
    bias = torch.randn(N, generator=generator).to(kit.DEVICE)
    return a, b, bias


def assert_matches(kernel, a, b, activation=None, bias=None):
    out, pre = kernel(a, b, activation, bias=bias, return_preactivation=True)
    expected, expected_pre = chapter.reference(a, b, activation, bias)
    tol = chapter.tolerance(a.dtype, a.shape[1])
    assert out.shape == expected.shape and out.dtype == chapter.output_dtype(a.dtype)
    assert out.is_contiguous() and pre.shape == out.shape
    torch.testing.assert_close(out.double(), expected, **tol)
    torch.testing.assert_close(pre.double(), expected_pre, **tol)


def usable(kernel_name, a, b):
    return kernel_name != "descriptor" or chapter.tma_applies(a, b)


SHAPES = [
    (1, 1, 1),
    (1, 40, 24),  # M = 1
    (40, 1, 24),  # N = 1
    (24, 40, 1),  # K = 1
    (19, 23, 7),  # everything odd and small
    (37, 56, 33),  # not multiples of any block
    (64, 48, 32),  # exact multiples of the small tiles
    (130, 72, 100),  # past one 128-row tile
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_shapes_and_dtypes(kernel_name, dtype, shape):
    a, b, bias = operands(*shape, dtype)
    if usable(kernel_name, a, b):
        assert_matches(KERNELS[kernel_name], a, b, bias=bias)


@pytest.mark.parametrize("activation", kit.ACTIVATIONS)
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_bias_and_each_activation(kernel_name, activation):
    a, b, bias = operands(45, 48, 40, torch.float16)
    assert_matches(KERNELS[kernel_name], a, b, activation, bias)
    assert_matches(KERNELS[kernel_name], a, b, activation)  # and without the bias


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
def test_bias_of_another_dtype_and_stride(bias_dtype):
    a, b, _ = operands(20, 24, 16, torch.float32)
    bias = torch.randn(48, device=kit.DEVICE).to(bias_dtype)[::2]  # strided
    assert_matches(chapter.matmul, a, b, "relu", bias)


LAYOUTS = {
    "a.t()": lambda a, b: (a.t().contiguous().t(), b),
    "b.t()": lambda a, b: (a, b.t().contiguous().t()),
    "both .t()": lambda a, b: (a.t().contiguous().t(), b.t().contiguous().t()),
    "column slices": lambda a, b: (
        torch.cat([a, a], dim=1)[:, : a.shape[1]],
        torch.cat([b, b], dim=1)[:, : b.shape[1]],
    ),
    "every other row": lambda a, b: (
        torch.repeat_interleave(a, 2, dim=0)[::2],
        torch.repeat_interleave(b, 2, dim=0)[::2],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=kit.dtype_name)
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_strided_inputs_are_read_in_place(kernel_name, dtype, layout):
    a, b, bias = operands(40, 56, 24, dtype)
    a_view, b_view = LAYOUTS[layout](a, b)
    assert torch.equal(a_view, a) and torch.equal(b_view, b)
    if usable(kernel_name, a_view, b_view):
        assert_matches(KERNELS[kernel_name], a_view, b_view, "gelu", bias)


def test_transposed_weight_as_in_a_linear_layer():
    x, _, bias = operands(33, 40, 24, torch.float32)
    weight = torch.randn(40, 24, device=kit.DEVICE)  # (out_features, in_features)
    out = chapter.matmul(x, weight.t(), "relu", bias=bias)
    expected = torch.relu(torch.nn.functional.linear(x, weight, bias))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(
    M=st.integers(1, 70),
    N=st.integers(1, 70),
    K=st.integers(1, 70),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    activation=st.sampled_from(kit.ACTIVATIONS),
    seed=st.integers(0, 2**31),
)
def test_any_small_shape_with_small_tiles(M, N, K, dtype, activation, seed):
    a, b, bias = operands(M, N, K, dtype, seed)
    assert_matches(KERNELS["portable (16x16x16 tiles)"], a, b, activation, bias)


@pytest.mark.parametrize("group_size_m", [1, 2, 3, 8])
def test_every_program_order_covers_every_tile(group_size_m):
    tiles_m, tiles_n = 7, 5
    tiles = {chapter.grouped_tile(pid, tiles_m, tiles_n, group_size_m) for pid in range(tiles_m * tiles_n)}
    assert tiles == {(m, n) for m in range(tiles_m) for n in range(tiles_n)}
    a, b, bias = operands(7 * 16 - 3, 5 * 16 - 5, 40, torch.float32)
    config = SMALL | {"GROUP_SIZE_M": group_size_m}
    out = chapter.matmul_portable(a, b, bias=bias, config=config)
    expected = chapter.reference(a, b, None, bias)[0]
    torch.testing.assert_close(out.double(), expected, **chapter.tolerance(a.dtype, 40))


def test_bf16_through_the_interpreter_work_around():
    a, b, bias = operands(37, 40, 24, torch.bfloat16)
    assert_matches(chapter.matmul, a, b, "squared_relu", bias)


@pytest.mark.skipif(not chapter.HAS_FP8, reason="no fp8 on this GPU")
def test_fp8_matches_scaled_mm():
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(48, 64, generator=generator) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(32, 64, generator=generator) * 4).to(torch.float8_e4m3fn).t()
    a, b = a.to(kit.DEVICE), b.to(kit.DEVICE)
    one = torch.ones((), device=kit.DEVICE)
    expected = torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    out = chapter.matmul(a, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1.0)


@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (4, 5, 0)], ids=str)
def test_empty_dimensions(shape):
    M, N, K = shape
    a = torch.randn(M, K, device=kit.DEVICE)
    b = torch.randn(K, N, device=kit.DEVICE)
    bias = torch.randn(N, device=kit.DEVICE)
    out = chapter.matmul(a, b, "relu", bias=bias)
    assert out.shape == (M, N)
    torch.testing.assert_close(out, torch.relu(a @ b + bias))


def test_inputs_are_left_untouched():
    a, b, bias = operands(30, 20, 10, torch.float32)
    copies = [t.clone() for t in (a, b, bias)]
    chapter.matmul(a, b, "gelu", bias=bias, return_preactivation=True)
    assert all(torch.equal(t, c) for t, c in zip((a, b, bias), copies, strict=True))


a, b, _ = operands(8, 4, 16, torch.float32)
BAD_INPUTS = {
    "inner dims differ": ((a, b[:-1]), {}, ValueError, "inner dimensions"),
    "dtypes differ": ((a, b.half()), {}, TypeError, "one dtype"),
    "integer dtype": ((a.int(), b.int()), {}, TypeError, "supported"),
    "float64": ((a.double(), b.double()), {}, TypeError, "supported"),
    "1-D": ((a[0], b), {}, ValueError, "2-D"),
    "3-D": ((a[None], b), {}, ValueError, "2-D"),
    "wrong device": ((a.to("meta"), b.to("meta")), {}, ValueError, "move it"),
    "not a tensor": (([[1.0]], b), {}, TypeError, "torch.Tensor"),
    "bias length": ((a, b), {"bias": torch.zeros(5)}, ValueError, "one value per"),
    "bias 2-D": ((a, b), {"bias": torch.zeros(1, 4)}, ValueError, "shape"),
    "bias int": ((a, b), {"bias": torch.zeros(4, dtype=torch.int64)}, TypeError, "bias"),
    "activation": ((a, b), {"activation": "tanh"}, ValueError, "choose one of"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
@pytest.mark.parametrize("function", [chapter.matmul, chapter.matmul_portable, chapter.matmul_tma])
def test_bad_input_is_refused_with_advice(function, case):
    args, kwargs, error, advice = BAD_INPUTS[case]
    kwargs = {k: v.to(kit.DEVICE) if k == "bias" else v for k, v in kwargs.items()}
    with pytest.raises(error, match=advice):
        function(*args, **kwargs)


def test_descriptor_kernel_refuses_layouts_it_cannot_describe():
    a, b, _ = operands(8, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="portable"):
        chapter.matmul_tma(a[:, ::2], b[::2])


@pytest.mark.parametrize("a_t, b_t", [(False, False), (False, True), (True, False), (True, True)])
def test_k_major_for_tf32_makes_k_contiguous_and_keeps_values(a_t, b_t):
    a, b = torch.randn(24, 40), torch.randn(40, 56)
    a_in = a.mT.contiguous().mT if a_t else a
    b_in = b.mT.contiguous().mT if b_t else b
    a_out, b_out = chapter.k_major_for_tf32(a_in, b_in)
    assert a_out.stride(1) == 1 and b_out.stride(0) == 1
    assert torch.equal(a_out, a) and torch.equal(b_out, b)
    assert (a_out.data_ptr() == a_in.data_ptr()) == (not a_t)  # already K-major: no copy
    assert (b_out.data_ptr() == b_in.data_ptr()) == b_t


def test_fills_the_gpu_counts_128_by_128_tiles_against_sms():
    sms = chapter.NUM_SMS
    assert chapter.fills_the_gpu(128 * sms, 128)
    assert not chapter.fills_the_gpu(128 * sms - 128, 128)
    assert chapter.fills_the_gpu(128 * (sms - 1) + 1, 128)  # a partial tile counts
