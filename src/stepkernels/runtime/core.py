"""What every operation of the package shares: where kernels run, input checks, seeds, and
refusing what autograd cannot do. Hand-written; the operations' modules are generated from the
chapters (see tools/export.py)."""

from __future__ import annotations

import threading

# Where kernels run: defined with the device profile, used by every operation from here.
from stepkernels.runtime.device import DEVICE, INTERPRET, ON_GPU, profile  # noqa: F401
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sm_count() -> int:
    """Streaming multiprocessors of the device profile (``runtime.device``): the GPU's, or
    the override's; 4 under the interpreter, which has none (a small number, so that
    persistent loops still take several turns there)."""
    return profile().sm_count


def capability() -> tuple[int, int]:
    """The device profile's compute capability, (0, 0) under the interpreter. Features
    (TMA, fp8, bf16) are better read from ``runtime.device.profile()``, which knows the
    vendor: an AMD GPU reports capability numbers too."""
    return profile().capability


class TunedConfigs(list):
    """The configs an autotuner times here; ``every``: those it times on a GPU, which
    ``tools/check_targets.py`` compiles for each target without one."""

    every: list


def autotune_configs(configs: list) -> list:
    """All configs on a GPU; the first alone under the interpreter, which cannot time kernels."""
    chosen = TunedConfigs(list(configs) if ON_GPU else list(configs)[:1])
    chosen.every = list(configs)
    return chosen


def loss_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a loss of ``tensor`` comes out in: fp32 under autocast on its device, as
    PyTorch's losses (autocast runs them in fp32), else ``tensor``'s own."""
    return (
        torch.float32 if torch.is_autocast_enabled(tensor.device.type) else tensor.dtype
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(tensor, name: str, dtypes=None, contiguous: bool = False) -> None:
    """Reject an input the kernels cannot take, saying what to do instead."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != DEVICE.type:
        raise ValueError(
            f"{name} is on {tensor.device}, but the kernels here run on {DEVICE.type}: "
            f"move it with {name}.to('{DEVICE.type}')"
        )
    if dtypes is not None and tensor.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(
            f"{name} has dtype {dtype_name(tensor.dtype)}; supported: {names}. Convert with {name}.to(...)"
        )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (strides {tuple(tensor.stride())}): pass {name}.contiguous()"
        )


def refuse_autograd(operation: str, alternative: str, *tensors) -> None:
    """Call in a public function that has no backward: an input that requires a gradient
    would get none from it, silently, so we refuse while autograd is recording."""
    wanted = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    if wanted and torch.is_grad_enabled():
        raise RuntimeError(
            f"{operation} has no backward, and an input requires a gradient that it would "
            f"silently drop. Use {alternative}, or call it under torch.no_grad() or on "
            f"detached inputs."
        )


def refuse_double_backward(operation: str, alternative: str) -> None:
    """Call first thing in an ``autograd.Function.backward`` whose kernels autograd cannot
    differentiate. Autograd runs a backward with gradients enabled exactly when the caller
    asked for ``create_graph=True``: a second derivative (a gradient penalty, say) would then
    be silently missing, so we refuse instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{operation} cannot be differentiated twice: its backward is a Triton kernel "
            f"that autograd cannot differentiate, so create_graph=True would silently drop the "
            f"second derivative. Use {alternative} where you need one."
        )


def fresh_seed() -> int:
    """A seed for one call of a random kernel, drawn from PyTorch's default (CPU) generator,
    so that ``torch.manual_seed`` makes a run reproducible. 63 bits: drawing 31 would repeat a
    seed (and so a whole mask) about once in 46,000 calls; 63 bits, never in practice."""
    return int(torch.randint(2**63 - 1, (), dtype=torch.int64))


_RAW_STREAM = getattr(
    torch._C, "_cuda_getCurrentRawStream", None
)  # CUDA builds have it
_ZEROED = {}  # (device, stream, numel, dtype) -> zeros that every kernel using them leaves at 0


def zeroed(device, numel: int, dtype=torch.int32) -> torch.Tensor:
    """Scratch of ``numel`` zeros (counters, sums) for kernels launched on the current
    stream that set it back to zero before they end: launches on one stream run one after
    another, so they can share it, and none pays for a memset. Kept for the life of the
    process (a CUDA graph that captured its address may replay it at any time)."""
    # The stream's handle, not torch.cuda.current_stream's Python object: that costs a
    # matmul call on Hopper 13% of its CPU time (cProfile on an H100)
    on_gpu = device.type == "cuda"
    index = device.index
    if on_gpu and index is None:
        index = torch.cuda.current_device()
    key = (device, _RAW_STREAM(index) if on_gpu else None, numel, dtype)
    if key not in _ZEROED:
        stream = torch.cuda.current_stream(device) if on_gpu else None
        if stream is not None and torch.cuda.is_current_stream_capturing():
            # memory of the graph being captured: not kept
            return torch.zeros(numel, device=device, dtype=dtype)
        _ZEROED[key] = zeros_outside_any_pool(numel, device, dtype, stream)
    return _ZEROED[key]


def zeros_outside_any_pool(numel, device, dtype, stream) -> torch.Tensor:
    """Zeros from PyTorch's ordinary memory. While torch.compile's CUDA graphs warm up,
    whatever this thread allocates goes to their private pool, which must hold nothing kept
    for the life of the process: another thread allocates them, on its default stream."""
    if stream is None:
        return torch.zeros(numel, device=device, dtype=dtype)
    made = []
    worker = threading.Thread(
        target=lambda: made.append(torch.zeros(numel, device=device, dtype=dtype))
    )
    worker.start()
    worker.join()
    stream.wait_stream(torch.cuda.default_stream(device))  # the zeros are written first
    return made[0]
