"""Lean launches (stepkernels.launch): a launch key at least as fine as Triton's own, and on a
GPU the same results as Triton's path, for inputs that specialize a kernel differently."""

import sys

from conftest import random_tensor
import pytest
from stepkernels import layer_norm, matmul, softmax
from stepkernels.runtime.core import ON_GPU
from stepkernels.runtime.launch import LeanKernel, triton_launches
import torch
import triton
import triton.language as tl

softmax_module = sys.modules["stepkernels.ops.softmax"]


def test_launch_key_separates_what_triton_specializes_on():
    kernel = softmax_module.softmax_kernel
    assert isinstance(kernel, LeanKernel)
    x = torch.zeros(64, dtype=torch.float16)
    key = lambda *args, **meta: kernel.key(args, meta, 0)
    base = key(x, 16, 3.0, BLOCK=4)
    assert key(x, 16, 3.0, BLOCK=4) == base
    assert key(x[1:], 16, 3.0, BLOCK=4) != base  # 2 bytes off a 16-byte boundary
    assert key(x[8:], 16, 3.0, BLOCK=4) == base  # 16 bytes on: aligned again
    assert key(x.float(), 16, 3.0, BLOCK=4) != base  # dtype
    assert key(x, 1, 3.0, BLOCK=4) != base  # integers equal to 1 are specialized
    assert key(x, 17, 3.0, BLOCK=4) != base  # divisibility by 16
    assert key(x, 16, 3.0, BLOCK=8) != base  # constexprs
    assert key(x, 16, 3.0, BLOCK=4, num_warps=8) != base  # launch options
    assert key(None, 16, 3.0, BLOCK=4) != base


def test_unspecialized_integers_are_keyed_by_width_only():
    kernel = LeanKernel(softmax_module.softmax_kernel.kernel)
    kernel.unspecialized = {0}  # as for dropout's seed
    key = lambda seed: kernel.key((seed,), {}, 0)
    assert key(5) == key(2**30) == key(1)
    assert key(2**31) != key(5)  # u32
    assert key(2**40) != key(2**31)  # i64


@triton.jit
def fill_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, 1.0, mask=offsets < n)


def test_forget_drops_launchers_and_the_autotuners_choices():
    autotuned = triton.autotune([triton.Config({"BLOCK": 16})], key=["n"])(fill_kernel)
    tuned, plain = LeanKernel(autotuned), LeanKernel(fill_kernel)
    assert tuned.tuned is tuned.kernel and plain.tuned is None
    tuned.kernel.cache[("shape",)] = "a config"  # as a tuning leaves them
    for kernel in (tuned, plain):
        kernel.entries[("key",)] = "a launcher"
        kernel.forget()
        assert kernel.entries == {}
    assert ("shape",) not in tuned.kernel.cache


def test_heuristic_rules_see_only_what_the_launch_key_holds():
    kernel = LeanKernel.__new__(LeanKernel)  # the fields heuristic_values reads
    kernel.arg_names = ["a_ptr", "K", "BLOCK_K"]
    tuned = sys.modules["stepkernels.ops.matmul"].matmul_portable_tuned.kernel
    kernel.heuristics = dict(tuned.fn.values)  # chapter 04's EVEN_K, under the autotuner
    a = torch.zeros(4)
    assert kernel.heuristic_values((a, 96), {"BLOCK_K": 32}) == {"EVEN_K": True}
    assert kernel.heuristic_values((a, 100), {"BLOCK_K": 32}) == {"EVEN_K": False}
    kernel.heuristics["LATER"] = lambda args: args["EVEN_K"] and args.get("K") > 64
    assert kernel.heuristic_values((a, 96), {"BLOCK_K": 32})["LATER"]  # sees EVEN_K
    kernel.heuristics = {"BIG": lambda args: args["a_ptr"].numel() > 2}
    assert kernel.heuristic_values((a, 96), {"BLOCK_K": 32}) is None  # a size: not keyed


@pytest.mark.skipif(not ON_GPU, reason="lean launches are taken on a GPU only")
def test_lean_launches_match_tritons_path():
    x = random_tensor((257, 1000), torch.float16)
    storage = torch.empty(257 * 1000 + 1, dtype=torch.float16, device=x.device)
    misaligned = storage[1:].view(257, 1000).copy_(x)  # same values, 2 bytes off
    with triton_launches():
        expected = softmax(x)
    for _ in range(3):  # cached after the first call of each launch key
        torch.testing.assert_close(softmax(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(softmax(misaligned), expected, rtol=0, atol=0)
    assert len(softmax_module.softmax_kernel.entries) >= 2


@pytest.mark.skipif(not ON_GPU, reason="lean launches are taken on a GPU only")
def test_lean_launches_of_autotuned_and_multi_kernel_operations():
    a, b = random_tensor((300, 200), torch.float16), random_tensor((200, 100), torch.float16, 1)
    w, bias = random_tensor(200, torch.float16, 2), random_tensor(200, torch.float16, 3)
    with triton_launches():
        expected_product = matmul(a, b)
        expected_norm = layer_norm(a.T, (300,), None, None)
    for _ in range(3):
        torch.testing.assert_close(matmul(a, b), expected_product, rtol=0, atol=0)
        torch.testing.assert_close(layer_norm(a.T, (300,), None, None), expected_norm, rtol=0, atol=0)
        torch.testing.assert_close(
            matmul(a[:, :100], b[:100]), (a[:, :100].float() @ b[:100].float()).half(), rtol=1e-2, atol=1e-2
        )
    assert layer_norm(a, (200,), w, bias).shape == a.shape
    assert sys.modules["stepkernels.ops.matmul"].matmul_portable_tuned.entries  # EVEN_K evaluated
