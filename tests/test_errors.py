"""Every public function refuses each kind of mistake with one error type, raised by our own
checks before any kernel runs, and its message names the argument (issue 46).

TypeError: a wrong type (not a tensor, not a bool, a str for a number) or a wrong dtype,
mismatched dtypes included. ValueError: a wrong value or shape (or device: the kernels run on
one). Out-of-range targets of the three losses are a ValueError on CPU tensors, where the
check is cheap; on a GPU the kernel traps instead (a device-side assert, as PyTorch's)."""

import linecache
from pathlib import Path
import re
import subprocess
import sys

from conftest import random_tensor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
import pytest
import stepkernels
from stepkernels import (
    GPT,
    Dropout,
    DropoutBiasAct,
    FusedAdamW,
    FusedLinear,
    GPTConfig,
    LayerNorm,
    RMSNorm,
    add,
    add_layer_norm,
    attention,
    cross_entropy,
    dropout,
    dropout_bias_act,
    layer_norm,
    linear,
    linear_cross_entropy,
    log_softmax,
    matmul,
    rms_norm,
    rotary_embedding,
    rotary_embedding_qk,
    silu_mul,
    softmax,
    varlen_attention,
)
from stepkernels.runtime.activations import activation_reference
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch
import torch.nn.functional as F

PACKAGE = Path(stepkernels.__file__).resolve().parent
OTHER_DEVICE = "meta"  # a device the kernels never run on, here and on a GPU

x = random_tensor((4, 8))
w = random_tensor((6, 8), seed=1)  # (out_features, in_features)
b = random_tensor((6,), seed=2)
col = random_tensor((8, 6), seed=3)  # (K, N) for matmul
feature_bias = random_tensor((8,), seed=4)
q = random_tensor((1, 2, 4, 16), seed=5)
packed = random_tensor((6, 2, 16), seed=10)  # (total, heads, head_dim): sequences of 2 and 4
starts = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
logits = random_tensor((4, 6), seed=6)
target = torch.tensor([0, 5, 2, -100], device=DEVICE)
seed_tensor = torch.tensor(7, device=DEVICE)
cos, sin = random_tensor((4, 16), seed=8), random_tensor((4, 16), seed=9)  # for q's (N, D)


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(11, 8, 1, 2, 16)).to(DEVICE)


idx = torch.tensor([[1, 2, 3, 4]], device=DEVICE)

