"""Launches for chapter 11's attention (stepkernels.ops.attention) on a GPU: TFLOP/s of the
forward by launch, with and without warp specialization, next to the pointer-loading forward
of the first draft (attention_draft.py); of the backward (the delta, key-gradient and
query-gradient kernels together) varying the key-gradient launch with the first
query-gradient one, then the query-gradient launch with the best key-gradient one; SDPA's
default, FlashAttention-2 and cuDNN backends beside ("fwd/bwd"). bf16, 16,384 tokens x 16
heads; FLOPs 4 B H N^2 D (halved when causal), the backward 2.5 times that. Then what
torch.compile makes of the naive attention: its kernels and rates.

    python lab/attention_sweep.py

The log is lab/attention_sweep.log. Launches that spilled registers
when compiled for sm_90a (Triton 3.9, ptxas -v) are left out."""

import contextlib
import itertools
import time

import attention_draft as draft
from stepkernels.ops import attention as attn
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
import triton

L = attn.Launch
FORWARD = {
    64: [L(128, 64, 4, 3), L(128, 64, 8, 3), L(64, 64, 4, 3), L(64, 64, 4, 4), L(128, 128, 8, 3), L(128, 32, 4, 3)],
    128: [L(64, 64, 4, 3), L(64, 64, 4, 4), L(128, 64, 8, 3), L(64, 128, 4, 3), L(128, 128, 8, 2), L(64, 32, 4, 3),
          L(128, 64, 8, 2)],
}  # fmt: skip
KEYS = {
    64: [L(64, 64, 4, 3), L(32, 64, 4, 3), L(64, 128, 8, 3), L(32, 128, 4, 3), L(64, 64, 4, 2)],
    128: [L(32, 128, 8, 2), L(32, 64, 4, 3), L(64, 64, 4, 3), L(32, 128, 8, 3), L(64, 128, 8, 1)],
}  # fmt: skip
QUERIES = {
    64: [L(64, 64, 4, 3), L(128, 64, 8, 2), L(128, 32, 8, 3), L(64, 32, 4, 3), L(128, 64, 8, 3), L(128, 128, 8, 2)],
    128: [L(128, 32, 8, 3), L(128, 64, 8, 2), L(64, 64, 4, 3), L(64, 32, 4, 3), L(128, 32, 8, 2), L(128, 64, 8, 3),
          L(64, 64, 4, 2)],
}  # fmt: skip


def ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def name(launch):
    ws = "ws" if getattr(launch, "warp_specialize", False) else ""
    return f"{launch.block_m}/{launch.block_n}/{launch.num_warps}/{launch.num_stages}{ws}"


def ranked(calls, work):
    rates = []
    for launch, call in calls:
        try:
            rates.append((work / ms(call) / 1e9, launch))
        except Exception as error:  # a launch Triton 3.6 cannot compile: say so, go on
            print(f"  {name(launch)} failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
    return sorted(rates, key=lambda r: -r[0])


def sdpa_rates(q, k, v, do, causal, flops):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    cells = []
    for label, backend in (("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                           ("cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip
        with sdpa_kernel(backend) if backend else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(*inputs, is_causal=causal)
            t_fwd = ms(lambda: F.scaled_dot_product_attention(*inputs, is_causal=causal))
            t_bwd = ms(lambda out=out: torch.autograd.grad(out, inputs, do, retain_graph=True))
        cells.append(f"sdpa-{label} {flops / t_fwd / 1e9:.0f}/{2.5 * flops / t_bwd / 1e9:.0f}")
    return cells


def sweep(head_dim, causal, n):
    batch, heads, scale = 16384 // n, 16, head_dim**-0.5
    q, k, v, do = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 4 * batch * heads * n * n * head_dim / (2 if causal else 1)
    short = n < 4096  # the defaults alone
    defaults = attn.default_launches(head_dim, 2, causal)
    forwards = [defaults[0]] if short else FORWARD[head_dim]
    forward = ranked([(f, lambda f=f: attn.attention_forward(q, k, v, causal, scale, f)) for f in forwards], flops)
    pointer = draft.Launch(128, 64, 8, 3)
    pointer_rate = flops / ms(lambda: draft.attention_forward(q, k, v, causal, scale, pointer)) / 1e9
    o, lse = attn.attention_forward(q, k, v, causal, scale, defaults[0])

    def backward(keys, queries):
        return attn.attention_backward(q, k, v, o, lse, do, causal, scale, (keys, queries))

    key_launches = [defaults[1]] if short else KEYS[head_dim]
    keys = ranked([(kl, lambda kl=kl: backward(kl, defaults[2])) for kl in key_launches], 2.5 * flops)
    query_launches = [defaults[2]] if short else QUERIES[head_dim]
    queries = ranked([(ql, lambda ql=ql: backward(keys[0][1], ql)) for ql in query_launches], 2.5 * flops)
    cells = [f"D={head_dim} causal={int(causal)} N={n}:"]
    for label, results in (("fwd", forward), ("bwd(k)", keys), ("bwd(q)", queries)):
        cells.append(label + " " + " ".join(f"{rate:.0f}@{name(launch)}" for rate, launch in results))
    cells.append(f"pointer-fwd {pointer_rate:.0f}@{name(pointer)}")
    print("  ".join(cells + sdpa_rates(q, k, v, do, causal, flops)), flush=True)


def naive(q, k, v, causal):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_kv = scores.shape[-2:]
        mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def compile_probe(head_dim, causal, n):
    batch, heads = 16384 // n, 16
    q, k, v, do = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 4 * batch * heads * n * n * head_dim / (2 if causal else 1)
    torch._dynamo.reset()
    compiled = torch.compile(naive, dynamic=False)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    start = time.time()
    out = compiled(*inputs, causal)
    torch.autograd.grad(out, inputs, do, retain_graph=True)
    torch.cuda.synchronize()
    took = time.time() - start
    t_fwd = ms(lambda: compiled(*inputs, causal))
    t_bwd = ms(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(compiled(*inputs, causal), inputs, do)
        torch.cuda.synchronize()
    kernels = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    print(
        f"torch.compile naive D={head_dim} causal={int(causal)} N={n}: compile+first {took:.1f} s, "
        f"fwd {flops / t_fwd / 1e9:.0f} bwd {2.5 * flops / t_bwd / 1e9:.0f} TFLOP/s; kernels: {kernels}",
        flush=True,
    )


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    start = time.time()
    for head_dim, causal, n in itertools.product((64, 128), (False, True), (1024, 4096, 16384)):
        sweep(head_dim, causal, n)
    print(f"sweep took {time.time() - start:.0f} s", flush=True)
    for head_dim, causal, n in ((128, False, 4096), (128, True, 4096), (64, False, 16384)):
        compile_probe(head_dim, causal, n)
    print(f"took {time.time() - start:.0f} s")
