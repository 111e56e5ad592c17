"""What ``tools/check_targets.py`` runs to find every launch: the public operations, called
as a learner calls them.

One function an operation, marked ``@exercise``. Each calls its operation over shapes and
dtypes that reach every branch of the operation's launch rule, forward and backward: the
largest launch of each branch in every dtype, the rest in one. The calls run under Triton's
interpreter with ``STEPKERNELS_DEVICE_PROFILE`` set, so the rules choose as on that GPU;
kernels are recorded, not run, so the values computed are garbage and the shapes cost
nothing but the rule's arithmetic.

To check a new operation on every GPU, add a function here:

    @exercise
    def rms_norm():
        for n_cols in (384, 4096, 16384):  # a branch of the rule each
            for dtype in EVERY:
                x, w = tensor(256, n_cols, dtype=dtype), tensor(n_cols, dtype=dtype)
                backward(sk.rms_norm(x, (n_cols,), w))

``tests/test_targets.py`` then compiles its launches for sm_80, sm_86, sm_89 and sm_90 and
fails if a kernel of ``stepkernels.ops`` is launched by no exercise.
"""

import stepkernels as sk
from stepkernels.runtime.core import DEVICE
from stepkernels.runtime.tiles import SUPPORTED_DTYPES
import torch

HALF, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
EVERY = (HALF, BF16, FP32)
EXERCISES = {}  # name -> function, in the order written


def exercise(function):
    """Register ``function`` as an operation's exercise (its name: the operation's)."""
    EXERCISES[function.__name__] = function
    return function


def tensor(*shape, dtype=FP32, grad=True):
    return torch.randn(shape).to(DEVICE, dtype).requires_grad_(grad)


def backward(y):
    y.float().sum().backward()


@exercise
def vector_add():  # chapter 01
    for dtype in EVERY:
        sk.add(tensor(5000, dtype=dtype, grad=False), tensor(5000, dtype=dtype, grad=False))


@exercise
def softmax():  # chapter 02
    # tiles of short rows, a row a program (forward to 32,768 columns, backward to
    # 16,384), rows split over programs past those
    cases = (
        (100, (HALF,), True),
        (1000, EVERY, True),
        (16384, EVERY, True),
        (32768, EVERY, False),
        (40000, EVERY, True),
    )
    for n_cols, dtypes, grad in cases:
        for dtype in dtypes:
            y = sk.softmax(tensor(3, n_cols, dtype=dtype, grad=grad))
            backward(y) if grad else None
    backward(sk.log_softmax(tensor(3, 1000, dtype=HALF)))


@exercise
def layer_norm():  # chapters 03 and 13
    # tiles of short rows, a row a program, rows of 32 KB, rows split over programs
    # (chapter 13); enough rows that each backward program takes several, whose loads it
    # pipelines; weight and bias in x's dtype, or in fp32 beside 16-bit x
    cases = (
        (384, 4096, EVERY),
        (1000, 2048, (HALF,)),
        (4096, 2048, EVERY),
        (8192, 2048, EVERY),
        (16384, 256, EVERY),
        (40000, 256, EVERY),
    )
    for n_cols, n_rows, dtypes in cases:
        for dtype in dtypes:
            x = tensor(n_rows, n_cols, dtype=dtype)
            w, b = tensor(n_cols, dtype=dtype), tensor(n_cols, dtype=dtype)
            backward(sk.layer_norm(x, (n_cols,), w, b))
    for n_cols, n_rows in ((384, 4096), (16384, 256)):
        x, w, b = tensor(n_rows, n_cols, dtype=BF16), tensor(n_cols), tensor(n_cols)
        backward(sk.layer_norm(x, (n_cols,), w, b))
    # without weight and bias; dW, dB through a lock
    backward(sk.layer_norm(tensor(2048, 1000, dtype=HALF), (1000,)))
    for n_cols, n_rows in ((1000, 2048), (16384, 256)):
        x = tensor(n_rows, n_cols, dtype=HALF)
        backward(sk.layer_norm(x, (n_cols,), reduction="lock"))