# (function, kind of mistake, call, error, the argument its message must name)
CASES = [
    # softmax and log_softmax (chapter 02)
    ("softmax", "wrong dtype", lambda: softmax(x.int()), TypeError, "x"),
    ("softmax", "wrong dtype", lambda: softmax(x.double()), TypeError, "x"),
    ("softmax", "wrong device", lambda: softmax(x.to(OTHER_DEVICE)), ValueError, "x"),
    ("softmax", "wrong shape", lambda: softmax(x[0, 0]), ValueError, "x"),
    ("softmax", "not a tensor", lambda: softmax([1.0, 2.0]), TypeError, "x"),
    ("softmax", "bad scalar (type)", lambda: softmax(x, 1.0), TypeError, "dim"),
    ("softmax", "bad scalar (type)", lambda: softmax(x, dim="1"), TypeError, "dim"),
    ("softmax", "bad scalar (type)", lambda: softmax(x, dim=None), TypeError, "dim"),
    ("softmax", "bad scalar (type)", lambda: softmax(x, log="False"), TypeError, "log"),
    ("softmax", "bad scalar (value)", lambda: softmax(x, 2), ValueError, "dim"),
    ("softmax", "bad scalar (value)", lambda: softmax(x, dim=-3), ValueError, "dim"),
    ("log_softmax", "wrong dtype", lambda: log_softmax(x.bool()), TypeError, "x"),
    ("log_softmax", "wrong device", lambda: log_softmax(x.to(OTHER_DEVICE)), ValueError, "x"),
    ("log_softmax", "wrong shape", lambda: log_softmax(x[0, 0]), ValueError, "x"),
    ("log_softmax", "not a tensor", lambda: log_softmax(3.0), TypeError, "x"),
    ("log_softmax", "bad scalar (type)", lambda: log_softmax(x, 0.5), TypeError, "dim"),
    ("log_softmax", "bad scalar (value)", lambda: log_softmax(x, dim=5), ValueError, "dim"),
    # layer_norm and LayerNorm (chapter 03)
    ("layer_norm", "wrong dtype", lambda: layer_norm(x.double(), (8,)), TypeError, "x"),
    ("layer_norm", "mismatched dtypes", lambda: layer_norm(x, (8,), feature_bias.half()), TypeError, "weight"),
    ("layer_norm", "mismatched dtypes", lambda: layer_norm(x, (8,), None, feature_bias.half()), TypeError, "bias"),
    ("layer_norm", "wrong device", lambda: layer_norm(x, (8,), feature_bias.to(OTHER_DEVICE)), ValueError, "weight"),
    ("layer_norm", "wrong shape", lambda: layer_norm(x, (7,)), ValueError, "normalized_shape"),
    ("layer_norm", "wrong shape", lambda: layer_norm(x, (8,), feature_bias[:7]), ValueError, "weight"),
    ("layer_norm", "not a tensor", lambda: layer_norm(x.tolist(), (8,)), TypeError, "x"),
    ("layer_norm", "not a tensor", lambda: layer_norm(x, (8,), [1.0] * 8), TypeError, "weight"),
    ("layer_norm", "bad scalar (type)", lambda: layer_norm(x, (8.0,)), TypeError, "normalized_shape"),
    ("layer_norm", "bad scalar (type)", lambda: layer_norm(x, (8,), eps="1e-5"), TypeError, "eps"),
    ("layer_norm", "bad scalar (type)", lambda: layer_norm(x, (8,), reduction=2), TypeError, "reduction"),
    ("layer_norm", "bad scalar (type)", lambda: layer_norm(x, (8,), block_size=16.0), TypeError, "block_size"),
    ("layer_norm", "bad scalar (value)", lambda: layer_norm(x, (8,), eps=-1.0), ValueError, "eps"),
    ("layer_norm", "bad scalar (value)", lambda: layer_norm(x, (8,), reduction="atomic"), ValueError, "reduction"),
    ("layer_norm", "bad scalar (value)", lambda: layer_norm(x, (8,), block_size=12), ValueError, "block_size"),
    ("LayerNorm", "wrong dtype", lambda: LayerNorm(8, device=DEVICE)(x.int()), TypeError, "x"),
    ("LayerNorm", "bad scalar (value)", lambda: LayerNorm(8, reduction="atomic"), ValueError, "reduction"),
    # matmul (chapter 04)
    ("matmul", "wrong dtype", lambda: matmul(x.double(), col.double()), TypeError, "a"),
    ("matmul", "mismatched dtypes", lambda: matmul(x, col.half()), TypeError, "b"),
    ("matmul", "wrong device", lambda: matmul(x, col.to(OTHER_DEVICE)), ValueError, "b"),
    ("matmul", "wrong shape", lambda: matmul(x, col[:7]), ValueError, "b"),
    ("matmul", "wrong shape", lambda: matmul(x[0], col), ValueError, "a"),
    ("matmul", "wrong shape", lambda: matmul(x, col, bias=b[:5]), ValueError, "bias"),
    ("matmul", "wrong shape", lambda: matmul(x, col, accumulate=torch.zeros_like(x)), ValueError, "accumulate"),
    ("matmul", "not a tensor", lambda: matmul(x.tolist(), col), TypeError, "a"),
    ("matmul", "bad scalar (type)", lambda: matmul(x, col, 1), TypeError, "activation"),
    (
        "matmul",
        "bad scalar (type)",
        lambda: matmul(x, col, return_preactivation="no"),
        TypeError,
        "return_preactivation",
    ),
    ("matmul", "bad scalar (value)", lambda: matmul(x, col, "tanh"), ValueError, "activation"),
    # linear and FusedLinear (chapter 05)
    ("linear", "wrong dtype", lambda: linear(x.int(), w), TypeError, "x"),
    ("linear", "mismatched dtypes", lambda: linear(x, w.half()), TypeError, "weight"),
    ("linear", "mismatched dtypes", lambda: linear(x, w, b.half()), TypeError, "bias"),
    ("linear", "wrong device", lambda: linear(x, w.to(OTHER_DEVICE)), ValueError, "weight"),
    ("linear", "wrong shape", lambda: linear(x, w.T), ValueError, "weight"),
    ("linear", "wrong shape", lambda: linear(x, w, b[:5]), ValueError, "bias"),
    ("linear", "not a tensor", lambda: linear(x, w.tolist()), TypeError, "weight"),
    ("linear", "bad scalar (type)", lambda: linear(x, w, None, 3), TypeError, "activation"),
    ("linear", "bad scalar (type)", lambda: linear(x, w, recompute="no"), TypeError, "recompute"),
    ("linear", "bad scalar (value)", lambda: linear(x, w, None, "tanh"), ValueError, "activation"),
    ("FusedLinear", "wrong dtype", lambda: FusedLinear(8, 6, device=DEVICE)(x.double()), TypeError, "x"),
    ("FusedLinear", "bad scalar (value)", lambda: FusedLinear(8, 6, activation="tanh"), ValueError, "activation"),
    ("FusedLinear", "bad scalar (type)", lambda: FusedLinear(8, 6, recompute="no"), TypeError, "recompute"),
    # dropout, Dropout, dropout_bias_act and DropoutBiasAct (chapter 06)
    ("dropout", "wrong dtype", lambda: dropout(x.int(), 0.5, 1), TypeError, "x"),
    ("dropout", "wrong dtype", lambda: dropout(x, 0.5, torch.tensor(True, device=DEVICE)), TypeError, "seed"),
    ("dropout", "wrong device", lambda: dropout(x, 0.5, seed_tensor.to(OTHER_DEVICE)), ValueError, "seed"),
    ("dropout", "wrong shape", lambda: dropout(x, 0.5, seed_tensor.repeat(2)), ValueError, "seed"),
    ("dropout", "not a tensor", lambda: dropout(x.tolist(), 0.5, 1), TypeError, "x"),
    ("dropout", "bad scalar (type)", lambda: dropout(x, "0.5", 1), TypeError, "p"),
    ("dropout", "bad scalar (type)", lambda: dropout(x, 0.5, 1.0), TypeError, "seed"),
    ("dropout", "bad scalar (type)", lambda: dropout(x, 0.5, 1, training="no"), TypeError, "training"),
    ("dropout", "bad scalar (type)", lambda: dropout(x, 0.5, 1, inplace="no"), TypeError, "inplace"),
    ("dropout", "bad scalar (value)", lambda: dropout(x, 1.5, 1), ValueError, "p"),
    ("dropout", "bad scalar (value)", lambda: dropout(x, float("nan"), 1), ValueError, "p"),
    ("dropout", "bad scalar (value)", lambda: dropout(x, 0.5, -1), ValueError, "seed"),
    ("Dropout", "bad scalar (value)", lambda: Dropout(-0.1), ValueError, "p"),
    ("Dropout", "bad scalar (type)", lambda: Dropout(0.5, inplace="no"), TypeError, "inplace"),
    (
        "dropout_bias_act",
        "wrong dtype",
        lambda: dropout_bias_act(x.int(), feature_bias, 0.5, "relu", 1),
        TypeError,
        "x",
    ),
    (
        "dropout_bias_act",
        "mismatched dtypes",
        lambda: dropout_bias_act(x, feature_bias.half(), 0.5, "relu", 1),
        TypeError,
        "bias",
    ),
    (
        "dropout_bias_act",
        "wrong device",
        lambda: dropout_bias_act(x, feature_bias.to(OTHER_DEVICE), 0.5, "relu", 1),
        ValueError,
        "bias",
    ),
    (
        "dropout_bias_act",
        "wrong shape",
        lambda: dropout_bias_act(x, feature_bias[:7], 0.5, "relu", 1),
        ValueError,
        "bias",
    ),
    (
        "dropout_bias_act",
        "not a tensor",
        lambda: dropout_bias_act(x, feature_bias.tolist(), 0.5, "relu", 1),
        TypeError,
        "bias",
    ),
    (
        "dropout_bias_act",
        "bad scalar (type)",
        lambda: dropout_bias_act(x, feature_bias, 0.5, 1, 1),
        TypeError,
        "activation",
    ),
    (
        "dropout_bias_act",
        "bad scalar (type)",
        lambda: dropout_bias_act(x, feature_bias, 0.5, "relu", 1, training="no"),
        TypeError,
        "training",
    ),
    (
        "dropout_bias_act",
        "bad scalar (value)",
        lambda: dropout_bias_act(x, feature_bias, 2.0, "relu", 1),
        ValueError,
        "p",
    ),
    ("DropoutBiasAct", "bad scalar (value)", lambda: DropoutBiasAct(8, 0.1, "swish"), ValueError, "activation"),
    ("DropoutBiasAct", "wrong dtype", lambda: DropoutBiasAct(8)(x.int()), TypeError, "x"),
    # cross_entropy and linear_cross_entropy (chapters 09, 10)
    ("cross_entropy", "wrong dtype", lambda: cross_entropy(logits.double(), target), TypeError, "logits"),
    ("cross_entropy", "wrong dtype", lambda: cross_entropy(logits, target.float()), TypeError, "target"),
    ("cross_entropy", "wrong device", lambda: cross_entropy(logits, target.to(OTHER_DEVICE)), ValueError, "target"),
    ("cross_entropy", "wrong shape", lambda: cross_entropy(logits[None], target[None]), ValueError, "logits"),
    ("cross_entropy", "wrong shape", lambda: cross_entropy(logits, target[:3]), ValueError, "target"),
    ("cross_entropy", "not a tensor", lambda: cross_entropy(logits, target.tolist()), TypeError, "target"),
    (
        "cross_entropy",
        "bad scalar (type)",
        lambda: cross_entropy(logits, target, ignore_index=1.5),
        TypeError,
        "ignore_index",
    ),
    (
        "cross_entropy",
        "bad scalar (type)",
        lambda: cross_entropy(logits, target, label_smoothing="0.1"),
        TypeError,
        "label_smoothing",
    ),
    (
        "cross_entropy",
        "bad scalar (type)",
        lambda: cross_entropy(logits, target, reduction=None),
        TypeError,
        "reduction",
    ),
    (
        "cross_entropy",
        "bad scalar (value)",
        lambda: cross_entropy(logits, target, label_smoothing=1.5),
        ValueError,
        "label_smoothing",
    ),
    (
        "cross_entropy",
        "bad scalar (value)",
        lambda: cross_entropy(logits, target, reduction="avg"),
        ValueError,
        "reduction",
    ),
    ("linear_cross_entropy", "wrong dtype", lambda: linear_cross_entropy(x.int(), w, target), TypeError, "x"),
    (
        "linear_cross_entropy",
        "mismatched dtypes",
        lambda: linear_cross_entropy(x, w.half(), target),
        TypeError,
        "weight",
    ),
    (
        "linear_cross_entropy",
        "mismatched dtypes",
        lambda: linear_cross_entropy(x, w, target, b.half()),
        TypeError,
        "bias",
    ),
    (
        "linear_cross_entropy",
        "wrong device",
        lambda: linear_cross_entropy(x, w.to(OTHER_DEVICE), target),
        ValueError,
        "weight",
    ),
    ("linear_cross_entropy", "wrong shape", lambda: linear_cross_entropy(x, w.T, target), ValueError, "weight"),
    ("linear_cross_entropy", "wrong shape", lambda: linear_cross_entropy(x, w, target[:2]), ValueError, "target"),
    ("linear_cross_entropy", "not a tensor", lambda: linear_cross_entropy(x, w, target.tolist()), TypeError, "target"),
    (
        "linear_cross_entropy",
        "bad scalar (type)",
        lambda: linear_cross_entropy(x, w, target, chunk_tokens=2.0),
        TypeError,
        "chunk_tokens",
    ),
    (
        "linear_cross_entropy",
        "bad scalar (value)",
        lambda: linear_cross_entropy(x, w, target, chunk_tokens=0),
        ValueError,
        "chunk_tokens",
    ),
    (
        "linear_cross_entropy",
        "bad scalar (value)",
        lambda: linear_cross_entropy(x, w, target, reduction="avg"),
        ValueError,
        "reduction",
    ),
    # attention (chapter 11)
    ("attention", "wrong dtype", lambda: attention(q.int(), q.int(), q.int()), TypeError, "q"),
    ("attention", "mismatched dtypes", lambda: attention(q, q.half(), q.half()), TypeError, "k"),
    ("attention", "wrong device", lambda: attention(q, q, q.to(OTHER_DEVICE)), ValueError, "v"),
    ("attention", "wrong shape", lambda: attention(q[0], q[0], q[0]), ValueError, "q"),
    ("attention", "wrong shape", lambda: attention(q, q[..., :8], q[..., :8]), ValueError, "k"),
    ("attention", "not a tensor", lambda: attention(q, q.tolist(), q), TypeError, "k"),
    ("attention", "bad scalar (type)", lambda: attention(q, q, q, causal="no"), TypeError, "causal"),
    ("attention", "bad scalar (type)", lambda: attention(q, q, q, sm_scale="0.5"), TypeError, "sm_scale"),
    ("attention", "bad scalar (value)", lambda: attention(q, q, q, sm_scale=-1.0), ValueError, "sm_scale"),
    (
        "attention",
        "wrong shape",
        lambda: attention(q, q[:, :1].repeat(1, 3, 1, 1), q[:, :1].repeat(1, 3, 1, 1)),
        ValueError,
        "k",
    ),
    ("attention", "bad scalar (type)", lambda: attention(q, q, q, causal=True, window=2.5), TypeError, "window"),
    ("attention", "bad scalar (value)", lambda: attention(q, q, q, causal=True, window=0), ValueError, "window"),
    ("attention", "bad scalar (value)", lambda: attention(q, q, q, window=3), ValueError, "window"),
    # varlen_attention (chapter 11): packed sequences
    (
        "varlen_attention",
        "wrong dtype",
        lambda: varlen_attention(packed.int(), packed, packed, starts, starts, 4, 4),
        TypeError,
        "q",
    ),
    (
        "varlen_attention",
        "mismatched dtypes",
        lambda: varlen_attention(packed, packed.half(), packed.half(), starts, starts, 4, 4),
        TypeError,
        "k",
    ),
    (
        "varlen_attention",
        "wrong device",
        lambda: varlen_attention(packed, packed, packed.to(OTHER_DEVICE), starts, starts, 4, 4),
        ValueError,
        "v",
    ),
    ("varlen_attention", "wrong shape", lambda: varlen_attention(q, q, q, starts, starts, 4, 4), ValueError, "q"),
    (
        "varlen_attention",
        "wrong shape",
        lambda: varlen_attention(packed, packed[..., :8], packed[..., :8], starts, starts, 4, 4),
        ValueError,
        "k",
    ),
    (
        "varlen_attention",
        "wrong shape",
        lambda: varlen_attention(
            packed, packed[:, :1].repeat(1, 3, 1), packed[:, :1].repeat(1, 3, 1), starts, starts, 4, 4
        ),
        ValueError,
        "k",
    ),
    (
        "varlen_attention",
        "wrong shape",
        lambda: varlen_attention(packed, packed, packed, starts, starts[:2], 4, 4),
        ValueError,
        "cu_seqlens_k",
    ),
    (
        "varlen_attention",
        "not a tensor",
        lambda: varlen_attention(packed, packed, packed, [0, 2, 6], starts, 4, 4),
        TypeError,
        "cu_seqlens_q",
    ),
    (
        "varlen_attention",
        "wrong dtype",
        lambda: varlen_attention(packed, packed, packed, starts.long(), starts, 4, 4),
        TypeError,
        "cu_seqlens_q",
    ),
    (
        "varlen_attention",
        "bad scalar (value)",
        lambda: varlen_attention(packed, packed, packed, starts, starts.flip(0), 4, 4),
        ValueError,
        "cu_seqlens_k",
    ),
    (
        "varlen_attention",
        "bad scalar (value)",
        lambda: varlen_attention(packed, packed, packed, starts, starts, 3, 4),
        ValueError,
        "max_seqlen_q",
    ),
    (
        "varlen_attention",
        "bad scalar (value)",
        lambda: varlen_attention(packed, packed, packed, starts, starts, 4, -1),
        ValueError,
        "max_seqlen_k",
    ),
    (
        "varlen_attention",
        "bad scalar (type)",
        lambda: varlen_attention(packed, packed, packed, starts, starts, 4.0, 4),
        TypeError,
        "max_seqlen_q",
    ),
    (
        "varlen_attention",
        "bad scalar (type)",
        lambda: varlen_attention(packed, packed, packed, starts, starts, 4, 4, causal="no"),
        TypeError,
        "causal",
    ),
    (
        "varlen_attention",
        "bad scalar (value)",
        lambda: varlen_attention(packed, packed, packed, starts, starts, 4, 4, True, window=0),
        ValueError,
        "window",
    ),
    # add (chapter 01)
    ("add", "wrong dtype", lambda: add(x.int(), x.int()), TypeError, "x"),
    ("add", "mismatched dtypes", lambda: add(x, x.half()), TypeError, "y"),
    ("add", "wrong device", lambda: add(x, x.to(OTHER_DEVICE)), ValueError, "y"),
    ("add", "wrong shape", lambda: add(x, x[:2]), ValueError, "y"),
    ("add", "wrong shape", lambda: add(x, x.T.contiguous().T), ValueError, "y"),
    ("add", "not a tensor", lambda: add(x, 1.0), TypeError, "y"),
    # rms_norm, RMSNorm, rotary_embedding, rotary_embedding_qk and silu_mul (chapter 14)
    ("rms_norm", "wrong dtype", lambda: rms_norm(x.double(), (8,)), TypeError, "x"),
    ("rms_norm", "mismatched dtypes", lambda: rms_norm(x, (8,), feature_bias.half()), TypeError, "weight"),
    ("rms_norm", "wrong device", lambda: rms_norm(x, (8,), feature_bias.to(OTHER_DEVICE)), ValueError, "weight"),
    ("rms_norm", "wrong shape", lambda: rms_norm(x, (7,)), ValueError, "normalized_shape"),
    ("rms_norm", "wrong shape", lambda: rms_norm(x, (8,), feature_bias[:7]), ValueError, "weight"),
    ("rms_norm", "wrong shape", lambda: rms_norm(x.new_ones(2, 2**17), (2**17,)), ValueError, "normalized_shape"),
    ("rms_norm", "not a tensor", lambda: rms_norm(x.tolist(), (8,)), TypeError, "x"),
    ("rms_norm", "bad scalar (type)", lambda: rms_norm(x, (8.0,)), TypeError, "normalized_shape"),
    ("rms_norm", "bad scalar (type)", lambda: rms_norm(x, (8,), eps="1e-5"), TypeError, "eps"),
    ("rms_norm", "bad scalar (value)", lambda: rms_norm(x, (8,), eps=-1.0), ValueError, "eps"),
    ("RMSNorm", "wrong dtype", lambda: RMSNorm(8, device=DEVICE)(x.int()), TypeError, "x"),
    ("rotary_embedding", "wrong dtype", lambda: rotary_embedding(q.int(), cos, sin), TypeError, "x"),
    ("rotary_embedding", "mismatched dtypes", lambda: rotary_embedding(q, cos.half(), sin), TypeError, "cos"),
    ("rotary_embedding", "wrong device", lambda: rotary_embedding(q, cos, sin.to(OTHER_DEVICE)), ValueError, "sin"),
    ("rotary_embedding", "wrong shape", lambda: rotary_embedding(q, cos[None], sin[None]), ValueError, "cos"),
    ("rotary_embedding", "wrong shape", lambda: rotary_embedding(q[..., :15], cos, sin), ValueError, "x"),
    ("rotary_embedding", "wrong shape", lambda: rotary_embedding(q[0], cos, sin), ValueError, "x"),
    ("rotary_embedding", "not a tensor", lambda: rotary_embedding(q.tolist(), cos, sin), TypeError, "x"),
    ("rotary_embedding", "not a tensor", lambda: rotary_embedding(q, cos, None), TypeError, "sin"),
    ("rotary_embedding_qk", "mismatched dtypes", lambda: rotary_embedding_qk(q, q.half(), cos, sin), TypeError, "k"),
    ("rotary_embedding_qk", "wrong shape", lambda: rotary_embedding_qk(q, q[:, :, :2], cos, sin), ValueError, "k"),
    ("rotary_embedding_qk", "not a tensor", lambda: rotary_embedding_qk(q, None, cos, sin), TypeError, "k"),
    ("silu_mul", "wrong dtype", lambda: silu_mul(x.int(), x.int()), TypeError, "gate"),
    ("silu_mul", "mismatched dtypes", lambda: silu_mul(x, x.half()), TypeError, "up"),
    ("silu_mul", "wrong device", lambda: silu_mul(x, x.to(OTHER_DEVICE)), ValueError, "up"),
    ("silu_mul", "wrong shape", lambda: silu_mul(x, x[:2]), ValueError, "up"),
    ("silu_mul", "not a tensor", lambda: silu_mul(x, 1.0), TypeError, "up"),
    # add_layer_norm and FusedAdamW (chapter 15)
    ("add_layer_norm", "wrong dtype", lambda: add_layer_norm(x.double(), x.double(), (8,)), TypeError, "x"),
    ("add_layer_norm", "wrong shape", lambda: add_layer_norm(x, x[:2], (8,)), ValueError, "residual"),
    ("add_layer_norm", "wrong shape", lambda: add_layer_norm(x, x, (7,)), ValueError, "normalized_shape"),
    ("add_layer_norm", "wrong shape", lambda: add_layer_norm(x, x, (8,), feature_bias[:7]), ValueError, "weight"),
    ("add_layer_norm", "not a tensor", lambda: add_layer_norm(x, 1.0, (8,)), TypeError, "residual"),
    ("add_layer_norm", "bad scalar (type)", lambda: add_layer_norm(x, x, (8,), eps="1"), TypeError, "eps"),
    ("add_layer_norm", "bad scalar (value)", lambda: add_layer_norm(x, x, (8,), eps=-1.0), ValueError, "eps"),
    (
        "add_layer_norm",
        "bad scalar (type)",
        lambda: add_layer_norm(x, x, (8,), out_dtype=torch.int32),
        TypeError,
        "out_dtype",
    ),
    ("FusedAdamW", "wrong dtype", lambda: FusedAdamW([feature_bias.half().requires_grad_()]), TypeError, "parameter"),
    ("FusedAdamW", "wrong shape", lambda: FusedAdamW([x.t().requires_grad_()]), ValueError, "parameter"),
    ("FusedAdamW", "bad scalar (type)", lambda: FusedAdamW([feature_bias], lr="1"), TypeError, "lr"),
    ("FusedAdamW", "bad scalar (value)", lambda: FusedAdamW([feature_bias], lr=-1.0), ValueError, "lr"),
    ("FusedAdamW", "bad scalar (value)", lambda: FusedAdamW([feature_bias], betas=(0.9, 1.5)), ValueError, "betas"),
    (
        "FusedAdamW",
        "bad scalar (type)",
        lambda: FusedAdamW([feature_bias], weight_decay="x"),
        TypeError,
        "weight_decay",
    ),
    # GPT (chapter 12)
    ("GPT", "wrong dtype", lambda: gpt()(idx.float()), TypeError, "idx"),
    ("GPT", "wrong dtype", lambda: gpt()(idx, idx.float()), TypeError, "targets"),
    ("GPT", "wrong shape", lambda: gpt()(idx[0]), ValueError, "idx"),
    ("GPT", "wrong shape", lambda: gpt()(idx, idx[:, :2]), ValueError, "targets"),
    ("GPT", "not a tensor", lambda: gpt()(idx.tolist()), TypeError, "idx"),
    ("GPTConfig", "bad scalar (value)", lambda: GPTConfig(11, 8, 1, 3, 16), ValueError, "n_head"),
    ("GPTConfig", "bad scalar (type)", lambda: GPTConfig(11.0, 8, 1, 2, 16), TypeError, "vocab_size"),
    ("GPTConfig", "bad scalar (value)", lambda: GPTConfig(11, 8, 1, 2, 16, dropout=1.0), ValueError, "dropout"),
    ("GPT", "bad scalar (value)", lambda: gpt().generate(idx, 2, temperature=0.0), ValueError, "temperature"),
    ("GPT", "bad scalar (type)", lambda: gpt().generate(idx, 2, top_k=1.5), TypeError, "top_k"),
    ("GPT", "bad scalar (type)", lambda: gpt().generate(idx, 2.0), TypeError, "new_tokens"),
    ("GPT", "bad scalar (value)", lambda: gpt().generate(idx, -1), ValueError, "new_tokens"),
]


