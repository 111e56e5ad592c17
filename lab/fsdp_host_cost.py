"""The host's cost of FSDP2's optimizer step and gradient clip over DTensor shards, on the CPU:
torchrun 2 processes on gloo, a GPT of GPT-2 small's 12 blocks (148 parameter tensors, as
GPT-2 small) but 64 wide, so that the tensors' arithmetic is small beside the dispatch.

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 lab/fsdp_host_cost.py

Times (median of 20, rank 0, milliseconds): a forward and backward under bf16 autocast,
one process's and FSDP2's with its tunings off and on; torch's AdamW over the shards, foreach (PyTorch's
default, the recorded FSDP2 run's) and fused (``fused-adamw``); torch's clip_grad_norm_ over
the DTensors and ours over the local shards (``local-clip``); the same two optimizers over
plain tensors of the same shapes, for what DTensor's dispatch adds. A CPU's Python, not the
GPU host's: the ratios say where FSDP2's eager step spends its host time, the milliseconds
do not transfer.
"""

import statistics
import time

from stepkernels.models import distributed
from stepkernels.models.gpt import GPT, GPTConfig
import torch
import torch.distributed as dist

SHAPE = dict(vocab_size=84, block_size=64, n_layer=12, n_head=4, n_embd=64, dropout=0.0)


def median_ms(work, repeats=20) -> float:
    work()  # warm: the optimizer's state, DTensor's sharding caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def model_with_grads(parallel):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE, use_triton=False))
    if parallel is not None:
        distributed.wrap(model, parallel)
    x = torch.randint(0, 84, (2, 64))
    model(x, x)[1].backward()
    return model


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel = distributed.Parallel("fsdp", rank, world)
    rows = {}
    for where, par in (("DTensor shards", parallel), ("plain tensors", None)):
        model = model_with_grads(par)
        params = list(model.parameters())
        for name, options in (("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
            optimizer = torch.optim.AdamW(params, lr=1e-4, **options)
            rows[f"AdamW {name}, {where}"] = median_ms(optimizer.step)
    model = model_with_grads(parallel)
    params = list(model.parameters())
    rows["clip: torch's clip_grad_norm_ over DTensors"] = median_ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9))
    rows["clip: ours, local shards + one all-reduce"] = median_ms(
        lambda: distributed.clip_grad_norm(params, 1e9, parallel)
    )
    # A training forward and backward under bf16 autocast (PyTorch's layers: our kernels run
    # under Triton's interpreter here), one micro-batch of 2 x 64 tokens.
    x = torch.randint(0, 84, (2, 64))
    for name, tuning in (
        ("one process, no FSDP", None),
        ("FSDP2, tuning none (fp32 gathers, whole blocks)", frozenset()),
        ("FSDP2, tuning default", distributed.DEFAULT_TUNING),
        ("FSDP2, default + keep-gathered", distributed.DEFAULT_TUNING | {"keep-gathered"}),
    ):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SHAPE, use_triton=False))
        if tuning is not None:
            par = distributed.Parallel("fsdp", rank, world, tuning=tuning)
            distributed.wrap(model, par, torch.bfloat16)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(x, x)[1]
            loss.backward()

        rows[f"forward + backward: {name}"] = median_ms(step)
    if rank == 0:
        print(f"{len(params)} parameter tensors, {world} processes on gloo, torch {torch.__version__}")
        for name, ms in rows.items():
            print(f"{name:>48}: {ms:8.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
