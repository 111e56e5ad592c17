r"""
A GPT trained on our kernels
============================

We assemble a small GPT from the collection's kernels, train it on Shakespeare's plays, and race
it against the same model on PyTorch's layers: the same parameters, data and loss.

What you will learn:

* where each kernel of chapters 03 to 11 sits in a transformer, forward and backward;
* a model's shape as one configuration object, and what a training step costs in FLOPs;
* checking a whole model against a reference: one set of parameters, two sets of layers;
* mixed precision by hand: what autocast does for PyTorch's layers, done explicitly for ours;
* dropout in a step replayed from a CUDA graph: seeds that live on the GPU;
* what decides a small model's speed once its kernels are fast: launches, and the work between.

Prerequisites: chapters 03 (layer norm), 05 (fused linear), 06 (dropout), 08 (CUDA graphs),
09 (cross-entropy) and 11 (attention). On a GPU this page trains 50 steps live and shows the
full 5,000-step runs as recorded; ``STEPKERNELS_FULL=1`` (or ``make bench``) trains 200 steps
live and runs those too.
"""

# %%
# Setup
# -----

import dataclasses
import functools
import gc
import os

import matplotlib.pyplot as plt
from stepkernels.lessons import bench, training, tutorial
from stepkernels.models import train
from stepkernels.models.config import Config, preset
from stepkernels.models.data import load_shakespeare
import torch

tutorial.announce()
DEVICE = tutorial.DEVICE
# The 5,000-step runs happen under make bench (STEPKERNELS_RECORD=1) or STEPKERNELS_FULL=1.
FULL_RUNS_LIVE = tutorial.ON_GPU and any(
    os.environ.get(name) == "1" for name in ("STEPKERNELS_RECORD", "STEPKERNELS_FULL")
)

# %%
# The model's shape
# -----------------
# nanoGPT's character-level Shakespeare model is our target: 6 blocks of width C = 384 with 6
# heads, a context of T = 256 characters. Each block normalizes, attends, normalizes again and
# runs a two-layer MLP of width 4C, each with a residual connection; the output layer reuses the
# token embedding's matrix. The whole shape is one object, ``GPTConfig``, handed to every
# module, as nanoGPT's ``model.py`` does. It refuses a shape our kernels cannot run before any
# parameter is allocated: chapter 11's attention takes heads of at most 128 values. It also
# names the block's layers, GPT-2's by default: ``norm``, ``position``, ``mlp`` and
# ``n_kv_head`` choose chapter 14's modern block instead (RMSNorm, rotary embeddings, SwiGLU,
# grouped-query attention), which that chapter assembles and checks; this one trains GPT-2's.
#
# A training step's FLOPs are those of its matrix products: 6 per weight per token (2 in the
# forward, 4 in the backward, chapter 05), and attention's 4 T C per token and layer for the
# forward, halved by the causal mask and 3.5 times that with its backward (chapter 11). The
# norms, GELU, dropout, residual additions and the loss move bytes but add no products.

# @save models/gpt
import dataclasses
import math

from stepkernels.ops.adamw import cast_joined
from stepkernels.ops.add_layer_norm import add_layer_norm
from stepkernels.ops.attention import (
    MAX_HEAD_DIM,
    attention,
    attention_backward,
    attention_forward,
    descriptor_ready,
    ready,
)
from stepkernels.ops.cross_entropy import cross_entropy
from stepkernels.ops.dropout import dropout, dropout_bias_act
from stepkernels.ops.layer_norm import layer_norm
from stepkernels.ops.linear import linear
from stepkernels.ops.rms_norm import rms_norm
from stepkernels.ops.rotary import rope_tables, rotary_embedding_qk
from stepkernels.ops.swiglu import silu_mul
from stepkernels.runtime.arguments import classes_in_range, sampling_arguments
from stepkernels.runtime.core import refuse_double_backward
import torch
from torch import nn
import torch.nn.functional as F