def raised_by_us(error: BaseException) -> bool:
    """Was ``error`` raised by a ``raise`` of the package's own (a check), not inside torch,
    Triton or Python (a function of C called from our code leaves our frame last)?"""
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    path = Path(frame.tb_frame.f_code.co_filename).resolve()
    line = linecache.getline(str(path), frame.tb_lineno).strip()
    return path.is_relative_to(PACKAGE) and line.startswith("raise ")


def case_id(case) -> str:
    return f"{case[0]}-{case[1]}-{CASES.index(case)}".replace(" ", "_")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_each_kind_of_mistake_has_one_error_type_that_names_the_argument(case):
    function, kind, call, error, argument = case
    with pytest.raises(Exception) as caught:
        call()
    # the kind's type, or an error of the package's that is one (GPTConfig's name their field)
    assert isinstance(caught.value, error), f"{type(caught.value).__name__}: {caught.value}"
    assert not isinstance(caught.value, {TypeError: ValueError, ValueError: TypeError}[error])
    assert raised_by_us(caught.value), f"raised inside {caught.traceback[-1].path}"
    assert re.search(rf"\b{argument}\b", str(caught.value)), str(caught.value)


def test_the_table_covers_every_public_function_and_kind():
    assert {case[0] for case in CASES} == set(stepkernels.__all__)
    for function in {"softmax", "layer_norm", "matmul", "linear", "dropout", "cross_entropy"}:
        kinds = {case[1] for case in CASES if case[0] == function}
        assert {"wrong dtype", "wrong shape", "bad scalar (type)", "bad scalar (value)"} <= kinds