@exercise
def matmul():  # chapters 04, 05, 07
    # products small and large (on sm_90 the large ones and fp8 go to the descriptor
    # kernel): every config the autotuner times comes from products of 2**23
    # multiply-adds or more (smaller ones take one config), plain and with the heaviest
    # epilogue
    for dtype in EVERY:
        a, b = tensor(100, 72, dtype=dtype, grad=False), tensor(72, 48, dtype=dtype, grad=False)
        sk.matmul(a, b)
        a = tensor(2048, 512, dtype=dtype, grad=False)
        b = tensor(512, 2048, dtype=dtype, grad=False)
        sk.matmul(a, b)
    bias = tensor(2048, dtype=HALF, grad=False)
    sk.matmul(a.half(), b.half(), "gelu", bias=bias, return_preactivation=True)
    # a weight gradient, dYᵀ X (few tiles, a long K; on sm_90 every tile split along K),
    # and the same added into an fp32 gradient
    for dtype in (HALF, BF16):
        grad_y = tensor(4096, 256, dtype=dtype, grad=False)
        x = tensor(4096, 128, dtype=dtype, grad=False)
        sk.matmul(grad_y.mT, x)
        sk.matmul(grad_y.mT, x, accumulate=torch.zeros(256, 128, device=DEVICE))
    for dtype in SUPPORTED_DTYPES:
        if dtype.itemsize == 1:  # fp8, where the GPU has it: bf16 out
            a = torch.randn(2048, 512).to(DEVICE, dtype)
            sk.matmul(a, torch.randn(2048, 512).to(DEVICE, dtype).mT)
            sk.matmul(a[:96], torch.randn(64, 512).to(DEVICE, dtype).mT)
    # fp32 products as tf32 (torch.set_float32_matmul_precision("high"))
    with tf32():
        a, b = tensor(2048, 512, grad=False), tensor(512, 2048, grad=False)
        sk.matmul(a, b)
        sk.matmul(a[:100, :72], b[:72, :48])


@exercise
def linear():  # chapter 05: a fused epilogue and the backward
    for dtype in (HALF, FP32):
        x, w = tensor(100, 72, dtype=dtype), tensor(48, 72, dtype=dtype)
        b = tensor(48, dtype=dtype)
        backward(sk.linear(x, w, b, "gelu"))
        backward(sk.linear(x, w, b, "relu", recompute=True))
    for dtype in EVERY:  # db of dY itself (column_sums), a few programs a column block
        x, w, b = tensor(3000, 72, dtype=dtype), tensor(300, 72, dtype=dtype), tensor(300, dtype=dtype)
        backward(sk.linear(x, w, b))


@exercise
def dropout():  # chapter 06: dropout, and bias + activation + dropout
    # short rows, rows in column blocks
    for dtype in EVERY:
        backward(sk.dropout(tensor(5000, dtype=dtype), 0.1, 7))
        x, b = tensor(50, 1030, dtype=dtype), tensor(1030, dtype=dtype)
        backward(sk.dropout_bias_act(x, b, 0.1, "gelu", 7))
    for n_cols, activation in ((20, "gelu"), (4096, "gelu"), (1030, None)):
        x, b = tensor(50, n_cols, dtype=HALF), tensor(n_cols, dtype=HALF)
        backward(sk.dropout_bias_act(x, b, 0.1, activation, 7))


@exercise
def cross_entropy():  # chapter 09
    # rows in one program, rows in parts, rows off the 16-byte grid, the loss alone
    for n_cols, dtypes in ((65, (HALF,)), (5000, (HALF,)), (40000, (HALF,)), (140000, EVERY)):
        for dtype in dtypes:
            target = torch.randint(n_cols - 1, (8,), device=DEVICE)
            logits = tensor(8, n_cols, dtype=dtype)
            backward(sk.cross_entropy(logits, target))
            sk.cross_entropy(logits.detach(), target)
            backward(sk.cross_entropy(logits[:, 1:], target))


@exercise
def linear_cross_entropy():  # chapter 10
    x, w = tensor(16, 64, dtype=BF16), tensor(1000, 64, dtype=BF16)
    backward(sk.linear_cross_entropy(x, w, torch.randint(1000, (16,), device=DEVICE)))


@exercise
def attention():  # chapter 11: head dims up to 64 and 128, causal or not, each dtype
    for head_dim in (64, 128):
        for dtype in EVERY:
            for causal in (False, True):
                q, k, v = (tensor(1, 2, 200, head_dim, dtype=dtype) for _ in "qkv")
                backward(sk.attention(q, k, v, causal=causal))
    with tf32():  # fp32 as tf32
        for head_dim in (64, 128):
            q, k, v = (tensor(1, 2, 200, head_dim) for _ in "qkv")
            backward(sk.attention(q, k, v, causal=True))


