"""CPU per call of chapter 09's loss, forward + backward, against torch's, on a GPU.

    python lab/cross_entropy_call_cpu.py

V = 16,384 and 32,768 in bf16, 8,192 tokens: the CPU time of one call issued back to back
(``bench.cpu_us``) and the call's time (do_bench), in a fresh process, after ten
``torch.compile`` compilations of torch's loss (as the chapter's benchmark makes them), after
``gc.freeze()``, and with the collector off: does the state of the process move the CPU cost?
The log is in lab/cross_entropy_call_cpu.log."""

import gc

from stepkernels import cross_entropy
from stepkernels.lessons import bench
import torch
import torch.nn.functional as F
import triton

TOKENS = 8192


def report(state):
    for n_cols in (16_384, 32_768):
        logits = torch.randn(TOKENS, n_cols, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, n_cols, (TOKENS,), device="cuda")
        logits.requires_grad_()
        ours = lambda: torch.autograd.grad(cross_entropy(logits, target), logits)  # noqa: B023
        theirs = lambda: torch.autograd.grad(F.cross_entropy(logits, target), logits)  # noqa: B023
        with bench.side_stream():
            mine, torch_cpu = bench.cpu_us(ours, 100), bench.cpu_us(theirs, 100)
            call = triton.testing.do_bench(ours)
        print(f"{state}: V={n_cols} bf16 fwd+bwd CPU per call ours {mine:.0f} us, "
              f"torch {torch_cpu:.0f} us; our call {call * 1e3:.0f} us", flush=True)  # fmt: skip


def main():
    report("fresh process")
    for n_cols in (16_384, 32_768, 50_257, 65_536, 131_072):
        for dtype in (torch.bfloat16, torch.float32):
            logits = torch.randn(TOKENS, n_cols, device="cuda", dtype=dtype, requires_grad=True)
            target = torch.randint(0, n_cols, (TOKENS,), device="cuda")
            compiled = bench.compile_static(F.cross_entropy)
            torch.autograd.grad(compiled(logits, target), logits)
    report("after torch.compile")
    gc.collect()
    gc.freeze()
    report("after gc.freeze")
    gc.unfreeze()
    gc.disable()
    report("gc disabled")
    gc.enable()


if __name__ == "__main__":
    main()