# ------------------------------------------------------------------ out-of-range targets
V = 6  # classes of the losses below


def loss_calls(targets: torch.Tensor) -> dict:
    """The three losses on targets (4,): cross_entropy, linear_cross_entropy, the GPT's."""
    model = gpt()  # vocabulary 11
    in_vocabulary = torch.where(targets >= V, targets + 11 - V, targets)  # V -> 11, ...
    return {
        "cross_entropy": lambda: cross_entropy(logits, targets),
        "linear_cross_entropy": lambda: linear_cross_entropy(x, w, targets),
        "GPT": lambda: model(idx, in_vocabulary[None]),
    }


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel traps: test_targets_trap_on_a_gpu")
@pytest.mark.parametrize("loss", ["cross_entropy", "linear_cross_entropy", "GPT"])
@pytest.mark.parametrize("bad", [-1, -5, V, 2**40])
def test_targets_out_of_range_are_a_value_error_naming_them(bad, loss):
    """They gave a NaN loss for their row (issue 46); PyTorch raises on the CPU."""
    targets = torch.tensor([0, 3, bad, -100], device=DEVICE)
    with pytest.raises(ValueError) as caught:
        loss_calls(targets)[loss]()
    message = str(caught.value)
    name = "targets" if loss == "GPT" else "target"
    shown = 11 + bad - V if loss == "GPT" and bad >= V else bad
    where = "[0, 2]" if loss == "GPT" else "[2]"
    assert f"{name}{where} is {shown}, outside the classes [0, {11 if loss == 'GPT' else V})" in message
    assert "ignore_index (-100)" in message and raised_by_us(caught.value)


