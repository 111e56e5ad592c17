"""Chapter 09's loss kernel by launch (values per program / warps), on a GPU.

    python lab/cross_entropy_parts.py

Prints GB/s for 8,192 tokens (logits read once, plus the gradient written once with it), the
kernel alone (``loss_rows``, do_bench with the L2 flushed), fastest first, for the
vocabularies of the chapter's benchmark; and checks every launch against torch in fp32. Chose
``default_launch``. The log beside it (cross_entropy_parts.log) holds the runs so far."""

import itertools

from stepkernels.ops import cross_entropy as module  # the module, not the function
import torch
import torch.nn.functional as F
import triton

TOKENS = 8192
LAUNCHES = [(4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16), (32768, 32)]
LAUNCHES += [(4096, 4, 64), (8192, 8, 64), (16384, 16, 64)]  # (values, warps, registers)


def gbps(fn, nbytes):
    return nbytes / triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e6


def name(launch):
    """values/warps, and the registers per thread the compiler gave each thread."""
    wanted = {("PART", launch.part), ("num_warps", launch.num_warps)}
    if launch.max_registers:
        wanted.add(("maxnreg", launch.max_registers))
    compiled = [c for key, (c, *_) in module.cross_entropy_kernel.entries.items() if wanted <= set(key)]
    registers = f"{compiled[-1].n_regs}r" if compiled else "?"
    capped = "max " if launch.max_registers else ""
    return f"{launch.part}/{launch.num_warps}w/{capped}{registers}"


def reference(logits, target, write_grad):
    x = logits.float().requires_grad_(write_grad)
    loss = F.cross_entropy(x, target, reduction="none")
    return loss.detach(), torch.autograd.grad(loss.sum(), x)[0] if write_grad else None


def sweep(write_grad, dtype, n_cols):
    logits = 2 * torch.randn(TOKENS, n_cols, device="cuda", dtype=dtype)
    target = torch.randint(0, n_cols, (TOKENS,), device="cuda")
    target[::7] = -100
    options = module.Options(-100, 0.0, "sum")
    grad = torch.empty_like(logits) if write_grad else None
    nbytes = (2 if write_grad else 1) * logits.numel() * logits.element_size()
    want_loss, want_grad = reference(logits, target, write_grad)
    align = 16 // logits.element_size()  # as loss_rows reckons the values of a row
    aligned = module.rows_aligned(logits, align)
    n_values = n_cols if aligned else n_cols + align - 1
    default = module.default_launch(n_values, logits.element_size(), write_grad, aligned)
    rates, wrong, tried = [], [], set()
    for part, warps, *registers in LAUNCHES + [(default.part, default.num_warps, default.max_registers)]:
        launch = module.Launch(min(part, triton.next_power_of_2(n_values)), warps, *registers)
        if launch in tried:
            continue
        tried.add(launch)
        call = lambda launch=launch: module.loss_rows(logits, target, options, grad, launch=launch)
        if grad is not None:
            grad.fill_(float("nan"))
        loss_error = (call() - want_loss).abs().max().item()
        grad_error = (grad.float() - want_grad).abs().max().item() if write_grad else 0.0
        if not (loss_error < 1e-3 * want_loss.abs().max().item() and grad_error < 2e-2):
            wrong.append(f"{name(launch)}: loss {loss_error:.1e}, gradient {grad_error:.1e}")
        mark = "*" if launch == default else ""  # the default launch
        rates.append((gbps(call, nbytes), f"{name(launch)}{mark}"))
    line = "  ".join(f"{rate:,.0f} {label}" for rate, label in sorted(rates, reverse=True))
    print(f"{'fwd+bwd' if write_grad else 'fwd'} {dtype} V={n_cols}: {line}", flush=True)
    if wrong:
        print("  WRONG " + "; ".join(wrong), flush=True)


def main():
    for write_grad, dtype in itertools.product((True, False), (torch.bfloat16, torch.float32)):
        for n_cols in (16_384, 32_768, 50_257, 65_536, 131_072):
            sweep(write_grad, dtype, n_cols)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
