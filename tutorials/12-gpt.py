r"""
A GPT trained on our kernels
============================

We assemble a small GPT from the collection's kernels, train it on Shakespeare's plays, and race
it against the same model on PyTorch's layers: the same parameters, data and loss.

What you will learn:

* where each kernel of chapters 03 to 11 sits in a transformer, forward and backward;
* checking a whole model against a reference: one set of parameters, two sets of layers;
* mixed precision by hand: what autocast does for PyTorch's layers, done explicitly for ours;
* dropout in a step replayed from a CUDA graph: seeds that live on the GPU;
* what decides a small model's speed once its kernels are fast: launches, and the work between.

Prerequisites: chapters 03 (layer norm), 05 (fused linear), 06 (dropout), 08 (CUDA graphs),
09 (cross-entropy) and 11 (attention).
"""

# %%
# Setup
# -----

import dataclasses
import functools
import gc

import matplotlib.pyplot as plt
from stepkernels.lessons import bench, training, tutorial
from stepkernels.models import train
from stepkernels.models.data import load_shakespeare
import torch

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# The model and what a step costs
# -------------------------------
# nanoGPT's character-level Shakespeare model is our target: 6 blocks of width C = 384 with 6
# heads, a context of T = 256 characters, batches of 64 sequences (16,384 tokens a step). Each
# block normalizes, attends, normalizes again and runs a two-layer MLP of width 4C, each with a
# residual connection; the output layer reuses the token embedding's matrix.
#
# A training step's FLOPs are those of its matrix products: 6 per weight per token (2 in the
# forward, 4 in the backward, chapter 05), and attention's 4 T C per token and layer for the
# forward, halved by the causal mask and 3.5 times that with its backward (chapter 11). The
# norms, GELU, dropout, residual additions and the loss move bytes but add no products. The
# H100's bf16 tensor cores would finish a step's products in a few milliseconds; at these thin
# shapes (every product has K = 384 or 1,536) cuBLAS itself gets only part of that, so the limit
# we draw is measured: the step's products alone, at cuBLAS's speed.

# nanoGPT's shakespeare_char, configured on one screen in stepkernels/train.py
FULL = train.Config()
TOKENS_PER_STEP = FULL.batch_size * FULL.block_size


def flops_per_token(cfg, vocab_size):
    C, L, T = cfg.n_embd, cfg.n_layer, cfg.block_size
    matrices = L * 12 * C * C + vocab_size * C  # qkv 3C², out C², MLP 8C², output layer
    return 6 * matrices + L * 3.5 * 2 * T * C  # attention: 4 T C / 2, times 3.5


data = load_shakespeare()
print(f"{data.vocab_size} characters; {len(data.train):,} training and {len(data.val):,} "
      f"validation tokens from {data.path}")  # fmt: skip
work = flops_per_token(FULL, data.vocab_size) * TOKENS_PER_STEP
print(f"one step of {TOKENS_PER_STEP:,} tokens: {work / 1e12:.2f} TFLOP")

# %%
# The layers, twice
# -----------------
# Every layer is written twice over the same parameters. ``TorchLayers`` is PyTorch's version,
# the reference and the baseline; ``TritonLayers`` calls our kernels:
#
# * layer norm, before attention, before the MLP and at the end: ``layer_norm`` (chapter 03);
# * q, k, v and the MLP's first layer with its GELU: ``linear``, one kernel (chapter 05);
# * the projections back to the residual stream: ``linear``, then the bias and dropout in
#   ``dropout_bias_act`` (chapters 05 and 06); the embeddings' dropout: ``dropout``;
# * causal attention: ``attention`` (chapter 11); the loss: ``cross_entropy`` (chapter 09).
#
# Embedding lookups and residual additions stay PyTorch's in both. nanoGPT also drops
# attention probabilities; our attention kernel has no dropout, so neither version does.
#
# Under ``torch.autocast``, PyTorch runs matrix products in bf16 and norms and losses in fp32,
# casting each operand as it goes, while the residual stream stays fp32. Our functions take
# what they are given (one dtype per call, chapter 05), so ``TritonLayers`` does autocast's work
# itself: it casts the weights and the normalized activations to the autocast dtype before each
# product, and gives the loss fp32 logits. Outside autocast everything stays fp32, which is how
# we compare the two exactly.

