"""Argument checks of public functions whose chapters leave them out of the lesson (02 to 06, 09,
12).

Each raises with what to do instead; the chapter's function calls it before any kernel runs.
"""

import math
import numbers
import warnings

from stepkernels.runtime.activations import check_activation
from stepkernels.runtime.core import FLOAT_DTYPES, check_tensor, refuse_autograd
import torch

BUILTIN_NUMBERS = {numbers.Real: (int, float), numbers.Integral: (int,)}
# What a repeated call's first test takes as a tensor, or a tensor or None, by exact type
# (one tuple lookup; a subclass takes the checked path)
TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
OPTIONAL_TENSOR_TYPES = (type(None), *TENSOR_TYPES)


def is_number(value, kind=numbers.Real) -> bool:
    """A number of ``kind``, NumPy's too, as torch takes them; not a bool."""
    if type(value) in BUILTIN_NUMBERS.get(kind, ()):  # without the ABC's slower check
        return True
    return isinstance(value, kind) and not isinstance(value, bool)


def flag_argument(name: str, value) -> None:
    """An option that is True or False: a str "False" or a 0 would pass for its truth."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def activation_argument(activation) -> None:
    """An activation's name, or None: another type is a TypeError, an unknown name a
    ValueError."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be a str or None, got {activation!r}")
    check_activation(activation)


def softmax_arguments(x, dim, log, dtypes) -> int:
    """Chapter 02's ``softmax``: a tensor of one of ``dtypes`` with a dimension ``dim`` (an
    int, negative from the end, as torch's), and ``log`` True or False. Returns ``dim``
    counted from the front."""
    check_tensor(x, "x", dtypes)
    if x.dim() == 0:
        raise ValueError(
            "x is 0-dim, but softmax runs over one of its dimensions: "
            "pass x.reshape(1) (whose softmax is [1.0])"
        )
    if not is_number(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, a dimension of x, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim {dim} is out of range for x of {x.dim()} dimensions: "
            f"pass one in [{-x.dim()}, {x.dim() - 1}]"
        )
    flag_argument("log", log)
    return int(dim) % x.dim()


MATRIX_HINTS = {  # (operand, dimensions up to 3): how to pass it to matmul as a matrix
    ("a", 1): "a[None] (one row)",
    ("b", 1): "b[:, None] (one column)",
    ("a", 3): "a.reshape(-1, a.shape[-1]) (batches of rows as rows)",
    ("b", 3): "one product per batch, or torch.matmul, which broadcasts",
}


def matmul_arguments(a, b, activation, bias, dtypes, return_preactivation=False):
    """Chapter 04's ``matmul``: two 2-D matrices of one of ``dtypes`` that multiply, a known
    activation, and a bias of one value per column of the output; no autograd."""
    alternative = "stepkernels.linear(a, b.mT, bias, activation), which has one"
    refuse_autograd("matmul", alternative, a, b, bias)
    for name, tensor in (("a", a), ("b", b)):
        check_tensor(tensor, name, dtypes)  # fp8 needs compute capability 8.9
        if tensor.dim() != 2:
            fix = MATRIX_HINTS.get((name, min(tensor.dim(), 3)), "a 2-D tensor")
            raise ValueError(
                f"{name} must be a 2-D matrix, got shape {tuple(tensor.shape)}: use {fix}"
            )
    if a.dtype != b.dtype:
        raise TypeError(f"a is {a.dtype} but b is {b.dtype}: convert one with .to(...)")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"inner dimensions differ: a is {tuple(a.shape)} and b is {tuple(b.shape)}; "
            f"b needs {a.shape[1]} rows (did you mean b.t()?)"
        )
    activation_argument(activation)
    flag_argument("return_preactivation", return_preactivation)
    if bias is not None:
        check_tensor(bias, "bias", FLOAT_DTYPES)
        if bias.shape != (b.shape[1],):
            raise ValueError(
                f"bias must have shape ({b.shape[1]},), one value per column of the "
                f"output, got {tuple(bias.shape)}"
            )