def test_ignored_and_in_range_targets_pass_the_check():
    for ignore_index in (-100, -1, V, 2**40):  # any int may mark ignored rows, as for torch
        targets = torch.tensor([0, V - 1, ignore_index, 2], device=DEVICE)
        got = cross_entropy(logits, targets, ignore_index=ignore_index)
        want = F.cross_entropy(logits.double(), targets, ignore_index=ignore_index)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if ON_GPU:  # the rest would trap
        return
    with pytest.raises(ValueError, match=r"target\[2\] is -100"):  # ignored only if named
        cross_entropy(logits, torch.tensor([0, 1, -100, 2], device=DEVICE), ignore_index=-1)


TRAP = """
import torch, stepkernels
from stepkernels import cross_entropy, linear_cross_entropy, GPT, GPTConfig
targets = torch.tensor([0, 3, {bad}, -100], device="cuda")
if "{loss}" == "cross_entropy":
    loss = cross_entropy(torch.randn(4, {V}, device="cuda"), targets)
elif "{loss}" == "linear_cross_entropy":
    loss = linear_cross_entropy(torch.randn(4, 8, device="cuda"),
                                torch.randn({V}, 8, device="cuda"), targets)
else:
    model = GPT(GPTConfig({V}, 8, 1, 2, 16)).cuda()
    loss = model(torch.zeros(1, 4, dtype=torch.long, device="cuda"), targets[None])[1]
torch.cuda.synchronize()
print("no trap:", loss.item())
"""


@pytest.mark.skipif(not ON_GPU, reason="the device-side assert: on a GPU")
@pytest.mark.parametrize(
    "loss, bad", [("cross_entropy", b) for b in (-1, -5, V, 2**40)] + [("linear_cross_entropy", V), ("GPT", -1)]
)
def test_targets_trap_on_a_gpu(loss, bad):
    """On a GPU the kernel checks each target with tl.device_assert (no host sync): the
    process's CUDA context then fails, as after PyTorch's own device-side asserts."""
    script = TRAP.format(loss=loss, bad=bad, V=V)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "no trap" not in output, output
    assert "device-side assert triggered" in output and "target outside [0, V)" in output, output