class ConfigError(ValueError):
    """A configuration value out of range; ``field`` names it (a command-line option)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ConfigTypeError(TypeError):
    """A configuration value of the wrong type; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The model's shape, given whole to every module."""

    vocab_size: int  # tokens the model reads and predicts
    block_size: int = 256  # the longest context, in tokens
    n_layer: int = 6  # transformer blocks
    n_head: int = 6  # attention heads per block
    n_embd: int = 384  # the residual stream's width C
    dropout: float = 0.0  # probability of dropping, where GPT-2 drops
    bias: bool = True  # biases in the linear layers and norms (False: none)
    use_triton: bool = True  # our kernels, else PyTorch's layers (same parameters)
    # A modern block (chapter 14) by its choices; the defaults are GPT-2's.
    norm: str = "layer"  # "layer": layer norm; "rms": RMSNorm (no mean, no bias)
    position: str = "learned"  # "learned": an embedding added to the input; "rotary"
    mlp: str = "gelu"  # "gelu": GELU(x W1) W2; "swiglu": (silu(x Wg) * x Wu) W2
    n_kv_head: int = 0  # heads of k and v (grouped-query attention); 0: n_head
    mlp_hidden: int = 0  # the MLP's inner width; 0: 4C, or 8C/3 for SwiGLU (rounded)

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ConfigTypeError(name, f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ConfigError(name, f"{name} must be at least 1, got {value}")
        for name in ("n_kv_head", "mlp_hidden"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ConfigTypeError(name, f"{name} must be an int, got {value!r}")
            if value < 0:
                raise ConfigError(name, f"{name} must be at least 0, got {value}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(
                    name,
                    f"{name} must be one of {', '.join(choices)}, got "
                    f"{getattr(self, name)!r}",
                )
        if self.n_embd % self.n_head:
            raise ConfigError(
                "n_embd",
                f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})",
            )
        if self.n_embd // self.n_head > MAX_HEAD_DIM:
            raise ConfigError(
                "n_head",
                f"heads of n_embd / n_head = {self.n_embd // self.n_head} values: our "
                f"attention takes at most {MAX_HEAD_DIM}; use n_head >= "
                f"{-(-self.n_embd // MAX_HEAD_DIM)}",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                "dropout", f"dropout must be in [0, 1), got {self.dropout}"
            )
        for name in ("bias", "use_triton"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(name, f"{name} must be True or False")
        if self.n_head % self.kv_heads:
            divisors = [d for d in range(1, self.n_head + 1) if self.n_head % d == 0]
            raise ConfigError(
                "n_kv_head",
                f"n_head ({self.n_head}) must be a multiple of n_kv_head "
                f"({self.n_kv_head}): each k and v head serves a group of query heads; "
                f"choose one of {', '.join(map(str, divisors))}",
            )
        if self.position == "rotary" and self.head_dim % 2:
            raise ConfigError(
                "position",
                f"rotary turns pairs of a head's values, but heads have n_embd / n_head "
                f"= {self.head_dim} values, an odd number: choose n_embd and n_head "
                "with an even quotient, or position 'learned'",
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Heads of k and v: n_kv_head, or n_head where it is 0."""
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's inner width: mlp_hidden, else GPT-2's 4C, or for SwiGLU two thirds of
        it (the same parameters in three matrices as in two), rounded up to a multiple of
        64 (Llama rounds to its ``multiple_of``, 256 for its larger models)."""
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return -(-(8 * self.n_embd // 3) // 64) * 64

    def block(self) -> str:
        """The block's layers in words, for a run's first lines."""
        norm = {"layer": "layer norm", "rms": "RMSNorm"}[self.norm]
        mlp = {"gelu": "GELU", "swiglu": "SwiGLU"}[self.mlp]
        plural = "s" if self.kv_heads > 1 else ""
        heads = f"{self.kv_heads} head{plural} of k and v for {self.n_head} of q"
        return (
            f"{norm}, {self.position} positions, {mlp} MLP {self.hidden} wide, "
            f"{heads}, {'biases' if self.bias else 'no biases'}"
        )


CHOICES = {
    "norm": ("layer", "rms"),
    "position": ("learned", "rotary"),
    "mlp": ("gelu", "swiglu"),
}


def flops_per_token(config: GPTConfig) -> float:
    """FLOPs of one training step (forward and backward) per token of the batch."""
    C, L, T, D = config.n_embd, config.n_layer, config.block_size, config.head_dim
    # Weights of products a block: q, k and v (3C² with as many k and v heads as q's), the
    # output C², the MLP two (GELU) or three (SwiGLU) of C x hidden; and the output layer.
    qkv = C * (config.n_head + 2 * config.kv_heads) * D
    mlp = (3 if config.mlp == "swiglu" else 2) * C * config.hidden
    matrices = L * (qkv + C * C + mlp) + config.vocab_size * C
    return 6 * matrices + L * 3.5 * 2 * T * C  # attention: 4 T C / 2, times 3.5


# %%
# ``Config`` holds a training run: the model's fields, the optimizer's and the
# bookkeeping's. Its defaults are nanoGPT's ``shakespeare_char``, batches of 64 sequences.

FULL = Config()
data = load_shakespeare()
TOKENS_PER_STEP = FULL.batch_size * FULL.block_size
work = flops_per_token(FULL.model_config(data.vocab_size)) * TOKENS_PER_STEP
print(
    f"{data.vocab_size} characters; {len(data.train):,} training and "
    f"{len(data.val):,} validation tokens"
)
print(f"one step of {TOKENS_PER_STEP:,} tokens: {work / 1e12:.2f} TFLOP")
tutorial.show_refusals(
    "GPTConfig",
    {
        "n_embd 100, n_head 6": lambda: GPTConfig(84, n_embd=100),
        "n_embd 512, n_head 2": lambda: GPTConfig(84, n_head=2, n_embd=512),
        "dropout 1.0": lambda: GPTConfig(84, dropout=1.0),
    },
)

# %%
# The H100's bf16 tensor cores would finish a step's products in a few milliseconds; at these
# thin shapes (every product has K = 384 or 1,536) cuBLAS itself gets only part of that, so the
# limit we draw is measured: the step's products alone, at cuBLAS's speed.
#
# The layers, twice
# -----------------
# Every layer is written twice over the same parameters. ``TorchLayers`` is PyTorch's version,
# the reference and the baseline; ``TritonLayers`` calls our kernels:
#
# * layer norm, before attention, before the MLP and at the end: ``layer_norm`` (chapter 03);
# * q, k, v and the MLP's first layer with its GELU: ``linear``, one kernel (chapter 05);
# * the projections back to the residual stream: ``linear``, then the bias and dropout in
#   ``dropout_bias_act`` (chapters 05 and 06); the embeddings' dropout: ``dropout``;
# * causal attention: ``attention`` (chapter 11); the loss: ``cross_entropy`` (chapter 09);
# * each residual addition with the norm after it: ``add_layer_norm``, one kernel (chapter 15).
#
# Embedding lookups stay PyTorch's in both. nanoGPT also drops
# attention probabilities; our attention kernel has no dropout, so neither version does.
#
# Under ``torch.autocast``, PyTorch runs matrix products in bf16 and norms and losses in fp32,
# casting each operand as it goes, while the residual stream stays fp32. Our functions take
# what they are given (one dtype per call, chapter 05), so ``TritonLayers`` does autocast's work
# itself: it casts the normalized activations to the autocast dtype before each product, and
# the products' weights all at once at the start of the forward (``cast_all``, chapter 15),
# and gives the loss fp32 logits. Outside autocast everything stays fp32, which is how we
# compare the two exactly.


# @save models/gpt
def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs products in on x's device, else x's own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class TorchLayers:
    """Each layer as PyTorch computes it: the reference, and the baseline we race."""

    def norm(self, x, norm):
        if isinstance(norm, nn.RMSNorm):
            return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    def add_norm(self, x, residual, norm):
        """x + residual (x alone if None), and its norm."""
        x = x if residual is None else x + residual
        return x, self.norm(x, norm)

    def linear(self, x, layer, activation=None, p=0.0, seed=None):
        y = F.linear(x, layer.weight, getattr(layer, "bias", None))
        y = F.gelu(y) if activation == "gelu" else y
        return F.dropout(y, p) if p > 0 else y

    def dropout(self, x, p, seed):
        return F.dropout(x, p) if p > 0 else x

    def rotary(self, q, k, cos, sin):
        def turn(x):  # x cos + rotate_half(x) sin, computed in the tables' fp32
            x1, x2 = x.chunk(2, dim=-1)
            return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

        return turn(q), turn(k)

    def silu_mul(self, gate, up):
        return F.silu(gate) * up

    def attention(self, q, k, v):
        # Fewer k and v heads than q's: SDPA repeats each for its group of query heads.
        grouped = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=grouped
        )

    def qkv_attention(self, qkv, n_head):
        """Causal attention over the heads of one QKV product (B, T, 3C): (B, T, C)."""
        batch, time, width = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        y = self.attention(*split_heads(qkv, n_head))
        return y.transpose(1, 2).reshape(batch, time, width)

    def loss(self, logits, targets):
        return F.cross_entropy(logits.float(), targets.long())  # int32 too, as ours


class TritonLayers:
    """The same layers on the collection's kernels. Under autocast, as PyTorch does: norms and
    the loss in fp32, products in the autocast dtype: given the ``model``, its products'
    weights are cast all at once (``cast_all``, chapter 15), else each as a product uses it."""

    def __init__(self, model: nn.Module | None = None):
        self.casts = {}  # id of a parameter: its copy in the autocast dtype
        weights = [] if model is None else product_weights(model)
        if weights and not torch.compiler.is_compiling():  # (compiled: fused anyway)
            casts = cast_all(torch.get_autocast_dtype(weights[0].device.type), *weights)
            self.casts = dict(zip(map(id, weights), casts, strict=True))

    def cast(self, weight, dtype):
        cast = self.casts.get(id(weight))
        return weight.to(dtype) if cast is None else cast

    def norm(self, x, norm):  # chapters 03 and 14
        if isinstance(norm, nn.RMSNorm):
            y = rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)
        else:
            y = layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        return y.to(compute_dtype(x))

    def add_norm(self, x, residual, norm):  # chapter 15
        if residual is not None and isinstance(norm, nn.RMSNorm):
            residual, x = None, x + residual  # no fused addition + RMSNorm yet
        if residual is None:
            return x, self.norm(x, norm)
        # One kernel: the sum, and its norm already in the next product's dtype.
        shape, eps, dtype = norm.normalized_shape, norm.eps, compute_dtype(x)
        return add_layer_norm(
            x, residual, shape, norm.weight, norm.bias, eps, out_dtype=dtype
        )

    def linear(self, x, layer, activation=None, p=0.0, seed=None):  # chapters 05, 06
        dtype = compute_dtype(x)
        weight, bias = self.cast(layer.weight, dtype), getattr(layer, "bias", None)
        bias = None if bias is None else self.cast(bias, dtype)
        if p == 0 or bias is None:
            # With an activation, the backward recomputes x W^T + b instead of keeping it:
            # 4C values a token (50 MB a layer here) for one more product.
            product = linear(
                x.to(dtype), weight, bias, activation, recompute=bool(activation)
            )
            return self.dropout(product, p, seed)
        # The bias joins the dropout's kernel, which regenerates its mask in the backward.
        return dropout_bias_act(linear(x.to(dtype), weight), bias, p, activation, seed)

    def dropout(self, x, p, seed):  # chapter 06
        return dropout(x, p, seed) if p > 0 else x

    def rotary(self, q, k, cos, sin):  # chapter 14: one launch, q and k read in place
        return rotary_embedding_qk(q, k, cos, sin)

    def silu_mul(self, gate, up):  # chapter 14
        return silu_mul(gate, up)

    def attention(self, q, k, v):  # chapter 11
        # Grouped heads (fewer k and v heads than q) as they are: each program reads the
        # k and v head of its query head's group (chapter 11).
        return attention(q, k, v, causal=True)

    def qkv_attention(self, qkv, n_head):  # chapters 11 and 15
        if not torch.compiler.is_compiling():  # (the compiler: ch. 11's operator)
            q = split_heads(qkv, n_head)[0]
            if qkv.is_contiguous() and descriptor_ready(q) and qkv.numel() > 0:
                return QKVAttention.apply(qkv, n_head)
        return TorchLayers.qkv_attention(self, qkv, n_head)

    def loss(self, logits, targets):  # chapter 09
        return cross_entropy(logits.float(), targets)


# @save models/gpt
def split_heads(qkv: torch.Tensor, n_head: int, n_kv_head: int | None = None):
    """q (B, H, T, D), k and v (B, H_kv, T, D) of a QKV product (B, T, (H + 2 H_kv) D),
    H_kv = n_kv_head or H: strided views, no copies."""
    n_kv_head = n_kv_head or n_head
    heads = n_head + 2 * n_kv_head  # q's, then k's, then v's
    batch, time, head_dim = qkv.shape[0], qkv.shape[1], qkv.shape[2] // heads
    by_head = qkv.view(batch, time, heads, head_dim).transpose(1, 2)
    return by_head.split([n_head, n_kv_head, n_kv_head], dim=1)


class QKVAttention(torch.autograd.Function):
    """Causal attention over the heads of a QKV product (B, T, 3C), read in place, to
    (B, T, C). The backward writes dQ, dK and dV straight into one (B, T, 3C) gradient in
    the product's layout, where autograd, going back through the views, would stack the
    three (a join) and copy the stack into that layout (a strided copy): chapter 15."""

    @staticmethod
    def forward(ctx, qkv, n_head):
        q, k, v = split_heads(qkv, n_head)
        ctx.scale, ctx.n_head = q.shape[3] ** -0.5, n_head
        o, lse = attention_forward(q, k, v, True, ctx.scale)
        ctx.save_for_backward(qkv, o, lse)
        return o.transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], -1)

    @staticmethod
    def backward(ctx, grad_y):
        refuse_double_backward("attention", "F.scaled_dot_product_attention")
        qkv, o, lse = ctx.saved_tensors
        batch, time, width = grad_y.shape
        grad_o = grad_y.reshape(batch, time, ctx.n_head, -1).transpose(1, 2)
        grad_qkv = torch.empty_like(qkv)  # its views: descriptor-ready, as qkv's
        into = split_heads(grad_qkv, ctx.n_head)
        heads = split_heads(qkv, ctx.n_head)
        attention_backward(*heads, o, lse, ready(grad_o), True, ctx.scale, grads=into)
        return grad_qkv, None


