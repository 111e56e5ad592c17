"""models.gpt: the code of chapter 12, A GPT trained on our kernels."""

# Generated from tutorials/12-gpt.py by tools/export.py: edit the chapter, then `make export`.

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