# ----------------------------------------------------------------------- property tests
# Random calls, half of them valid and half with one argument wrong (a wrong type, dtype, shape
# or value, drawn at random): each raises a TypeError or a ValueError from one of our checks,
# or returns PyTorch's answer (NaN only where PyTorch's is NaN). Small shapes and few
# examples: the interpreter is slow.
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
OTHER_DTYPES = (torch.float64, torch.int32, torch.int64, torch.bool)
NOT_TENSORS = st.sampled_from([None, 2.0, [[1.0, 2.0]], "x"])
BAD_SCALARS = st.sampled_from([None, "1", 1.5, -1, 0, float("nan"), float("inf"), True, 2**40, [1]])
TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 2**-5}
PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Call:
    """Draws one call's arguments: all valid, or all but one (the ``mistake``)."""

    def __init__(self, data, *names):
        self.data = data
        self.mistake = data.draw(st.sampled_from((None,) * len(names) + names), label="mistake")
        self.dtype = data.draw(st.sampled_from(FLOATS), label="dtype")

    def __call__(self, name, valid, bad):
        return self.data.draw(bad if name == self.mistake else valid, label=name)

    def tensor(self, name, shape, wrong_shapes=(), dtype=None):
        """A tensor of ``shape`` in the call's dtype; if it is the mistake, a tensor of another
        dtype or of one of ``wrong_shapes``, or no tensor."""
        dtype = dtype or self.dtype
        wrong = [tensors(shape, st.sampled_from(OTHER_DTYPES + FLOATS)), NOT_TENSORS]
        wrong += [tensors(s, st.just(dtype)) for s in wrong_shapes]
        return self(name, tensors(shape, st.just(dtype)), st.one_of(wrong))


