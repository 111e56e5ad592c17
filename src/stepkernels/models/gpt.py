"""models.gpt: the code of chapter 12, A GPT trained on our kernels."""

# Generated from tutorials/12-gpt.py by tools/export.py: edit the chapter, then `make export`.

import math

from stepkernels.ops.attention import attention
from stepkernels.ops.cross_entropy import cross_entropy
from stepkernels.ops.dropout import dropout, dropout_bias_act
from stepkernels.ops.layer_norm import layer_norm
from stepkernels.ops.linear import linear
from stepkernels.runtime.arguments import classes_in_range, sampling_arguments
import torch
from torch import nn
import torch.nn.functional as F


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs products in on x's device, else x's own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class TorchLayers:
    """Each layer as PyTorch computes it: the reference, and the baseline we race."""

    def norm(self, x, norm):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    def linear(self, x, layer, activation=None, p=0.0, seed=None):
        y = F.linear(x, layer.weight, getattr(layer, "bias", None))
        y = F.gelu(y) if activation == "gelu" else y
        return F.dropout(y, p) if p > 0 else y

    def dropout(self, x, p, seed):
        return F.dropout(x, p) if p > 0 else x

    def attention(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def loss(self, logits, targets):
        return F.cross_entropy(logits.float(), targets.long())  # int32 too, as ours


class TritonLayers:
    """The same layers on the collection's kernels. Under autocast, as PyTorch does: norms and
    the loss in fp32, products in the autocast dtype (weights cast per call)."""

    def norm(self, x, norm):  # chapter 03
        y = layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        return y.to(compute_dtype(x))

    def linear(self, x, layer, activation=None, p=0.0, seed=None):  # chapters 05, 06
        dtype = compute_dtype(x)
        weight, bias = layer.weight.to(dtype), getattr(layer, "bias", None)
        bias = None if bias is None else bias.to(dtype)
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

    def attention(self, q, k, v):  # chapter 11
        return attention(q, k, v, causal=True)

    def loss(self, logits, targets):  # chapter 09
        return cross_entropy(logits.float(), targets)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.norm_1, self.norm_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.attn_out = nn.Linear(n_embd, n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x, layers, seeds):
        batch, time, width = x.shape
        p = self.dropout if self.training else 0.0
        qkv = layers.linear(layers.norm(x, self.norm_1), self.qkv)
        # (B, T, 3, H, D) viewed as three (B, H, T, D): strided views, no copies
        heads = qkv.view(batch, time, 3, self.n_head, width // self.n_head)
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)
        y = layers.attention(q, k, v).transpose(1, 2).reshape(batch, time, width)
        x = x + layers.linear(y, self.attn_out, p=p, seed=seeds[0])
        h = layers.linear(layers.norm(x, self.norm_2), self.fc, activation="gelu")
        return x + layers.linear(h, self.fc_out, p=p, seed=seeds[1])


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2's layout) whose layers run on our kernels
    (``use_triton=True``) or on PyTorch's, with one set of parameters for both."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0,
                 use_triton=True):  # fmt: skip
        super().__init__()
        if n_head < 1 or n_embd % n_head:
            raise ValueError(
                f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.block_size, self.dropout, self.use_triton = block_size, dropout, use_triton
        self.tokens = nn.Embedding(vocab_size, n_embd)
        self.positions = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, dropout) for _ in range(n_layer)
        )
        self.norm = nn.LayerNorm(n_embd)
        # Dropout seeds live on the device and advance inside the step, so a CUDA graph of
        # the step draws new masks at every replay (chapter 06). One per dropout site.
        sites = 1 + 2 * n_layer
        first = torch.randint(2**62, (), dtype=torch.int64)
        self.register_buffer("seeds", first + torch.arange(sites), persistent=False)
        self.apply(self.init_weights)
        for name, param in self.named_parameters():  # GPT-2: residual outputs scaled
            if name.endswith(("attn_out.weight", "fc_out.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab) for token ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when given, else None. A target outside the vocabulary
        (other than -100, ignored) is an error on both layers: a ValueError for CPU tensors,
        checked first; on a GPU a device-side assert in the loss, ours or PyTorch's."""
        check_tokens(idx, targets, self.block_size, self.tokens.num_embeddings)
        layers = TritonLayers() if self.use_triton else TorchLayers()
        p = self.dropout if self.training else 0.0
        seeds = self.seeds.add_(len(self.seeds)) if p > 0 and self.use_triton else None
        site = (lambda i: seeds[i]) if seeds is not None else (lambda i: None)
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = layers.dropout(self.tokens(idx) + self.positions(positions), p, site(0))
        for i, block in enumerate(self.blocks):
            x = block(x, layers, (site(1 + 2 * i), site(2 + 2 * i)))
        # The output layer is the token embedding's matrix (GPT-2's weight tying).
        logits = layers.linear(layers.norm(x, self.norm), self.tokens)
        if targets is None:
            return logits, None
        flat = logits.view(-1, logits.shape[-1])
        return logits, layers.loss(flat, targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx, new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend each row of ``idx`` (B, T) by ``new_tokens`` sampled one at a time."""
        # a prompt of at least one token, as long as it likes
        check_tokens(idx, None, vocab_size=self.tokens.num_embeddings)
        sampling_arguments(new_tokens, temperature, top_k)
        for _ in range(new_tokens):
            context = idx[:, -self.block_size :]
            length = context.shape[1]
            # Always a full context: one shape, so one autotuned launch per product. The
            # causal mask keeps the padding after the last token from changing its logits.
            context = F.pad(context, (0, self.block_size - length))
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
        raise ValueError(f"idx must be (batch, time) token ids, 1 <= time{limit}, got "
                         f"shape {tuple(idx.shape)}{hint}")  # fmt: skip
    if targets is not None and targets.shape != idx.shape:
        raise ValueError(f"targets must match idx's shape {tuple(idx.shape)}, got "
                         f"{tuple(targets.shape)}")  # fmt: skip
    if vocab_size is not None:
        classes_in_range(idx, vocab_size, "idx")
        if targets is not None:
            classes_in_range(targets, vocab_size, "targets", ignore_index=-100)