def accumulate_arguments(out, a, b, activation, return_preactivation, dtypes):
    """``matmul``'s ``accumulate``: the (M, N) output in one of ``dtypes``, contiguous,
    aligned, apart from a and b, and nothing asked of the product but to be added."""
    shape, storage = (a.shape[0], b.shape[1]), out.untyped_storage().data_ptr()
    check_tensor(out, "accumulate", dtypes)
    refuse_autograd("matmul(accumulate=...)", "out + a @ b", out)  # written in place
    # An empty output has no storage and any strides, and nothing to add
    empty = out.shape == shape and out.numel() == 0
    laid_out = out.stride() == (shape[1], 1) and out.data_ptr() % 16 == 0
    if out.shape != shape or not (empty or laid_out):
        raise ValueError(
            f"accumulate must be {shape} with strides ({shape[1]}, 1) and 16-byte "
            f"aligned, got {tuple(out.shape)} with strides {out.stride()} at "
            f"{out.data_ptr() % 16} past 16 bytes: add into "
            f"out.clone(memory_format=torch.contiguous_format), then copy "
            f"it back"
        )
    apart = (a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())
    if storage in apart and not empty:
        raise ValueError("accumulate shares memory with a or b: pass a copy of those")
    if activation is not None or return_preactivation:  # it adds the product, as is
        raise ValueError("accumulate takes no activation and no return_preactivation")
    # Written in place: autograd's saved copies of it are now stale, as after torch's own
    torch.autograd.graph.increment_version(out)


def parameter_dtype(name, param, x, fp32_too=False) -> None:
    """A parameter in x's dtype, or in fp32 where ``fp32_too`` (the kernel reads it as fp32)."""
    if param.dtype != x.dtype and not (fp32_too and param.dtype == torch.float32):
        also = " (fp32 parameters take x of any dtype, as torch's)" if fp32_too else ""
        if torch.is_autocast_enabled(x.device.type):  # casts torch's layers only
            also += "; torch.autocast does not cast for our kernels (chapter 12 casts by hand)"
        raise TypeError(
            f"{name} is {param.dtype} but x is {x.dtype}: one dtype for all, "
            f"convert x or the parameter with .to(...){also}"
        )


