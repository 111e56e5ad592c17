"""Where the GPT's training memory goes: the allocator's peaks for each way of running a step.

Run on a GPU from the repository root (``PYTHONPATH=src``, data prepared by ``make data``)::

    python lab/gpt_memory.py [--steps 100]

For each provider of chapter 12's race: the peak of allocated and of reserved bytes once warm
(after the first 50 steps, as ``Trainer.train`` measures), and for a CUDA graph the bytes its
private pool reserves. Not a recording: a probe for the notes beside the results.
"""

import argparse
import dataclasses
import gc

from stepkernels.models import train
from stepkernels.models.data import load_shakespeare
import torch

RACE = {
    "torch": (False, "eager"),
    "torch + CUDA graph": (False, "graph"),
    "triton": (True, "eager"),
    "triton + CUDA graph": (True, "graph"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    data = load_shakespeare()
    print(f"{'provider':>20} | {'allocated GiB':>13} | {'reserved GiB':>12} | tokens/s")
    for provider, (use_triton, step) in RACE.items():
        cfg = dataclasses.replace(train.Config(), use_triton=use_triton, step=step,
                                  max_steps=args.steps, eval_interval=0, eval_batches=1,
                                  checkpoint=False, sample_tokens=0)  # fmt: skip
        run = train.Trainer(cfg, data).train(log=lambda line: None)
        allocated = torch.cuda.max_memory_allocated() / 2**30
        print(f"{provider:>20} | {allocated:13.3f} | {run['peak_memory_gib']:12.3f} | "
              f"{run['tokens_per_s']:,.0f}")  # fmt: skip
        gc.collect(), torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
