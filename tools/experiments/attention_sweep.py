"""Issue 17's draft attention on a GPU: checks at odd sizes against SDPA (fp32, math backend)
with a bitwise-repeatable backward, then TFLOP/s by launch (forward; backward with the
key-gradient launch varied, then the query-gradient one) next to SDPA's default,
FlashAttention-2 and cuDNN backends ("fwd/bwd", the backward counted as 2.5 forwards), bf16,
16,384 tokens x 16 heads. With --tma, the descriptor forward against the plain one.

    python tools/experiments/attention_sweep.py [--tma]

The log is results/<gpu>/experiments/attention_sweep.log."""

import itertools
from pathlib import Path
import sys
import time

sys.path.insert(0, str(Path(__file__).parent))
import attention_draft as attn  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

Launch = attn.Launch
LAUNCHES = {  # forward, key gradients, query gradient: (block_m, block_n, warps, stages)
    64: dict(fwd=[Launch(128, 64, 8, 3), Launch(128, 128, 8, 2), Launch(64, 64, 4, 3), Launch(128, 32, 4, 3)],
             k=[Launch(32, 128, 4, 3), Launch(64, 128, 8, 2), Launch(64, 64, 4, 3), Launch(32, 64, 4, 3)],
             q=[Launch(128, 64, 8, 2), Launch(128, 32, 8, 3), Launch(64, 64, 4, 3)]),
    128: dict(fwd=[Launch(128, 64, 8, 3), Launch(128, 64, 8, 2)],
              k=[Launch(32, 128, 8, 2), Launch(32, 64, 8, 3), Launch(32, 64, 8, 2)],
              q=[Launch(128, 32, 8, 2), Launch(128, 32, 8, 3), Launch(64, 32, 8, 3)]),
}  # fmt: skip
TMA_LAUNCHES = {
    64: [Launch(128, 64, 8, 3), Launch(128, 64, 4, 3), Launch(128, 128, 8, 3), Launch(64, 64, 4, 4)],
    128: [Launch(128, 64, 8, 3), Launch(128, 128, 8, 2), Launch(128, 64, 8, 4), Launch(64, 64, 4, 3)],
}


def ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")


def name(launch):
    return f"{launch.block_m}/{launch.block_n}/{launch.num_warps}/{launch.num_stages}"


def check(head_dim, causal, n_q, n_kv):
    q, k, v = (torch.randn(2, 3, n, head_dim, device="cuda", dtype=torch.bfloat16) for n in (n_q, n_kv, n_kv))
    do = torch.randn(2, 3, n_q, head_dim, device="cuda", dtype=torch.bfloat16)
    exact = [t.float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*exact, is_causal=causal)
    wanted = torch.autograd.grad(want, exact, do.float())
    table = LAUNCHES[head_dim]
    worst = 0.0
    for forward, keys, queries in zip(table["fwd"] * 3, table["k"] * 3, table["q"] * 3, strict=False):
        o, lse = attn.attention_forward(q, k, v, causal, head_dim**-0.5, forward)
        grads = attn.attention_backward(q, k, v, o, lse, do, causal, head_dim**-0.5, keys, queries)
        again = attn.attention_backward(q, k, v, o, lse, do, causal, head_dim**-0.5, keys, queries)
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True)), "backward not repeatable"
        errors = [(o.float() - want).abs().max() / want.abs().max()]
        errors += [(g.float() - w).abs().max() / w.abs().max() for g, w in zip(grads, wanted, strict=True)]
        worst = max(worst, max(e.item() for e in errors))
    verdict = "OK" if worst < 2e-2 else "BAD"
    print(f"check D={head_dim} causal={causal} N={n_q}x{n_kv}: worst relative error {worst:.2e} {verdict}")


def sdpa_rates(q, k, v, do, causal, flops):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]

    def forward():
        return F.scaled_dot_product_attention(*inputs, is_causal=causal)

    def both():
        return torch.autograd.grad(forward(), inputs, do)

    cells = []
    for label, backend in (
        ("default", None),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        try:
            if backend is None:
                t_fwd, t_both = ms(forward), ms(both)
            else:
                with sdpa_kernel(backend):
                    t_fwd, t_both = ms(forward), ms(both)
            cells.append(f"sdpa-{label} {flops / t_fwd / 1e9:.0f}/{2.5 * flops / (t_both - t_fwd) / 1e9:.0f}")
        except RuntimeError as error:
            cells.append(f"sdpa-{label} n/a ({type(error).__name__})")
    return cells


def sweep(head_dim, causal, n):
    batch, heads, scale = 16384 // n, 16, head_dim**-0.5
    q, k, v, do = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 4 * batch * heads * n * n * head_dim / (2 if causal else 1)
    table = {key: (value if n != 1024 else value[:1]) for key, value in LAUNCHES[head_dim].items()}

    def ranked(calls, work):
        return sorted(((work / ms(call) / 1e9, launch) for launch, call in calls), key=lambda r: -r[0])

    forward = ranked([(f, lambda f=f: attn.attention_forward(q, k, v, causal, scale, f)) for f in table["fwd"]], flops)
    o, lse = attn.attention_forward(q, k, v, causal, scale, forward[0][1])

    def backward(keys, queries):
        return attn.attention_backward(q, k, v, o, lse, do, causal, scale, keys, queries)

    keys = ranked([(kl, lambda kl=kl: backward(kl, table["q"][0])) for kl in table["k"]], 2.5 * flops)
    queries = ranked([(ql, lambda ql=ql: backward(keys[0][1], ql)) for ql in table["q"]], 2.5 * flops)
    cells = [f"D={head_dim} causal={int(causal)} N={n}:"]
    for label, results in (("fwd", forward), ("bwd(k)", keys), ("bwd(q)", queries)):
        cells.append(label + " " + " ".join(f"{rate:.0f}@{name(launch)}" for rate, launch in results))
    print("  ".join(cells + sdpa_rates(q, k, v, do, causal, flops)), flush=True)


def tma_sweep(head_dim, causal, n):
    batch, heads = 16384 // n, 16
    q, k, v = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * batch * heads * n * n * head_dim / (2 if causal else 1)
    plain = ms(lambda: attn.attention_forward(q, k, v, causal, 0.1, Launch(128, 64, 8, 3)))
    cells = [f"D={head_dim} causal={int(causal)} N={n}: plain {flops / plain / 1e9:.0f}"]
    for launch in TMA_LAUNCHES[head_dim]:
        rate = flops / ms(lambda launch=launch: attn.attention_forward_tma(q, k, v, causal, 0.1, launch)) / 1e9
        cells.append(f"tma {rate:.0f}@{name(launch)}")
    print("  ".join(cells), flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    start = time.time()
    if "--tma" in sys.argv:
        for head_dim, causal, n in itertools.product((64, 128), (False, True), (4096, 16384)):
            tma_sweep(head_dim, causal, n)
    else:
        for head_dim, causal, shape in itertools.product(
            (64, 128), (False, True), ((130, 130), (1000, 1000), (77, 300))
        ):
            check(head_dim, causal, *shape)
        for head_dim, causal, n in itertools.product((64, 128), (False, True), (1024, 4096, 16384)):
            sweep(head_dim, causal, n)
    print(f"took {time.time() - start:.0f} s")