def product_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights and biases the products of ``model`` cast under autocast, if on."""
    device = next(model.parameters()).device.type
    if not torch.is_autocast_enabled(device):
        return []
    dtype = torch.get_autocast_dtype(device)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weights = [t for m in linears for t in (m.weight, m.bias) if t is not None]
    weights += [model.tokens.weight]  # the output layer's (weight tying)
    # FSDP's shards are not plain tensors yet: gathered block by block, cast per call.
    return [t for t in weights if t.dtype != dtype and type(t.data) is torch.Tensor]


def cast_all(dtype: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors``, each ``.to(dtype)``, differentiably, in one launch each way for any
    number."""
    return CastAll.apply(dtype, *tensors)


class CastAll(torch.autograd.Function):
    """Tensors cast into one buffer and viewed apart, and so their gradients back: one
    launch each way (``cast_joined``, chapter 15), where one cast apiece is a launch
    apiece."""

    @staticmethod
    def forward(ctx, dtype, *tensors):
        ctx.dtype, ctx.shapes = tensors[0].dtype, [t.shape for t in tensors]
        ctx.set_materialize_grads(False)  # a copy nobody used: no gradient, as .to's
        casts = cast_joined(dtype, tensors)  # each read once, one launch (chapter 15)
        if casts is not None:
            return casts
        return apart(torch.cat([t.reshape(-1) for t in tensors]).to(dtype), ctx.shapes)

    @staticmethod
    def backward(ctx, *grads):
        used = [i for i, g in enumerate(grads) if g is not None]
        casts = cast_joined(ctx.dtype, [grads[i] for i in used])
        if casts is None:
            flat = torch.cat([grads[i].reshape(-1) for i in used]).to(ctx.dtype)
            casts = apart(flat, [ctx.shapes[i] for i in used])
        back = dict(zip(used, casts, strict=True))
        return None, *(back.get(i) for i in range(len(grads)))