# @save models/gpt
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


# %%
# A block and the model
# ---------------------
# ``Block`` and ``GPT`` never name a kernel: they ask ``layers`` for each step, so one flag,
# ``use_triton``, switches the whole model, and one ``state_dict`` serves both. The attention's
# q, k and v are strided views of one (B, T, 3, H, D) product, which chapter 11's descriptors
# read in place; its output comes back in q's layout, so the projection reads it as a view.
#
# Dropout is the one layer with state. Chapter 06's masks are a function of a seed and the
# element's position; a seed drawn on the CPU would be frozen into a CUDA graph (chapter 08),
# and every replayed step would drop the same elements. So the model keeps its seeds in a
# buffer on the GPU, one per dropout site, and advances them inside ``forward``: the addition
# is itself a kernel in the graph, and the kernels read their seed from memory when they run.


# @save models/gpt
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


# %%
# One set of parameters, two sets of layers
# -----------------------------------------
# The first check of a model built from new kernels: at initialization, in fp32 (no tf32 on a
# GPU), both versions must give the same logits, loss and gradient of every parameter. Each
# kernel was tested alone; this checks the wiring: the views, the weight tying, the casts.

SMALL = train.Config(
    n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=2, dropout=0.0
)
check_cfg = FULL if tutorial.ON_GPU else SMALL
torch.manual_seed(0)
model = GPT(data.vocab_size, check_cfg.block_size, check_cfg.n_layer, check_cfg.n_head,
            check_cfg.n_embd).to(DEVICE)  # fmt: skip
starts = torch.randint(len(data.train) - check_cfg.block_size - 1, (4,)).tolist()
rows = torch.stack(
    [data.train[i : i + check_cfg.block_size + 1] for i in starts]
).long()
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
(ours, our_loss, our_grads), (theirs, their_loss, their_grads) = (
    results[True],
    results[False],
)
gaps = {n: (g - their_grads[n]).abs().max().item() for n, g in our_grads.items()}
worst = max(gaps, key=gaps.get)
print(f"loss {our_loss.item():.6f} (ours), {their_loss.item():.6f} (PyTorch's); largest "
      f"difference of logits {(ours - theirs).abs().max().item():.1e}, of gradients "
      f"{gaps[worst]:.1e} ({worst})")  # fmt: skip
torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
for name, grad in our_grads.items():
    torch.testing.assert_close(grad, their_grads[name], rtol=1e-3, atol=1e-5, msg=name)

# %%
# Training
# --------
# ``stepkernels/train.py`` holds the rest, nanoGPT's recipe: AdamW (weight decay on matrices
# only, beta2 = 0.99), 100 steps of warm-up to a learning rate of 1e-3, cosine decay to 1e-4 at
# 5,000 steps, gradients clipped to norm 1, dropout 0.2. Every batch is a function of the seed
# and the step, so both versions see the same data. ``python -m stepkernels.train`` runs it,
# every field of its ``Config`` an option; it logs, evaluates, checkpoints, resumes and samples.
#
# On a GPU the step runs in bf16 under autocast, and ``step="graph"`` records all of it as one
# CUDA graph: the batch gathered from the text on the GPU, forward, backward, clipping and
# AdamW (``fused=True, capturable=True``, the learning rate in a tensor the loop refills).
# Three steps run first on a side stream, to compile, autotune and allocate; the fourth is
# recorded, and every later step is one ``replay()``. The loss is read back every 50 steps.
#
# Here, six steps of the small model in fp32, both versions from the same seed: the loss must
# fall, and the two must agree at every step.

losses = {}
for use_triton in (True, False):
    cfg = dataclasses.replace(SMALL, use_triton=use_triton, max_steps=6, learning_rate=1e-2,
                              warmup_steps=1, log_interval=1, eval_interval=0, eval_batches=1,
                              step="eager", dtype="float32", checkpoint=False,
                              sample_tokens=0)  # fmt: skip
    trainer = train.Trainer(cfg, data)
    trainer.train(log=lambda line: None)
    losses[use_triton] = [loss for _, loss in trainer.losses]
