"""The fused linear with libdevice's ``erf`` GELU (as it was) against the package's erfc GELU.

    python lab/gelu_erfc_linear.py    # GPU: time; CPU: check

The fused linear computed GELU with libdevice's ``erf`` (chapter 04's ``apply_activation`` and
``activation_derivative`` until 2026-11-26), which chapter 06 found costs fp16 elementwise
kernels about half their speed (``fused_dropout_cheaper.log``). Chapter 04 now computes it from
an erfc (degree 9 for fp32 outputs, 5 for 16-bit), as chapter 06 did. This script rebuilds the
matrix product's epilogue and chapter 05's activation backward (dZ = dY * GELU'(Z), db's block
sums) with the ``erf`` forms (``fused_dropout_cheaper.erf_activation``) and times both ways:

* the activation backward alone at M = N = 4,096, GB/s of dY and Z read and dZ written, with a
  copy of as many bytes;
* the fused linear's forward product (x of 4,096 x K, a 4,096 x K weight, bias, GELU; autotuned
  over chapter 07's configs) and its forward + backward through ``linear``, fp16, K = 1,024 to
  8,192, TFLOP/s of GPU time (2 x M x N x K a product, three for forward + backward).

The log's first run was made before the change, with the script's first version: there
"package" was the ``erf`` form and "erfc" the variant.
"""

import functools
from unittest import mock

from fused_dropout_cheaper import erf_activation
import sm90
from stepkernels.lessons import bench
from stepkernels.ops import linear
from stepkernels.ops import matmul_hopper as hopper
from stepkernels.ops.matmul_tuning import tma_autotuned
from stepkernels.runtime import core
import torch
import triton
import triton.language as tl


@triton.jit
def erf_out(z, ACTIVATION: tl.constexpr):
    return erf_activation(z, ACTIVATION, False)


@triton.jit
def erf_derivative(z, ACTIVATION: tl.constexpr):
    return erf_activation(z, ACTIVATION, True)


finish_erf = sm90.kernel_variant(
    hopper.finish_columns,
    "finish_erf",
    [("apply_activation(acc, EPILOGUE.ACTIVATION, c_desc.dtype)", "erf_out(acc, EPILOGUE.ACTIVATION)", 1)],
    {"erf_out": erf_out},
)
matmul_erf = sm90.kernel_variant(
    hopper.matmul_tma_kernel, "matmul_erf", [("finish_columns(", "finish_erf(", 2)], {"finish_erf": finish_erf}
)
backward_erf = sm90.kernel_variant(
    linear.activation_backward_kernel,
    "activation_backward_erf",
    [("activation_derivative(z, ACTIVATION, grad_z_ptr.dtype.element_ty)", "erf_derivative(z, ACTIVATION)", 1)],
    {"erf_derivative": erf_derivative},
)


def erf():
    """Within the block the fused linear runs libdevice's erf GELU, forward and backward."""
    tuned = tma_autotuned(matmul_erf, hopper.TMA_CONFIGS)
    return mock.patch.multiple(hopper, matmul_tma_tuned=tuned, matmul_tma_kernel=matmul_erf), mock.patch.object(
        linear, "activation_backward_kernel", backward_erf
    )


def forward_backward(x, weight, bias, grad_y):
    y = linear.linear(x, weight, bias, "gelu")
    return torch.autograd.grad(y, (x, weight, bias), grad_y)


def check():
    x = torch.randn(96, 64, device=core.DEVICE, requires_grad=True)
    weight = torch.randn(80, 64, device=core.DEVICE, requires_grad=True)
    bias = torch.randn(80, device=core.DEVICE, requires_grad=True)
    grad_y = torch.randn(96, 80, device=core.DEVICE)
    torch.set_float32_matmul_precision("highest")
    product = functools.partial(hopper.matmul_tma, x.detach(), weight.detach().t(), "gelu", bias=bias.detach())
    want = (product(), *forward_backward(x, weight, bias, grad_y))
    patches = erf()
    with patches[0], patches[1]:
        got = (product(), *forward_backward(x, weight, bias, grad_y))
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    print("the erf GELU gives the package's descriptor-kernel product and fused linear backward (fp32, 1e-5)")


def sweep():
    for dtype in (torch.float16, torch.float32):
        grad_y, z = (torch.randn(4096, 4096, device="cuda", dtype=dtype) for _ in "yz")
        nbytes = 3 * z.numel() * z.element_size()
        line = f"activation backward {core.dtype_name(dtype)}: copy {bench.rate(nbytes, bench.copy_of(nbytes)):,.0f}"
        call = functools.partial(linear.activation_backward, grad_y, z, "gelu", True)
        line += f"  package {bench.rate(nbytes, call):,.0f}"
        with mock.patch.object(linear, "activation_backward_kernel", backward_erf):
            line += f"  erf {bench.rate(nbytes, call):,.0f}"
        print(line, flush=True)
    torch.set_float32_matmul_precision("high")
    for k_size in (1024, 2048, 4096, 8192):
        x, weight = (torch.randn(4096, k_size, device="cuda", dtype=torch.float16) for _ in "xw")
        bias = torch.randn(4096, device="cuda", dtype=torch.float16)
        grad_y = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        flops = 2 * 4096 * 4096 * k_size
        forward = functools.partial(hopper.matmul_tma, x, weight.t(), "gelu", bias=bias)
        params = [t.clone().requires_grad_() for t in (x, weight, bias)]
        both = functools.partial(forward_backward, *params, grad_y)
        line = f"linear fp16 K={k_size:5}: forward package {bench.rate(flops, forward, 'TFLOP/s'):.0f}"
        back = bench.rate(3 * flops, both, "TFLOP/s")
        patches = erf()
        with patches[0], patches[1]:
            line += f" erf {bench.rate(flops, forward, 'TFLOP/s'):.0f}"
            line += f" | forward + backward package {back:.0f} erf {bench.rate(3 * flops, both, 'TFLOP/s'):.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    check()
    if core.ON_GPU:
        with bench.side_stream():
            sweep()