def apart(flat, shapes):
    """Views of ``flat``, one after the other, of the given shapes."""
    parts = flat.split([math.prod(shape) for shape in shapes])
    return tuple(part.view(shape) for part, shape in zip(parts, shapes, strict=True))


# %%
# A block and the model
# ---------------------
# The modules are named after the maths: a block adds ``attention(norm_1(x))``, then
# ``mlp(norm_2(x))``, to its input. None of them names a kernel: each asks ``layers`` for every
# step, so one flag, ``use_triton``, switches the whole model, and one ``state_dict`` serves
# both. The attention's q, k and v are strided views of one (B, T, 3, H, D) product, which
# chapter 11's descriptors read in place; its output comes back in q's layout, so the
# projection reads it as a view.
#
# Dropout is the one layer with state. Chapter 06's masks are a function of a seed and the
# element's position; a seed drawn on the CPU would be frozen into a CUDA graph (chapter 08),
# and every replayed step would drop the same elements. So the model keeps its seeds in a
# buffer on the GPU, one per dropout site, and advances them inside ``forward``: the addition
# is itself a kernel in the graph, and the kernels read their seed from memory when they run.


# @save models/gpt
class CausalSelfAttention(nn.Module):
    """softmax(q kᵀ / √D) v for every head, each token seeing those before it, then the
    projection back to the residual stream (dropped out in training)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        heads = config.n_head + 2 * config.kv_heads  # q's, then k's, then v's
        self.qkv = nn.Linear(config.n_embd, heads * config.head_dim, bias=config.bias)
        self.out = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x, layers, p, seed, rotation=None):
        batch, time, width = x.shape
        qkv = layers.linear(x, self.qkv)
        if rotation is None and self.n_kv_head == self.n_head:
            # GPT-2's block: the attention reads q, k, v in the product, (B, T, 3, H, D),
            # and its backward writes their gradients in that layout (chapter 15)
            y = layers.qkv_attention(qkv, self.n_head)
        else:
            q, k, v = split_heads(qkv, self.n_head, self.n_kv_head)
            if rotation is not None:  # rotary: (cos, sin) of the positions
                q, k = layers.rotary(q, k, *rotation)
            y = layers.attention(q, k, v).transpose(1, 2).reshape(batch, time, width)
        return layers.linear(y, self.out, p=p, seed=seed)


class MLP(nn.Module):
    """GELU(x W_fc + b_fc) W_out + b_out, 4C wide inside; or SwiGLU's silu(x W_g) * x W_u
    with W_g and W_u the halves of one product's W_fc (dropped out in training)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        inner = (2 if self.swiglu else 1) * config.hidden  # SwiGLU's gate, then up
        self.fc = nn.Linear(config.n_embd, inner, bias=config.bias)
        self.out = nn.Linear(config.hidden, config.n_embd, bias=config.bias)

    def forward(self, x, layers, p, seed):
        if self.swiglu:  # the two halves of one product, read in place
            hidden = layers.silu_mul(*layers.linear(x, self.fc).chunk(2, dim=-1))
        else:
            hidden = layers.linear(x, self.fc, activation="gelu")
        return layers.linear(hidden, self.out, p=p, seed=seed)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rms":
        return nn.RMSNorm(config.n_embd, eps=1e-5)  # as nn.LayerNorm's; Llama's too
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class Block(nn.Module):
    """x + attention(norm_1(x)), then x + mlp(norm_2(x)): GPT-2's pre-norm block. The last
    addition is left to whoever normalizes next (``layers.add_norm``, one kernel of ours):
    a block takes and returns the stream as (x, what to add to it)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm_1 = make_norm(config)
        self.attention = CausalSelfAttention(config)
        self.norm_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, residual, layers, p, seeds, rotation=None):
        x, h = layers.add_norm(x, residual, self.norm_1)
        update = self.attention(h, layers, p, seeds[0], rotation)
        x, h = layers.add_norm(x, update, self.norm_2)
        return x, self.mlp(h, layers, p, seeds[1])


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2's layout) of the shape ``config``, whose layers run
    on our kernels or on PyTorch's, with one set of parameters for both. ``use_triton``
    starts as the config's, and may be flipped on a built model."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not all(hasattr(config, f.name) for f in dataclasses.fields(GPTConfig)):
            raise TypeError(
                f"GPT takes one GPTConfig, got {type(config).__name__}: "
                "GPT(GPTConfig(vocab_size, block_size=..., n_layer=..., ...))"
            )
        self.config, self.use_triton = config, config.use_triton
        self.tokens = nn.Embedding(config.vocab_size, config.n_embd)
        if config.position == "learned":
            self.positions = nn.Embedding(config.block_size, config.n_embd)
        else:  # rotary: tables, not parameters (nor in the state dict)
            cos, sin = rope_tables(config.block_size, config.head_dim)  # fp32
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = make_norm(config)
        # Dropout seeds live on the device and advance inside the step, so a CUDA graph of
        # the step draws new masks at every replay (chapter 06). One per dropout site.
        sites = 1 + 2 * config.n_layer
        first = torch.randint(2**62, (), dtype=torch.int64)
        self.register_buffer("seeds", first + torch.arange(sites), persistent=False)
        self.apply(self.init_weights)
        for block in self.blocks:  # GPT-2: the residual stream's inputs start smaller
            for layer in (block.attention.out, block.mlp.out):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab) for token ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when given, else None. A target outside the vocabulary
        (other than -100, ignored) is an error on both layers: a ValueError for CPU tensors,
        checked first; on a GPU a device-side assert in the loss, ours or PyTorch's."""
        check_tokens(idx, targets, self.config.block_size, self.config.vocab_size)
        layers = TritonLayers(self) if self.use_triton else TorchLayers()
        p = self.config.dropout if self.training else 0.0
        seeds = self.seeds.add_(len(self.seeds)) if p > 0 and self.use_triton else None
        site = (lambda i: seeds[i]) if seeds is not None else (lambda i: None)
        x, rotation, time = self.tokens(idx), None, idx.shape[1]
        if self.config.position == "learned":
            x = x + self.positions(torch.arange(time, device=idx.device))
        else:
            rotation = (self.cos[:time], self.sin[:time])
        x = layers.dropout(x, p, site(0))
        residual = None
        for i, block in enumerate(self.blocks):
            seeds_i = (site(1 + 2 * i), site(2 + 2 * i))
            x, residual = block(x, residual, layers, p, seeds_i, rotation)
        # The output layer is the token embedding's matrix (GPT-2's weight tying).
        logits = layers.linear(layers.add_norm(x, residual, self.norm)[1], self.tokens)
        if targets is None:
            return logits, None
        flat = logits.view(-1, logits.shape[-1])
        return logits, layers.loss(flat, targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx, new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend each row of ``idx`` (B, T) by ``new_tokens`` sampled one at a time, from
        the ``top_k`` likeliest tokens (all if None), logits divided by ``temperature``."""
        # a prompt of at least one token, as long as it likes
        check_tokens(idx, None, vocab_size=self.config.vocab_size)
        sampling_arguments(new_tokens, temperature, top_k)
        block_size = self.config.block_size
        for _ in range(new_tokens):
            context = idx[:, -block_size:]
            length = context.shape[1]
            # Always a full context: one shape, so one autotuned launch per product. The
            # causal mask keeps the padding after the last token from changing its logits.
            context = F.pad(context, (0, block_size - length))
            logits = self(context)[0][:, length - 1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            probs = torch.softmax(logits, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, token], dim=1)
        return idx


TOKEN_DTYPES = (torch.int64, torch.int32)


def check_tokens(idx, targets, block_size=math.inf, vocab_size=None):
    """idx (batch, time) with 1 <= time <= block_size, targets of its shape; on CPU tensors,
    their ids below ``vocab_size`` (targets may be -100, ignored)."""
    for name, tokens in (("idx", idx), ("targets", targets)):
        ids = isinstance(tokens, torch.Tensor) and tokens.dtype in TOKEN_DTYPES
        if (tokens is not None or name == "idx") and not ids:
            raise TypeError(f"{name} must be a tensor of token ids, int64 or int32")
    if idx.dim() != 2 or not 0 < idx.shape[1] <= block_size:
        too_long = idx.dim() == 2 and idx.shape[1] > block_size
        hint = f": crop with idx[:, -{block_size}:]" if too_long else ""
        hint = ": one sequence is idx[None]" if idx.dim() == 1 else hint
        limit = "" if block_size == math.inf else f" <= block_size ({block_size})"
        raise ValueError(
            f"idx must be (batch, time) token ids, 1 <= time{limit}, got shape "
            f"{tuple(idx.shape)}{hint}"
        )
    if targets is not None and targets.shape != idx.shape:
        raise ValueError(
            f"targets must match idx's shape {tuple(idx.shape)}, got "
            f"{tuple(targets.shape)}"
        )
    if vocab_size is not None:
        classes_in_range(idx, vocab_size, "idx")
        if targets is not None:
            classes_in_range(targets, vocab_size, "targets", ignore_index=-100)


# %%
# One set of parameters, two sets of layers
# -----------------------------------------
# The first check of a model built from new kernels: at initialization, in fp32 (no tf32 on a
# GPU), both versions must give the same logits, loss and gradient of every parameter. Each
# kernel was tested alone; this checks the wiring: the views, the weight tying, the casts.
# We check the shape of ``python -m stepkernels.train --config tiny``; the full model, whose
# fp32 kernels compile for this check alone (half a minute on a GPU), under
# ``STEPKERNELS_FULL=1`` and in ``tests/test_gpt.py`` on a GPU.

SMALL = preset("tiny")
check_cfg = dataclasses.replace(
    tutorial.choose(gpu=SMALL, cpu=SMALL, full=FULL), dropout=0.0
)
torch.manual_seed(0)
model = GPT(check_cfg.model_config(data.vocab_size)).to(DEVICE)
starts = torch.randint(len(data.train) - check_cfg.block_size - 1, (4,)).tolist()
rows = [data.train[i : i + check_cfg.block_size + 1] for i in starts]
rows = torch.stack(rows).long()
idx, targets = rows[:, :-1].to(DEVICE), rows[:, 1:].to(DEVICE)
results, previous = {}, torch.get_float32_matmul_precision()
torch.set_float32_matmul_precision("highest")
for use_triton in (True, False):
    model.use_triton = use_triton
    model.zero_grad()
    logits, loss = model(idx, targets)
    loss.backward()
    results[use_triton] = logits, loss, {n: p.grad for n, p in model.named_parameters()}
torch.set_float32_matmul_precision(previous)
(ours, our_loss, our_grads), (theirs, their_loss, their_grads) = results.values()
gaps = {n: (g - their_grads[n]).abs().max().item() for n, g in our_grads.items()}
worst = max(gaps, key=gaps.get)
print(
    f"loss {our_loss.item():.6f} (ours), {their_loss.item():.6f} (PyTorch's); largest "
    f"difference of logits {(ours - theirs).abs().max().item():.1e}, of gradients "
    f"{gaps[worst]:.1e} ({worst})"
)
torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
for name, grad in our_grads.items():
    torch.testing.assert_close(grad, their_grads[name], rtol=1e-3, atol=1e-5, msg=name)

# %%
# Training
# --------
# ``stepkernels.models.train`` holds the rest, nanoGPT's recipe: AdamW (weight decay on
# matrices only, beta2 = 0.99), 100 steps of warm-up to a learning rate of 1e-3, cosine decay
# to 1e-4 at 5,000 steps, gradients clipped to norm 1, dropout 0.2. Every batch is a function
# of the seed and the step, so both versions see the same data.
#
# On a GPU the step runs in bf16 under autocast (on one without bf16, a T4 or a V100, in fp16
# with the loss scaled by ``torch.amp.GradScaler``: chapter 15), and ``step="graph"`` records
# all of it as one CUDA graph: the batch gathered from the text on the GPU, forward, backward,
# clipping and AdamW (``fused=True, capturable=True``, the learning rate in a tensor the loop
# refills).
# Three steps run first on a side stream, to compile, autotune and allocate; the fourth is
# recorded, and every later step is one ``replay()``. The loss is read back every 50 steps.
#
# ``python -m stepkernels.train`` runs it from a shell: ``--config tiny`` (a few seconds a step
# on a CPU), ``shakespeare`` (these defaults) or ``gpt2-small`` (GPT-2's 12 layers of 768 and
# a context of 1,024), or a file of your own, each field an option that overrides it. It
# checks every option before it loads anything, prints tokens/s, the share of the GPU's bf16
# peak the step's FLOPs reach (MFU) and the time left, writes ``log.jsonl`` and a checkpoint
# to resume from; ``python -m stepkernels.sample`` samples from that checkpoint.
#
# Here, six steps of the tiny model in fp32, both versions from the same seed: the loss must
# fall, and the two must agree at every step. Runs on this page write no files (``out_dir=""``).

QUIET = dict(
    eval_interval=0, eval_batches=1, checkpoint=False, sample_tokens=0, out_dir=""
)
losses = {}
for use_triton in (True, False):
    cfg = dataclasses.replace(
        SMALL,
        **QUIET,
        use_triton=use_triton,
        max_steps=6,
        warmup_steps=1,
        log_interval=1,
        step="eager",
        dtype="float32",
    )
    trainer = train.Trainer(cfg, data)
    trainer.train(log=lambda line: None)
    losses[use_triton] = [loss for _, loss in trainer.losses]
for step, (a, b) in enumerate(zip(losses[True], losses[False], strict=True), start=1):
    print(f"step {step}: loss {a:.6f} (ours), {b:.6f} (PyTorch's)")
assert losses[True][-1] < losses[True][0], "the small model should learn"
torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=1e-4)

# %%
# On a GPU, 50 steps of the full model follow (200 under ``STEPKERNELS_FULL=1``), on our
# kernels replayed from a CUDA graph, with the progress lines the command prints (five).

GPU_STEPS = tutorial.choose(gpu=50, cpu=0, full=200)  # none under the interpreter
if GPU_STEPS:
    short = dataclasses.replace(
        FULL,
        **{**QUIET, "sample_tokens": 200},
        max_steps=GPU_STEPS,
        log_interval=GPU_STEPS // 5,
    )
    print(train.Trainer(short, data).train()["sample"])

# %%
# Benchmark: training throughput
# ------------------------------
# Each version trains the full model for 300 steps in bf16; the first 50 (compilation,
# autotuning, the graph's recording) are not timed. ``torch`` is PyTorch eager (SDPA picks
# cuDNN's attention on the H100), ``torch.compile`` the model compiled (the optimizer stays
# eager), ``max-autotune`` compiled with ``mode="max-autotune"`` (Inductor autotunes its
# products and replays the compiled forward and backward as CUDA graphs), ``+ CUDA graph``
# the whole step replayed as above, for either set of layers. The limit, ``products alone``,
# is a step that would be only its matrix products, at cuBLAS's speed. Memory is the most the
# allocator held once warm: a graph's private pool included. The same race runs at GPT-2
# small's shape (12 blocks of 768, a context of 1,024, 16 sequences: 16,384 tokens a step as
# well), recorded under ``make bench``.

RACE = {  # provider: (use_triton, step)
    "torch": (False, "eager"),
    "torch.compile": (False, "compile"),
    "torch.compile max-autotune": (False, "max-autotune"),
    "torch + CUDA graph": (False, "graph"),
    "triton": (True, "eager"),
    "triton + torch.compile": (True, "compile"),
    "triton + CUDA graph": (True, "graph"),
}
LIMIT = "products alone (cuBLAS)"
SHAPES = {  # benchmark names' prefix: the run's configuration
    "gpt": FULL,
    "gpt2-small": preset("gpt2-small"),
}


@functools.cache
def race(shape):
    """Points of tokens per second and of peak memory (GiB), one per provider."""
    speed, memory, full = [], [], SHAPES[shape]
    tokens = full.batch_size * full.block_size
    for provider, (use_triton, step) in RACE.items():
        cfg = dataclasses.replace(
            full, **QUIET, use_triton=use_triton, step=step, max_steps=300
        )
        torch._dynamo.reset()
        run = train.Trainer(cfg, data).train(log=lambda line: None)
        speed.append(bench.Point(provider, "bfloat16", tokens, run["tokens_per_s"]))
        memory.append(bench.Point(provider, "bfloat16", tokens, run["peak_memory_gib"]))
        gc.collect(), torch.cuda.empty_cache()
    limit = training.products_alone(full, data.vocab_size)
    return [*speed, bench.Point(LIMIT, "bfloat16", tokens, limit)], memory


def board(name, unit, x_name, providers, shape="gpt"):
    full = SHAPES[shape]
    label = {"gpt": "nanoGPT's Shakespeare model", "gpt2-small": "GPT-2 small's shape"}
    return bench.Benchmark(
        name=name,
        x_name=x_name,
        x_values=[full.batch_size * full.block_size],
        providers=providers,
        make=None,
        work=None,
        unit=unit,
        dtypes=(torch.bfloat16,),
        x_labels={full.batch_size * full.block_size: label[shape]},
    )


def show_race(shape):
    """Record or show one shape's race, and print its table: tokens/s, MFU, memory."""
    full = SHAPES[shape]
    tokens = full.batch_size * full.block_size
    x_name = f"tokens per step ({full.batch_size} sequences of {full.block_size})"
    speed = bench.run(
        board(
            f"{shape}-training-throughput", "tokens/s", x_name, [*RACE, LIMIT], shape
        ),
        lambda: race(shape)[0],
    )
    memory = bench.run(
        board(f"{shape}-training-memory", bench.MEMORY_UNIT, x_name, [*RACE], shape),
        lambda: race(shape)[1],
    )
    if not (speed and memory):
        return
    at = dict(x=tokens, dtype="bfloat16")
    step_flops = flops_per_token(full.model_config(data.vocab_size)) * tokens
    peak = train.peak_bf16_tflops(speed.env["gpu"])  # dense, from NVIDIA's data sheets
    print(f"training throughput and memory, {shape}, {speed.how}:")
    # An older recording may lack the later providers: each line shows what it holds.
    ran = [p for p in RACE if speed.point(p, **at) and memory.point(p, **at)]
    best_torch = max(
        (p for p in ran if not p.startswith("triton")),
        key=lambda p: speed.value(p, **at),
    )
    for provider in ran:
        rate = speed.value(provider, **at)
        tflops = rate * step_flops / tokens / 1e12
        mfu = f", MFU {tflops / peak:3.0%}" if peak else ""
        print(
            f"{provider:>26}: {rate:>9,.0f} tokens/s ({tflops:5.1f} TFLOP/s{mfu}), "
            f"{rate / speed.value(best_torch, **at):.2f}x {best_torch}, "
            f"{memory.value(provider, **at):.2f} GiB"
        )
    print(f"{LIMIT}: {speed.value(LIMIT, **at):,.0f} tokens/s")
    if peak:
        print(
            f"MFU: the step's FLOPs over the GPU's dense bf16 peak, {peak:,.0f} TFLOP/s"
        )
    ours, eager = (memory.value(p, **at) for p in ("triton + CUDA graph", "torch"))
    print(f"peak memory of ours replayed / eager torch: {ours / eager:.2f}")


show_race("gpt")
show_race("gpt2-small")

# %%
# Eager, our model is the slowest: its step makes a few hundred calls, each dearer on the CPU
# than PyTorch's (chapter 08 measured why), and the CPU sets the pace. Replayed from a CUDA
# graph, the CPU drops out and the GPU's time is what remains; there our layers and PyTorch's
# run at nearly the same speed, ahead of eager PyTorch and of ``torch.compile``, whose default
# mode fuses the work between products but still launches each kernel from the CPU, the
# optimizer eager. The two graphs' parity says the lead is the graph's, not our kernels': over
# a step, our fused norms, GELU and dropout win back what our products lose to cuBLAS on thin
# shapes (the lab's notes hold a profile of both). Both are far from the limit: this model's
# step is mostly memory-bound work between its products, in small launches.
#
# Memory costs the graphs: a graph's private pool keeps every buffer of the step reserved for
# the next replay, where eager's allocator hands a freed buffer on within the step, so PyTorch's
# own graph holds more than PyTorch eager. Ours replayed holds no more than eager PyTorch,
# because our step keeps less: chapter 06's dropout stores no mask; the attention's output,
# written in q's layout, reaches the projection without a copy; the MLP recomputes its
# pre-activation in the backward (chapter 05's ``recompute=True``: 50 MB a layer for one more
# product) and writes dZ over the recomputed product instead of a third buffer.
#
# The full run
# ------------
# The recipe's 5,000 steps (82M tokens, 18 passes over the plays), twice from the same seed:
# PyTorch eager, and ours replayed from a CUDA graph. Every 250 steps both measure the loss on
# the same 20 validation batches; the plot shows it against the tokens seen. Unless
# ``STEPKERNELS_FULL=1`` or ``make bench`` asks for them, the runs shown are recorded ones.

FULL_RUNS = {"torch": (False, "eager"), "triton + CUDA graph": (True, "graph")}
TARGET_LOSS = 1.5


@functools.cache
def full_runs():
    runs = {}
    for provider, (use_triton, step) in FULL_RUNS.items():
        cfg = dataclasses.replace(
            FULL, use_triton=use_triton, step=step, checkpoint=False, out_dir=""
        )
        runs[provider] = train.Trainer(cfg, data).train()
        gc.collect(), torch.cuda.empty_cache()
    return runs


def curves(name, unit, key):
    """The full runs' ``key`` against tokens seen: run now, or as recorded."""
    runs = board(name, unit, "tokens seen", list(FULL_RUNS))
    if (
        FULL_RUNS_LIVE or not tutorial.ON_GPU
    ):  # without a GPU, run() shows the recording
        points = lambda: [
            bench.Point(provider, "bfloat16", row["tokens"], row[key])
            for provider, run in full_runs().items()
            for row in run["history"]
        ]
        return bench.run(runs, points, draw=False)
    found = bench.load_recorded(name)
    return None if found is None else bench.Results(runs, *found, live=False)


validation = curves("gpt-validation-loss", "validation loss", "val_loss")
seconds = curves("gpt-training-time", "s since the start", "seconds")
if validation and seconds:
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    ends, colors = {}, bench.provider_colors([*RACE, LIMIT])  # the race's colors
    for provider in validation.providers():
        mine = [p for p in validation.points if p.provider == provider]
        rows = sorted((p.x, p.value) for p in mine)
        times = {p.x: p.value for p in seconds.points if p.provider == provider}
        xs, ys = [x / 1e6 for x, _ in rows], [v for _, v in rows]
        ax.plot(xs, ys, marker="o", ms=3, label=provider, color=colors[provider])
        reached = next((x for x, loss in rows if loss <= TARGET_LOSS), None)
        ends[provider] = rows[-1][1]
        first = "never"
        if reached is not None:
            first = f"first measured after {times[reached]:.0f} s ({reached / 1e6:.1f}M tokens)"
        print(
            f"{provider:>19}: validation loss {rows[-1][1]:.4f} after "
            f"{times[rows[-1][0]]:.0f} s; {TARGET_LOSS} {first}"
        )
    ax.axhline(TARGET_LOSS, ls="--", lw=1, color="0.35")
    ax.set(xlabel="million tokens seen", ylabel="validation loss", ylim=(1.0, 3.0))
    ax.grid(alpha=0.3), ax.legend()
    fig.suptitle(f"gpt-validation-loss:\n{validation.how}", fontsize=9)
    gap = abs(ends["torch"] - ends["triton + CUDA graph"])
    print(f"final losses differ by {gap:.4f}")
    sample = full_runs()["triton + CUDA graph"]["sample"] if validation.live else None
    print(
        f"sampled from our model after the full run, {validation.how}:\n"
        f"{bench.text_file('gpt-sample.txt', sample)}"
    )

# %%
# The two curves lie on each other: the same model, trained by different kernels, within
# rounding and dropout's different random numbers. The validation loss passes 1.5 early in
# either run and keeps falling: the complete plays are four times nanoGPT's tiny Shakespeare,
# so 5,000 steps do not overfit them.
#
# Several GPUs
# ------------
# ``torchrun --nproc-per-node 2 -m stepkernels.train`` starts one process a GPU, each running
# the command. With DDP (``--parallel ddp``) each process holds the whole model and trains on
# its share of every step's batch; during the backward, DDP's hooks take each parameter's
# gradient as autograd accumulates it and average it over the GPUs with NCCL's all-reduce, in
# buckets that overlap the rest of the backward. Our layers are autograd Functions, so their
# gradients reach those hooks as PyTorch's do: no kernel changes. FSDP2 (``--parallel fsdp``)
# keeps a 1/N shard of each block's parameters, gradients and AdamW moments on each GPU; it
# gathers a block's weights just before the block runs, forward and backward, and
# reduce-scatters the block's gradients after its backward.
#
# Both wrappers are told what they can rely on, none of it changing a number the step
# computes. DDP's gradients become views of its all-reduce buckets (no copy back), a
# bucket holds about one block's gradients, and without ``--grad-accum`` the graph is
# declared static. FSDP2 gathers a block's products' weights in bf16, the dtype autocast
# would cast them to anyway, so half the bytes cross between GPUs and no product casts its
# weight; the norms' weights stay fp32 with the embeddings in the model's own group, as
# autocast keeps the norms in fp32, and the gradients are reduced in fp32. The last block
# stays gathered from its forward to its backward, which starts with it, and PyTorch's
# fused AdamW steps the shards (``stepkernels.models.distributed``).
#
# Two things are ours to decide. Every step's batch is drawn once from the seed and the step,
# and process r takes its r-th slice of the rows: two GPUs run the micro-batches that one GPU
# runs with ``--grad-accum 2`` (two halves a step, each loss scaled by 1/2, the gradients
# summed). And each micro-batch draws its dropout masks from the seeds of its place in the
# step, so the masks match too; DDP must then leave each process's seeds alone instead of
# copying rank 0's at every forward. On a CPU, ``tests/test_distributed.py`` runs both on gloo
# and ends with the same parameters, bit for bit under DDP. The whole-step CUDA graph stays
# on one GPU: it would record DDP's all-reduce inside the graph, which PyTorch supports only
# with care we have not tested, so across GPUs the step runs eager.
#
# The recording: GPT-2 small's shape (``--config gpt2-small``), 32 sequences of 1,024 a step,
# on one GPU in two micro-batches and on two GPUs of 16 sequences each, 300 steps from one
# seed (``lab/data_parallel.py``). Each process of a DDP run does what one micro-batch of the
# one-GPU run does, so "one GPU, eager" is the fair pace for two GPUs to double; the one-GPU
# whole-step graph is the pace they must beat to be worth a second GPU.

parallel = bench.load_recorded("gpt-data-parallel")
if parallel is None:
    print("not recorded yet: lab/data_parallel.py --record writes it, on 2 GPUs")
else:
    points, env = parallel
    losses = bench.load_recorded("gpt-data-parallel-loss")
    by_tokens = sorted(losses[0] if losses else [], key=lambda p: p.x)
    last_loss = {p.provider: p.value for p in by_tokens}  # each run's last evaluation
    speed = {p.provider: p.value for p in points}
    eager = speed["1 GPU, grad-accum 2"]
    graph = speed.get("1 GPU, grad-accum 2, CUDA graph")
    print(f"{'run':>30}: val loss | tokens/s | x one GPU eager | x one GPU graph")
    for run, loss in last_loss.items():
        rate = speed.get(run)
        shown = f" | {rate:>8,.0f} | {rate / eager:>15.2f}" if rate else ""
        shown += f" | {rate / graph:>15.2f}" if rate and graph else ""
        print(f"{run:>30}: {loss:>8.4f}{shown}")
    print(f"recorded on {env.get('gpus', 1)} x {bench.describe(env)}")
    one = last_loss["1 GPU, grad-accum 2"]
    for run in ("2 GPUs, DDP", "2 GPUs, FSDP2"):
        if run in last_loss and run in speed:
            print(
                f"{run}: {speed[run] / eager:.2f}x one GPU eager, validation loss "
                f"{last_loss[run] - one:+.4f} from one GPU's at the same step"
            )
    if "2 GPUs, FSDP2" in speed:
        ratio = speed["2 GPUs, FSDP2"] / speed["2 GPUs, DDP"]
        print(f"FSDP2 runs at {ratio:.2f}x DDP's tokens/s")

# %%
# The losses agree: two processes train the steps one GPU trains with ``--grad-accum 2``
# (the fp32 test checks the parameters, not only the loss), and a checkpoint written by two
# processes resumes on one. The speed is the open part, and the last column says whether a
# second GPU pays at all. Across processes the step runs eager (or compiled), and at this
# size our eager step is paced by the CPU's launches (chapter 08): what two GPUs save in GPU
# time, one GPU's whole-step graph saves in CPU time, so DDP must be compared with that graph,
# not only with one GPU eager. FSDP2 gathers each block's weights before its forward and
# again before its backward, reduce-scatters its gradients, and runs AdamW over its sharded
# tensors (PyTorch's AdamW; ours takes plain tensors); which of these costs its time is not
# measured yet. ``lab/NOTES.md`` lists what to measure next.

# %%
# What we learned
# ---------------
# * A model's shape is one object: every module reads what it needs from ``GPTConfig``, and a
#   shape our kernels cannot run is refused before a parameter exists.
# * A model built from tested kernels still needs its own check: one set of parameters, two
#   sets of layers, equal in fp32 at initialization and at every step of a short run.
# * Autocast is a policy we can write down: products in bf16, norms and losses in fp32, weights
#   cast per call. Our layers follow it by hand and match PyTorch's curve.
# * Randomness that a CUDA graph can replay lives in GPU memory and advances inside the graph.
# * For a small model, launches decide the speed: the CUDA graph, not the kernels, made the
#   step faster than eager PyTorch and ``torch.compile``; at the GPU, the two sets of layers
#   were even.
#
# Exercises
# ---------
# 1. Our norms write fp32, which the model then casts to bf16 for the next product: a second
#    pass over 16,384 x 384 values, twice a block. Let chapter 03's kernel write the output in
#    the product's dtype and measure the step's time and memory.
# 2. The weight gradients dW = dZᵀ X reduce 16,384 tokens into outputs of 384 x 384 to
#    1,536 x 384: a few dozen tiles for 132 SMs. On Hopper chapter 07's kernel splits them
#    along K; off Hopper they run on chapter 04's kernel, unsplit. Add split-K there and
#    compare with cuBLAS (``STEPKERNELS_DEVICE_PROFILE=sm80`` takes that path on an H100).
# 3. Drop attention probabilities as nanoGPT does, inside chapter 11's forward, with chapter
#    06's ``keep_mask`` keyed by (seed, head, query, key); the backward regenerates the mask.
# 4. Evaluation runs eagerly beside the graph, in the allocator's other pool. Record it as a
#    second graph sharing the training graph's pool (``torch.cuda.graph(..., pool=...)``) and
#    measure the peak memory of a run with evaluations.
# 5. Train ``--config gpt2-small`` for 500 steps and compare its MFU with the Shakespeare
#    model's: how much of the gap do wider products (K = 768) and a longer context close?