@exercise
def attention_variants():  # chapter 11: grouped heads in a window; packed sequences
    starts = torch.tensor([0, 70, 200], dtype=torch.int32, device=DEVICE)
    for head_dim in (64, 128):
        for dtype in EVERY:
            q = tensor(1, 4, 200, head_dim, dtype=dtype)
            k, v = (tensor(1, 2, 200, head_dim, dtype=dtype) for _ in "kv")
            backward(sk.attention(q, k, v, causal=True, window=64))
            q = tensor(200, 4, head_dim, dtype=dtype)
            k, v = (tensor(200, 2, head_dim, dtype=dtype) for _ in "kv")
            for causal in (False, True):
                packed = (starts, starts, 130, 130)
                backward(sk.varlen_attention(q, k, v, *packed, causal=causal))


@exercise
def gpt():  # chapter 12: a training step at chapter 12's widths under bf16 autocast
    # (few tokens: its products' autotuned configs all come from matmul's large products)
    torch.manual_seed(0)
    config = sk.GPTConfig(65, block_size=256, n_layer=1, n_head=6, n_embd=384, dropout=0.2)
    model = sk.GPT(config).to(DEVICE)
    idx = torch.randint(65, (1, 8), device=DEVICE)
    with torch.autocast(DEVICE.type, torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()


@exercise
def rms_norm():  # chapter 14: a row a program, to its longest row
    for n_cols in (384, 4096, 65536):
        for dtype in EVERY if n_cols == 4096 else (HALF,):
            x, w = tensor(64, n_cols, dtype=dtype), tensor(n_cols, dtype=dtype)
            backward(sk.rms_norm(x, (n_cols,), w))


@exercise
def rotary_embedding():  # chapter 14: one tensor, and q and k in one launch
    for head_dim in (64, 128):
        for dtype in EVERY:
            q, k = tensor(2, 4, 100, head_dim, dtype=dtype), tensor(2, 2, 100, head_dim, dtype=dtype)
            cos, sin = (tensor(100, head_dim, dtype=dtype, grad=False) for _ in range(2))
            backward(sk.rotary_embedding(q, cos, sin))
            q_rotated, k_rotated = sk.rotary_embedding_qk(q, k, cos, sin)
            backward(q_rotated.float().sum() + k_rotated.float().sum())


@exercise
def silu_mul():  # chapter 14: SwiGLU's product
    for dtype in EVERY:
        gate, up = tensor(64, 1000, dtype=dtype), tensor(64, 1000, dtype=dtype)
        backward(sk.silu_mul(gate, up))


@exercise
def add_layer_norm():  # chapter 15: rows to its longest block, in each dtype
    for n_cols in (384, 4096, 8192):
        for dtype in EVERY if n_cols == 4096 else (HALF,):
            x, residual = tensor(64, n_cols, dtype=dtype), tensor(64, n_cols, dtype=dtype)
            w, b = tensor(n_cols, dtype=dtype), tensor(n_cols, dtype=dtype)
            h, y = sk.add_layer_norm(x, residual, (n_cols,), w, b)
            backward(h.float().sum() + y.float().sum())


@exercise
def fused_adamw():  # chapter 15: one launch a group
    params = [tensor(384, 384), tensor(384)]
    optimizer = sk.FusedAdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}])
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    # fp16 training: torch.amp.GradScaler's scale and overflow flag, read on the device
    optimizer.grad_scale = torch.full((), 2.0**16, device=params[0].device)
    optimizer.found_inf = torch.zeros((), device=params[0].device)
    optimizer.step()
    # gradient clipping through the tables: the norm's two kernels, then the clipped update
    optimizer.grad_scale = optimizer.found_inf = None
    optimizer.clip_grad_norm(1.0)
    optimizer.step()


@exercise
def cast_all():  # chapters 12 and 15: the weights cast in one launch, aligned or not
    from stepkernels.models.gpt import cast_all

    for dtype in (HALF, BF16):
        backward(torch.cat([c.reshape(-1) for c in cast_all(dtype, tensor(384, 384), tensor(384))]))
        backward(torch.cat([c.reshape(-1) for c in cast_all(dtype, tensor(65, 7), tensor(3))]))


class tf32:
    """fp32 products as tf32 inside the block (torch's "high" precision)."""

    def __enter__(self):
        torch.set_float32_matmul_precision("high")

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision("highest")


def run(names=None) -> None:
    """Every exercise (or those named), in the order written."""
    for name in names or EXERCISES:
        EXERCISES[name]()