for step, (a, b) in enumerate(zip(losses[True], losses[False], strict=True), start=1):
    print(f"step {step}: loss {a:.6f} (ours), {b:.6f} (PyTorch's)")
assert losses[True][-1] < losses[True][0], "the small model should learn"
torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=1e-4)

# %%
# Benchmark: training throughput
# ------------------------------
# Each version trains the full model for 300 steps in bf16; the first 50 (compilation,
# autotuning, the graph's recording) are not timed. ``torch`` is PyTorch eager (SDPA picks
# cuDNN's attention on the H100), ``torch.compile`` the model compiled (the optimizer stays
# eager), ``+ CUDA graph`` the whole step replayed as above, for either set of layers. The
# limit, ``products alone``, is a step that would be only its matrix products, at cuBLAS's
# speed. Memory is the most the allocator held once warm: a graph's private pool included.

RACE = {  # provider: (use_triton, step)
    "torch": (False, "eager"),
    "torch.compile": (False, "compile"),
    "torch + CUDA graph": (False, "graph"),
    "triton": (True, "eager"),
    "triton + CUDA graph": (True, "graph"),
}
LIMIT = "products alone (cuBLAS)"


@functools.cache
def race():
    """Points of tokens per second and of peak memory (GiB), one per provider."""
    speed, memory = [], []
    for provider, (use_triton, step) in RACE.items():
        cfg = dataclasses.replace(FULL, use_triton=use_triton, step=step, max_steps=300,
                                  eval_interval=0, eval_batches=1, checkpoint=False,
                                  sample_tokens=0)  # fmt: skip
        torch._dynamo.reset()
        run = train.Trainer(cfg, data).train(log=lambda line: None)
        for points, value in (
            (speed, run["tokens_per_s"]),
            (memory, run["peak_memory_gib"]),
        ):
            points.append(bench.Point(provider, "bfloat16", TOKENS_PER_STEP, value))
        gc.collect(), torch.cuda.empty_cache()
    limit = training.products_alone(FULL, data.vocab_size)
    return [*speed, bench.Point(LIMIT, "bfloat16", TOKENS_PER_STEP, limit)], memory


def measured(name, unit, points_of, x_name, providers, draw=True):
    board = bench.Benchmark(name=name, x_name=x_name, x_values=[TOKENS_PER_STEP],
                            providers=providers, make=None, work=None, unit=unit,
                            dtypes=(torch.bfloat16,),
                            x_labels={TOKENS_PER_STEP: "nanoGPT's Shakespeare model"})  # fmt: skip
    return bench.run(board, points_of, draw=draw)


STEP = "tokens per step (64 sequences of 256)"
speed = measured(
    "gpt-training-throughput", "tokens/s", lambda: race()[0], STEP, [*RACE, LIMIT]
)
memory = measured(
    "gpt-training-memory", bench.MEMORY_UNIT, lambda: race()[1], STEP, [*RACE]
)
if speed and memory:
    at = dict(x=TOKENS_PER_STEP, dtype="bfloat16")
    print(f"training throughput and memory, {speed.how}:")
    for provider in RACE:
        rate = speed.value(provider, **at)
        tflops = rate * work / TOKENS_PER_STEP / 1e12
        print(f"{provider:>19}: {rate:>9,.0f} tokens/s ({tflops:5.1f} TFLOP/s), "
              f"{rate / speed.value('torch', **at):.2f}x eager torch, "
              f"{rate / speed.value('torch.compile', **at):.2f}x torch.compile, "
              f"{memory.value(provider, **at):.2f} GiB")  # fmt: skip
    print(f"{LIMIT}: {speed.value(LIMIT, **at):,.0f} tokens/s")
    ours, eager = (memory.value(p, **at) for p in ("triton + CUDA graph", "torch"))
    print(f"peak memory of ours replayed / eager torch: {ours / eager:.2f}")