def linear_arguments(x, weight, bias, activation, recompute=False) -> None:
    """Chapter 05's ``linear``: x (..., in_features), weight (out_features, in_features) and
    bias (out_features,) or None, one float dtype; a known activation; recompute a bool."""
    check_tensor(x, "x", FLOAT_DTYPES)
    given = [("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, param in given:
        check_tensor(param, name)
        parameter_dtype(name, param, x)
    bad = weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]
    if bad or not (bias is None or bias.shape == weight.shape[:1]):
        raise ValueError(
            "x must be (..., in_features), weight (out_features, in_features) and bias "
            f"(out_features,) or None, got shapes {tuple(x.shape)}, {tuple(weight.shape)} "
            f"and {None if bias is None else tuple(bias.shape)}{linear_shape_hint(x, weight)}"
        )
    linear_options(activation, recompute)


def linear_options(activation, recompute) -> None:
    """Chapter 05's options, of ``linear`` and ``FusedLinear``."""
    activation_argument(activation)
    flag_argument("recompute", recompute)


def linear_shape_hint(x, weight) -> str:
    """What a shape mismatch in ``linear`` most likely is, where one thing stands out."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] == weight.shape[1]:
        return ""  # the bias, or a weight or x that is no matrix
    if x.shape[-1] == weight.shape[0]:
        return ": the transposed weight? (nn.Linear keeps (out_features, in_features))"
    return f": x has {x.shape[-1]} features where the weight takes {weight.shape[1]}"


def reduction_argument(reduction, reductions) -> None:
    """A ``reduction`` option: chapter 03's (by ``layer_norm`` and when a module is made) and
    chapter 09's."""
    if not isinstance(reduction, str):
        raise TypeError(
            f"reduction must be a str, one of {reductions}, got {reduction!r}"
        )
    if reduction not in reductions:
        raise ValueError(f"reduction {reduction!r} unknown: choose one of {reductions}")


def layer_norm_arguments(
    x, normalized_shape, weight, bias, eps, reduction, block_size, dtypes, reductions
):
    """``normalized_shape`` as a tuple, once chapter 03's ``layer_norm`` arguments pass."""
    check_tensor(x, "x", dtypes)  # never None, which the parameters may be
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None:
            check_tensor(tensor, name, dtypes)
    shape = normalized_shape
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    if not all(type(size) is int for size in shape):  # NumPy's too, as torch takes them
        if not all(is_number(size, numbers.Integral) for size in shape):
            raise TypeError(f"normalized_shape must be ints, got {normalized_shape!r}")
        shape = tuple(int(size) for size in shape)
    if not shape or len(shape) > x.dim() or x.shape[x.dim() - len(shape) :] != shape:
        raise ValueError(
            f"normalized_shape {shape} must be the trailing dimensions of "
            f"x {tuple(x.shape)}: pass x.shape[-k:] for k dimensions"
        )
    if math.prod(shape) == 0:
        raise ValueError("normalized_shape has a zero dimension: nothing to normalize")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != shape:
            raise ValueError(
                f"{name} must have normalized_shape {shape}, got {tuple(param.shape)}"
            )
        if param is not None:
            parameter_dtype(name, param, x, fp32_too=True)
    # dW and dB come out in the weight's dtype (x's without one), as torch's layer norm has it
    given = weight if weight is not None else x
    if bias is not None and bias.dtype != given.dtype:
        which = "the weight's" if weight is not None else "x's (no weight given)"
        raise TypeError(
            f"bias must have {which} dtype {given.dtype}, got {bias.dtype}: pass "
            f"bias.to({given.dtype}), or fp32 weight and bias together"
        )
    if not is_number(eps):
        raise TypeError(f"eps must be a number, got {eps!r}")
    if not eps >= 0:  # also refuses nan
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    reduction_argument(reduction, reductions)
    reduced = reduction == "lock" and torch.is_grad_enabled()  # the default skips this
    reduced = reduced and any(p is not None and p.requires_grad for p in (weight, bias))
    if reduced and torch.are_deterministic_algorithms_enabled():
        message = (
            "layer_norm's reduction='lock' adds dW and dB in the order programs arrive, so "
            "their last bits vary from run to run, and torch.use_deterministic_algorithms"
            "(True) is set: use reduction='two-stage' (the default), the same bits every run"
        )
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(message)
        warnings.warn(message, stacklevel=3)
    if block_size is not None and type(block_size) is not int:
        raise TypeError(
            f"block_size must be an int (a power of two), got {block_size!r}"
        )
    if block_size is not None and (block_size < 1 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return shape


def cross_entropy_arguments(
    target, n_rows, n_classes, ignore_index, label_smoothing, reduction, reductions
) -> tuple:
    """Chapter 09's options, checked: (ignore_index as an int, label_smoothing as a float)."""
    check_tensor(target, "target")
    if target.is_floating_point() or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold class indices as int64 or int32, got {target.dtype}; class "
            "probabilities are not supported: convert indices with target.long()"
        )
    if target.shape != (n_rows,):
        raise ValueError(f"target needs one class per row, ({n_rows},): {target.shape}")
    if not is_number(ignore_index, numbers.Integral):
        raise TypeError(
            f"ignore_index must be an int (a class index), got {ignore_index!r}"
        )
    if not is_number(label_smoothing):
        raise TypeError(
            f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    reduction_argument(reduction, reductions)
    classes_in_range(target, n_classes, "target", int(ignore_index))
    return int(ignore_index), float(label_smoothing)


def classes_in_range(indices, n_classes, name, ignore_index=None) -> None:
    """Every value of ``indices`` a class in [0, n_classes) (or ``ignore_index``), checked
    here for CPU tensors (the interpreter's), where it costs one pass over them. On a GPU the
    kernel checks a target (a device-side assert, as PyTorch's loss and embedding do):
    reading the values here would make the CPU wait for the GPU. Not while compiled: a
    graph cannot branch on values."""
    if indices.device.type != "cpu" or indices.numel() == 0:
        return
    if torch.compiler.is_compiling():
        return
    values = indices.long()  # an ignore_index past int32 compared without wrapping
    outside = (values < 0) | (values >= n_classes)
    if ignore_index is not None:
        outside &= values != ignore_index
    if outside.any():
        first = outside.nonzero()[0].tolist()
        ignored = ignore_index is not None
        raise ValueError(
            f"{name}[{', '.join(map(str, first))}] is {int(values[tuple(first)])}, outside "
            f"the classes [0, {n_classes})"
            + (f" and not ignore_index ({ignore_index})" if ignored else "")
            + f" ({int(outside.sum())} of its {outside.numel()} values are out of range): "
            f"pass class indices below {n_classes}"
            + (", or ignore_index for a row that counts nothing" if ignored else "")
        )


def sampling_arguments(new_tokens, temperature, top_k) -> None:
    """Chapter 12's ``GPT.generate``: a count of tokens, a temperature > 0, top_k None or
    at least 1."""
    if not is_number(new_tokens, numbers.Integral):
        raise TypeError(f"new_tokens must be an int, got {new_tokens!r}")
    if new_tokens < 0:
        raise ValueError(f"new_tokens must be at least 0, got {new_tokens}")
    if not is_number(temperature):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not 0 < temperature < math.inf:  # also refuses nan
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if top_k is not None and not is_number(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int or None, got {top_k!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")


def dropout_p(p) -> float:
    """Chapter 06: the probability of dropping, as a float in [0, 1]."""
    if not is_number(p):
        raise TypeError(f"p must be a Python float in [0, 1], got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:  # also refuses nan
        raise ValueError(f"p is the probability of dropping: 0 <= p <= 1, got {p}")
    return float(p)


def dropout_seed(seed, x: torch.Tensor):
    """Chapter 06: an int in [0, 2**63), or a one-element int64 tensor on x's device."""
    if isinstance(seed, torch.Tensor):
        wanted = f"pass a seed tensor of one int64 on x's device ({x.device}), not one"
        if seed.dtype != torch.int64:
            raise TypeError(f"{wanted} of {seed.dtype}")
        if seed.numel() != 1 or seed.device != x.device:
            raise ValueError(f"{wanted} of shape {tuple(seed.shape)} on {seed.device}")
        return seed  # its value unchecked: reading it would wait for the GPU
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"seed must be a Python int or a one-element int64 tensor, got "
            f"{type(seed).__name__}: draw one with int(torch.randint(2**63 - 1, ()))"
        )
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    return seed


def dropout_input(x: torch.Tensor, max_elements: int, dtypes, name: str = "x") -> None:
    """Chapter 06: a float tensor with fewer elements than its 32-bit counters cover."""
    check_tensor(x, name, dtypes)
    if x.numel() >= max_elements:
        raise ValueError(
            f"{name} has {x.numel():,} elements; the 32-bit counter covers fewer than "
            f"2**{max_elements.bit_length() - 1}: split the tensor and give each part its "
            "own seed"
        )


def dropout_bias(x: torch.Tensor, bias: torch.Tensor, dtypes) -> None:
    """Chapter 06's fused layer: one bias value per feature, in x's dtype."""
    check_tensor(bias, "bias", dtypes)
    if x.dim() == 0 or bias.shape != x.shape[-1:]:
        raise ValueError(
            f"bias must be 1-D with one value per feature (x.shape[-1]): got x "
            f"{tuple(x.shape)}, bias {tuple(bias.shape)}"
        )
    if bias.dtype != x.dtype:
        raise TypeError(
            f"bias is {bias.dtype} but x is {x.dtype}: convert the bias with "
            "bias.to(x.dtype)"
        )
