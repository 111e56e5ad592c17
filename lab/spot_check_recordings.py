"""Re-measure a few recorded points with the package as it is now, next to the recording.

After a change that should not move the recorded figures (the redesign moved every kernel
from its chapter into the package), this times the package's functions at one or two sizes of
each memory-bound benchmark and at 4,096³ for matmul, the way ``bench`` times them (GPU time of
CUDA-graph replays, L2 flushed), and prints each rate over the recorded one. It records nothing.

    python lab/spot_check_recordings.py     # GPU only
"""

from stepkernels import dropout, dropout_bias_act, layer_norm, matmul, softmax
from stepkernels.lessons import bench
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch


def rows(n_cols):
    return 4096 if n_cols <= 32768 else 2**26 // n_cols


def softmax_forward(n_cols, dtype):
    x = torch.randn(rows(n_cols), n_cols, device=DEVICE, dtype=dtype)
    return (lambda: softmax(x)), 2 * x.numel() * dtype.itemsize


def softmax_forward_backward(n_cols, dtype):
    x = torch.randn(rows(n_cols), n_cols, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    return (lambda: torch.autograd.grad(softmax(x), x, dy)), 5 * x.numel() * dtype.itemsize


def layer_norm_forward(n_cols, dtype):
    x = torch.randn(4096, n_cols, device=DEVICE, dtype=dtype)
    w, b = (torch.rand(n_cols, device=DEVICE, dtype=dtype) for _ in "wb")
    return (lambda: layer_norm(x, (n_cols,), w, b)), 2 * x.numel() * dtype.itemsize


def dropout_forward(n, dtype):
    x = torch.randn(n, device=DEVICE, dtype=dtype)
    return (lambda: dropout(x, 0.1, 1234)), 2 * n * dtype.itemsize


def bias_gelu_dropout_forward(n, dtype):
    x = torch.randn(n // 4096, 4096, device=DEVICE, dtype=dtype)
    bias = torch.randn(4096, device=DEVICE, dtype=dtype)
    return (lambda: dropout_bias_act(x, bias, 0.1, "gelu", 1234)), 2 * n * dtype.itemsize


def matmul_square(size, dtype):
    x, y = (torch.randn(size, size, device=DEVICE, dtype=dtype) for _ in "xy")
    return (lambda: matmul(x, y)), 2 * size**3


CASES = [  # (benchmark, provider, make, x values, unit)
    ("softmax-forward", "triton", softmax_forward, [1024, 4096, 32768], "GB/s"),
    ("softmax-forward-backward", "triton", softmax_forward_backward, [4096, 65536], "GB/s"),
    ("layer-norm-forward", "triton (two-stage)", layer_norm_forward, [4096, 16384], "GB/s"),
    ("dropout-forward", "triton", dropout_forward, [2**24, 2**27], "GB/s"),
    ("bias-gelu-dropout-forward", "triton", bias_gelu_dropout_forward, [2**24], "GB/s"),
    ("matmul-square", "triton", matmul_square, [4096], "TFLOP/s"),
]

if __name__ == "__main__":
    if not ON_GPU:
        raise SystemExit("GPU only: the recorded figures are GPU timings")
    for name, provider, make, xs, unit in CASES:
        recorded = bench.load_recorded(name)[0]
        dtypes = (torch.float16,) if name.startswith("matmul") else (torch.float32, torch.float16)
        for dtype in dtypes:
            for x in xs:
                call, work = make(x, dtype)
                now = bench.per_time(work, bench.measure_ms(call)[0], unit)
                then = next(
                    p.value
                    for p in recorded
                    if p.provider == provider and p.x == x and p.dtype == bench.dtype_name(dtype)
                )
                label = f"{name} {bench.dtype_name(dtype)} {x:,}"
                print(f"{label:<42} now {now:8,.1f}, recorded {then:8,.1f} {unit}: {now / then:.2f}x")