@st.composite
def tensors(draw, shape, dtypes, scale=2.0):
    """Normal values of ``shape``, laid out column-major now and then."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    t = (scale * torch.randn(shape, generator=generator)).to(draw(dtypes))
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.mT.contiguous().mT
    return t.to(DEVICE)


def shapes(max_dims=3, max_side=5, min_dims=0):
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def refused_or_right(call, reference, dtype, check=None):
    """Either ``call`` raises a clear error of ours, or its answer is ``reference()``'s (or
    passes ``check``, for answers drawn at random)."""
    try:
        got = call()
    except (TypeError, ValueError) as error:
        assert raised_by_us(error), f"{type(error).__name__} from inside: {error}"
        assert str(error)
        event("refused")
        return
    event("answered")
    if check is not None:
        check(got)
        return
    want = reference()  # if PyTorch refuses what we took, this raises: the test fails
    if isinstance(got, tuple):  # the GPT's (logits, loss): the loss, or the logits without targets
        assert (got[1] is None) == (want[1] is None)
        got, want = (got[0], want[0]) if got[1] is None else (got[1], want[1])
    # an answer in a narrower dtype than the inputs' (bf16 x with fp32 tables) rounds as it
    tol = max(TOLERANCE[dtype], TOLERANCE.get(got.dtype, 0.0))
    scale = want.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if want.numel() else 0.0
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * (1 + scale), equal_nan=True)


@PROPERTY
@given(data=st.data())
def test_softmax_refuses_or_answers(data):
    call = Call(data, "x", "dim", "log")
    shape = data.draw(shapes(min_dims=1))
    x = call.tensor("x", shape, wrong_shapes=[()])
    rank = len(shape)
    dim = call("dim", st.integers(-rank, rank - 1), st.one_of(st.integers(-rank - 2, rank + 2), BAD_SCALARS))
    log = call("log", st.booleans(), BAD_SCALARS)
    ours, theirs = (log_softmax, torch.log_softmax) if log is True else (softmax, torch.softmax)
    refused_or_right(lambda: softmax(x, dim, log=log), lambda: theirs(x.double(), dim), call.dtype)
    if log in (True, False) and call.mistake != "log":  # the other spelling, the same checks
        refused_or_right(lambda: ours(x, dim), lambda: theirs(x.double(), dim), call.dtype)


@PROPERTY
@given(data=st.data())
def test_layer_norm_refuses_or_answers(data):
    call = Call(data, "x", "normalized_shape", "weight", "bias", "eps")
    shape = data.draw(shapes(min_dims=1).filter(lambda shape: 0 not in shape[1:]))
    x = call.tensor("x", shape, wrong_shapes=[()])
    normalized = shape[len(shape) - data.draw(st.integers(1, len(shape))) :]
    normalized_shape = call("normalized_shape", st.just(normalized), st.one_of(shapes(2, 3), BAD_SCALARS))
    params = st.one_of(st.none(), tensors(normalized, st.just(data.draw(st.sampled_from([call.dtype, torch.float32])))))
    wrong_params = st.one_of(
        NOT_TENSORS, tensors(normalized, st.sampled_from(OTHER_DTYPES)), tensors((7,), st.just(call.dtype))
    )
    weight, bias = call("weight", params, wrong_params), call("bias", params, wrong_params)
    eps = call("eps", st.floats(1e-6, 1e-2), BAD_SCALARS)

    def reference():
        weight_64, bias_64 = (None if p is None else p.double() for p in (weight, bias))
        return F.layer_norm(x.double(), normalized_shape, weight_64, bias_64, eps)

    refused_or_right(lambda: layer_norm(x, normalized_shape, weight, bias, eps), reference, call.dtype)


ACTIVATIONS = st.sampled_from([None, "relu", "gelu", "squared_relu", "leaky_relu"])
BAD_ACTIVATIONS = st.sampled_from(["tanh", "", 1, True, ["relu"]])


@PROPERTY
@given(data=st.data())
def test_matmul_refuses_or_answers(data):
    call = Call(data, "a", "b", "bias", "activation")
    m, k, n = (data.draw(st.integers(0, 6), label=d) for d in "mkn")
    a = call.tensor("a", (m, k), wrong_shapes=[(m,), (2, m, k), (m, k + 1)])
    b = call.tensor("b", (k, n), wrong_shapes=[(n,), (k + 1, n)])
    bias = call(
        "bias",
        st.one_of(st.none(), tensors((n,), st.just(call.dtype))),
        st.one_of(NOT_TENSORS, tensors((n + 1,), st.just(call.dtype))),
    )
    activation = call("activation", ACTIVATIONS, BAD_ACTIVATIONS)
    refused_or_right(
        lambda: matmul(a, b, activation, bias=bias),
        lambda: activation_reference(a.double() @ b.double() + (0 if bias is None else bias.double()), activation),
        call.dtype,
    )


@PROPERTY
@given(data=st.data())
def test_linear_refuses_or_answers(data):
    call = Call(data, "x", "weight", "bias", "activation", "recompute")
    batch, k, n = data.draw(shapes(2, 4)), data.draw(st.integers(0, 6)), data.draw(st.integers(0, 6))
    x = call.tensor("x", (*batch, k), wrong_shapes=[(*batch, k + 1), ()])
    weight = call.tensor("weight", (n, k), wrong_shapes=[(k + 1, n), (n,)])
    bias = call(
        "bias",
        st.one_of(st.none(), tensors((n,), st.just(call.dtype))),
        st.one_of(NOT_TENSORS, tensors((n + 1,), st.just(call.dtype))),
    )
    activation = call("activation", ACTIVATIONS, BAD_ACTIVATIONS)
    recompute = call("recompute", st.booleans(), BAD_SCALARS)

    def reference():
        return activation_reference(
            F.linear(x.double(), weight.double(), None if bias is None else bias.double()), activation
        )

    refused_or_right(lambda: linear(x, weight, bias, activation, recompute=recompute), reference, call.dtype)


def dropped_or_scaled(got, kept, p):
    """Each value 0 or ``kept`` / (1 - p): what any mask gives."""
    assert got.shape == kept.shape and got.dtype == kept.dtype and not got.isnan().any()
    scaled = kept.double() / (1 - p) if p < 1 else torch.zeros_like(kept, dtype=torch.float64)
    dropped, tol = got == 0, TOLERANCE[kept.dtype]
    torch.testing.assert_close(
        torch.where(dropped, 0.0, got.double()), torch.where(dropped, 0.0, scaled), rtol=tol, atol=tol
    )


PROBABILITIES = st.sampled_from([0.0, 0.25, 0.5, 1.0])
BAD_PROBABILITIES = st.one_of(BAD_SCALARS, st.floats(-1, 2))
SEEDS = st.one_of(st.integers(0, 2**63 - 1), st.just(seed_tensor))
BAD_SEEDS = st.one_of(BAD_SCALARS, st.sampled_from([seed_tensor.int(), seed_tensor.repeat(2), 2**63]))


@PROPERTY
@given(data=st.data())
def test_dropout_refuses_or_answers(data):
    call = Call(data, "x", "p", "seed", "training", "inplace")
    x = call.tensor("x", data.draw(shapes()))
    p, seed = call("p", PROBABILITIES, BAD_PROBABILITIES), call("seed", SEEDS, BAD_SEEDS)
    training, inplace = call("training", st.booleans(), BAD_SCALARS), call("inplace", st.booleans(), BAD_SCALARS)
    kept = x.clone() if isinstance(x, torch.Tensor) else x

    def check(got):
        if not training or p == 0:
            assert got is x
        else:
            dropped_or_scaled(got, kept, p)

    refused_or_right(lambda: dropout(x, p, seed, training, inplace), None, call.dtype, check)


@settings(PROPERTY, max_examples=6)  # the slowest: a program loops over 256 rows, interpreted
@given(data=st.data())
def test_dropout_bias_act_refuses_or_answers(data):
    call = Call(data, "x", "bias", "p", "activation", "seed", "training")
    shape = data.draw(shapes(min_dims=1, max_side=4))
    x = call.tensor("x", shape, wrong_shapes=[()])
    bias = call.tensor("bias", shape[-1:], wrong_shapes=[(shape[-1] + 1,), (1, shape[-1])])
    p, activation = call("p", PROBABILITIES, BAD_PROBABILITIES), call("activation", ACTIVATIONS, BAD_ACTIVATIONS)
    seed, training = call("seed", SEEDS, BAD_SEEDS), call("training", st.booleans(), BAD_SCALARS)

    def check(got):
        kept = activation_reference(x.double() + bias.double(), activation).to(x.dtype)
        dropped_or_scaled(got, kept, p if training else 0.0)

    refused_or_right(lambda: dropout_bias_act(x, bias, p, activation, seed, training), None, call.dtype, check)


TARGET_DTYPES = st.sampled_from([torch.int32, torch.float32, torch.uint8, torch.bool])
OUT_OF_RANGE = st.sampled_from([-1, -5, 2**40])


@st.composite
def targets(draw, n_rows, n_classes, ignore_index, out_of_range=False):
    """Class indices or ``ignore_index``, in int64 or int32; one out of range if asked."""
    values = st.integers(0, n_classes - 1)
    values = st.one_of(values, st.just(ignore_index)) if type(ignore_index) is int else values
    t = draw(st.lists(values, min_size=n_rows, max_size=n_rows))
    if out_of_range and n_rows and not ON_GPU:  # a GPU traps: test_targets_trap_on_a_gpu
        bad = draw(st.one_of(OUT_OF_RANGE, st.just(n_classes)))
        t[draw(st.integers(0, n_rows - 1))] = bad if bad != ignore_index else n_classes
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return torch.tensor(t, dtype=dtype if all(abs(i) < 2**31 for i in t) else torch.int64).to(DEVICE)


def draw_target(call, n_rows, n_classes, ignore_index):
    """The mistake of a target: a value out of range, another dtype or shape, or no tensor."""
    good = targets(n_rows, n_classes, ignore_index)
    wrong_dtype = st.tuples(targets(n_rows, n_classes, 0), TARGET_DTYPES).map(lambda pair: pair[0].to(pair[1]))
    out_of_range = targets(n_rows, n_classes, ignore_index, out_of_range=True)  # NaN before issue 46
    wrong_shape = targets(n_rows + 1, n_classes, ignore_index)
    wrong = st.one_of(out_of_range, out_of_range, out_of_range, wrong_dtype, NOT_TENSORS, wrong_shape)
    return call("target", good, wrong)


LOSS_OPTIONS = {  # (valid, bad)
    "ignore_index": (st.sampled_from([-100, 0, 1, 2**40]), st.sampled_from([1.5, None, "1"])),
    "label_smoothing": (st.sampled_from([0.0, 0.1, 1.0]), st.one_of(BAD_SCALARS, st.floats(-1, 2))),
    "reduction": (st.sampled_from(["mean", "sum", "none"]), st.sampled_from(["avg", None, 1, "Mean"])),
}


def loss_options(call):
    return {name: call(name, *strategies) for name, strategies in LOSS_OPTIONS.items()}


@PROPERTY
@given(data=st.data())
def test_cross_entropy_refuses_or_answers(data):
    call = Call(data, "logits", "target", "target", "target", *LOSS_OPTIONS)  # targets: thrice
    n_rows, n_classes = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 7))
    scores = call.tensor("logits", (n_rows, n_classes), wrong_shapes=[(2, n_rows, n_classes), (n_rows, 0)])
    options = loss_options(call)
    target = draw_target(call, n_rows, n_classes, options["ignore_index"])
    refused_or_right(
        lambda: cross_entropy(scores, target, **options),
        lambda: F.cross_entropy(scores.double(), target.long(), **options),
        call.dtype,
    )


@PROPERTY
@given(data=st.data())
def test_linear_cross_entropy_refuses_or_answers(data):
    call = Call(data, "x", "weight", "target", "target", "target", "chunk_tokens", *LOSS_OPTIONS)
    n_rows, hidden, n_classes = (data.draw(st.integers(1, 6)) for _ in range(3))
    inputs = call.tensor("x", (n_rows, hidden), wrong_shapes=[(n_rows, hidden + 1), (hidden,)])
    weight = call.tensor("weight", (n_classes, hidden), wrong_shapes=[(hidden, n_classes + 1), (0, hidden)])
    chunk_tokens = call("chunk_tokens", st.sampled_from([None, 1, 2]), BAD_SCALARS)
    options = loss_options(call)
    target = draw_target(call, n_rows, n_classes, options["ignore_index"])
    refused_or_right(
        lambda: linear_cross_entropy(inputs, weight, target, chunk_tokens=chunk_tokens, **options),
        lambda: F.cross_entropy(inputs.double() @ weight.double().T, target.long(), **options),
        call.dtype,
    )


@PROPERTY
@given(data=st.data())
def test_attention_refuses_or_answers(data):
    call = Call(data, "q", "k", "v", "causal", "sm_scale", "window")
    batch, kv_heads, group, n_q, n_kv = (
        data.draw(st.integers(low, high)) for low, high in ((1, 2), (1, 2), (1, 3), (0, 5), (1, 5))
    )
    heads, head_dim = kv_heads * group, data.draw(st.sampled_from([1, 8, 16]))
    wrong = [(heads, n_q, head_dim), (batch, heads, n_q, head_dim + 1), (batch + 1, heads, n_q, head_dim)]
    q = call.tensor("q", (batch, heads, n_q, head_dim), wrong_shapes=wrong + [(batch, heads + 1, n_q, head_dim)])
    k, v = (call.tensor(name, (batch, kv_heads, n_kv, head_dim), wrong_shapes=wrong) for name in "kv")
    causal = call("causal", st.booleans(), BAD_SCALARS)
    sm_scale = call("sm_scale", st.one_of(st.none(), st.floats(0.05, 2.0)), st.one_of(BAD_SCALARS, st.floats(-1, 0)))
    window = call("window", st.one_of(st.none(), st.integers(1, 6)) if causal is True else st.none(), BAD_SCALARS)

    def reference():  # SDPA's is_causal: query i sees keys j <= i; a window: and j > i - window
        rows, columns = torch.arange(n_q, device=DEVICE)[:, None], torch.arange(n_kv, device=DEVICE)
        mask = columns <= rows if causal else None
        if window is not None:
            mask &= columns > rows - window
        return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, scale=sm_scale, enable_gqa=True)

    refused_or_right(lambda: attention(q, k, v, causal, sm_scale, window), reference, call.dtype)


@PROPERTY
@given(data=st.data())
def test_add_refuses_or_answers(data):
    call = Call(data, "x", "y")
    shape = data.draw(shapes())
    a = call.tensor("x", shape, wrong_shapes=[(*shape, 2)])
    b = call.tensor("y", shape, wrong_shapes=[(*shape, 2), (3, *shape)])
    refused_or_right(lambda: add(a, b), lambda: a.double() + b.double(), call.dtype)


@settings(PROPERTY, max_examples=8)
@given(data=st.data())
def test_gpt_loss_refuses_or_answers(data):
    call = Call(data, "idx", "targets")
    model, vocabulary, time = gpt(), 11, data.draw(st.integers(1, 8))
    ids = lambda dtype: st.lists(st.integers(0, vocabulary - 1), min_size=time, max_size=time).map(
        lambda tokens: torch.tensor([tokens], dtype=dtype, device=DEVICE)
    )
    wrong = st.one_of(
        targets(time, vocabulary, None, out_of_range=True).map(lambda t: t[None]),
        st.tuples(ids(torch.int64), TARGET_DTYPES).map(lambda pair: pair[0].to(pair[1])),
        ids(torch.int64).map(lambda t: t[0]),
        NOT_TENSORS,
    )
    idx, targets_ = call("idx", ids(torch.int64), wrong), call("targets", ids(torch.int32), wrong)

    def reference():
        model.use_triton = False  # the same parameters on PyTorch's layers
        return model(idx, targets_)

    refused_or_right(lambda: model(idx, targets_), reference, torch.float32)


@PROPERTY
@given(data=st.data())
def test_rms_norm_refuses_or_answers(data):
    call = Call(data, "x", "normalized_shape", "weight", "eps")
    shape = data.draw(shapes(min_dims=1).filter(lambda shape: 0 not in shape[1:]))
    x = call.tensor("x", shape, wrong_shapes=[()])
    normalized = shape[len(shape) - data.draw(st.integers(1, len(shape))) :]
    normalized_shape = call("normalized_shape", st.just(normalized), st.one_of(shapes(2, 3), BAD_SCALARS))
    weight_dtype = data.draw(st.sampled_from([call.dtype, torch.float32]))
    weight = call(
        "weight",
        st.one_of(st.none(), tensors(normalized, st.just(weight_dtype))),
        st.one_of(NOT_TENSORS, tensors(normalized, st.sampled_from(OTHER_DTYPES)), tensors((7,), st.just(call.dtype))),
    )
    eps = call("eps", st.one_of(st.none(), st.floats(1e-6, 1e-2)), BAD_SCALARS)

    def reference():  # eps None: PyTorch's default for the dtypes here, fp32's epsilon
        default = torch.finfo(torch.float32).eps if eps is None else eps
        return F.rms_norm(x.double(), normalized_shape, None if weight is None else weight.double(), default)

    refused_or_right(lambda: rms_norm(x, normalized_shape, weight, eps), reference, call.dtype)


@PROPERTY
@given(data=st.data())
def test_rotary_embedding_refuses_or_answers(data):
    call = Call(data, "x", "cos", "sin")
    batch, heads, positions = (data.draw(st.integers(low, 3)) for low in (1, 1, 0))
    dim = data.draw(st.sampled_from([2, 6, 8]))
    x = call.tensor("x", (batch, heads, positions, dim), wrong_shapes=[(heads, positions, dim), (1, 1, positions, 3)])
    cos, sin = (
        call.tensor(name, (positions, dim), wrong_shapes=[(1, positions, dim), (positions + 1, dim)])
        for name in ("cos", "sin")
    )

    def reference():
        x1, x2 = x.double().chunk(2, dim=-1)
        return x.double() * cos.double() + torch.cat([-x2, x1], dim=-1) * sin.double()

    refused_or_right(lambda: rotary_embedding(x, cos, sin), reference, call.dtype)


@PROPERTY
@given(data=st.data())
def test_silu_mul_refuses_or_answers(data):
    call = Call(data, "gate", "up")
    shape = data.draw(shapes())
    gate = call.tensor("gate", shape, wrong_shapes=[(*shape, 2)])
    up = call.tensor("up", shape, wrong_shapes=[(*shape, 2), (3, *shape)])
    refused_or_right(lambda: silu_mul(gate, up), lambda: F.silu(gate.double()) * up.double(), call.dtype)