# %%
# Eager, our model is the slowest: its step makes a few hundred calls, each dearer on the CPU
# than PyTorch's (chapter 08 measured why), and the CPU sets the pace. Replayed from a CUDA
# graph, the CPU drops out and the GPU's time is what remains; there our layers and PyTorch's
# run at nearly the same speed, ahead of eager PyTorch and of ``torch.compile``, whose default
# mode fuses the work between products but still launches each kernel from the CPU, the
# optimizer eager. The two graphs' parity says the lead is the graph's, not our kernels': over
# a step, our fused norms, GELU and dropout win back what our products lose to cuBLAS on thin
# shapes (the results' notes hold a profile). Both are far from the limit: this model's step
# is mostly memory-bound work between its products, in small launches.
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
# the same 20 validation batches; the plot shows it against the tokens seen.

FULL_RUNS = {"torch": (False, "eager"), "triton + CUDA graph": (True, "graph")}
TARGET_LOSS = 1.5


@functools.cache
def full_runs():
    runs = {}
    for provider, (use_triton, step) in FULL_RUNS.items():
        cfg = dataclasses.replace(
            FULL, use_triton=use_triton, step=step, checkpoint=False
        )
        runs[provider] = train.Trainer(cfg, data).train()
        gc.collect(), torch.cuda.empty_cache()
    return runs


def curve(key):
    return [bench.Point(provider, "bfloat16", row["tokens"], row[key])
            for provider, run in full_runs().items() for row in run["history"]]  # fmt: skip


validation = measured("gpt-validation-loss", "validation loss", lambda: curve("val_loss"),
                      "tokens seen", list(FULL_RUNS), draw=False)  # fmt: skip
seconds = measured("gpt-training-time", "s since the start", lambda: curve("seconds"),
                   "tokens seen", list(FULL_RUNS), draw=False)  # fmt: skip
if validation and seconds:
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    ends, colors = {}, bench.provider_colors([*RACE, LIMIT])  # the race's colors
    for provider in validation.providers():
        rows = sorted(
            (p.x, p.value) for p in validation.points if p.provider == provider
        )
        times = {p.x: p.value for p in seconds.points if p.provider == provider}
        ax.plot([x / 1e6 for x, _ in rows], [v for _, v in rows], marker="o", ms=3,
                label=provider, color=colors[provider])  # fmt: skip
        reached = next((x for x, loss in rows if loss <= TARGET_LOSS), None)
        ends[provider] = rows[-1][1]
        first = (
            "never"
            if reached is None
            else (
                f"first measured after {times[reached]:.0f} s ({reached / 1e6:.1f}M tokens)"
            )
        )
        print(
            f"{provider:>19}: validation loss {rows[-1][1]:.4f} after "
            f"{times[rows[-1][0]]:.0f} s; {TARGET_LOSS} {first}"
        )
    ax.axhline(TARGET_LOSS, ls="--", lw=1, color="0.35")
    ax.set(xlabel="million tokens seen", ylabel="validation loss", ylim=(1.0, 3.0))
    ax.grid(alpha=0.3), ax.legend()
    fig.suptitle(f"gpt-validation-loss:\n{validation.how}", fontsize=9)
    print(
        f"final losses differ by {abs(ends['torch'] - ends['triton + CUDA graph']):.4f}"
    )
    sample = full_runs()["triton + CUDA graph"]["sample"] if validation.live else None
    print(f"sampled from our model after the full run, {validation.how}:\n"
          f"{bench.text_file('gpt-sample.txt', sample)}")  # fmt: skip

# %%
# The two curves lie on each other: the same model, trained by different kernels, within
# rounding and dropout's different random numbers. The validation loss passes 1.5 within the
# first minute of either run and keeps falling: the complete plays are four times nanoGPT's
# tiny Shakespeare, so 5,000 steps do not overfit them.
#
# What we learned
# ---------------
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
#    1,536 x 384: a few dozen tiles for 132 SMs. Add split-K to chapter 04's matmul for such
#    shapes and compare with cuBLAS (``TORCH_LOGS`` or the profiler names its split-K kernels).
# 3. Drop attention probabilities as nanoGPT does, inside chapter 11's forward, with chapter
#    06's ``keep_mask`` keyed by (seed, head, query, key); the backward regenerates the mask.
# 4. Evaluation runs eagerly beside the graph, in the allocator's other pool. Record it as a
#    second graph sharing the training graph's pool (``torch.cuda.graph(..., pool=...)``) and
#    measure the peak memory of a run with evaluations.
