"""Sample text from a checkpoint that ``python -m stepkernels.train`` wrote.

    python -m stepkernels.sample --checkpoint runs/shakespeare/checkpoint.pt --prompt "ROMEO:"
    python -m stepkernels.sample --checkpoint runs/tiny/checkpoint.pt --tokens 100 --top-k 5

The checkpoint holds the model's shape and its vocabulary, so no data is needed. Arguments
are checked before the checkpoint is read; a bad one gets argparse's error (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path

from stepkernels.models import train
from stepkernels.models.config import DTYPES, Config, default_dtype
from stepkernels.models.gpt import GPT
from stepkernels.runtime import core
import torch

PROGRAM = "python -m stepkernels.sample"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description=__doc__.split("\n\n")[0],
        formatter_class=train.HelpFormatter,
        epilog=f"""\
examples:
  {PROGRAM} --checkpoint runs/shakespeare/checkpoint.pt --prompt "JULIET:"
  {PROGRAM} --checkpoint runs/tiny/checkpoint.pt --tokens 100 --temperature 0.8 --top-k 5
""",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=Path(Config().out_dir) / train.CHECKPOINT,
        metavar="PATH",
        help="a checkpoint written by python -m stepkernels.train",
    )
    parser.add_argument("--prompt", help="text to continue (default: the run's prompt)")
    parser.add_argument(
        "--tokens", type=int, default=300, metavar="N", help="characters to sample"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="divides the logits, > 0: below 1 sharper (default: the run's)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="sample from the K likeliest characters, 0 from all (default: the run's)",
    )
    parser.add_argument("--seed", type=int, default=1337, help="seeds the sampling")
    parser.add_argument(
        "--use-triton",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our kernels (else PyTorch's layers: the same parameters)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default_dtype(),
        help="products under autocast in this dtype (bfloat16 on a GPU that has it, "
        "float16 on one without, float32 on a CPU)",
    )
    return parser


def check_arguments(args, parser: argparse.ArgumentParser) -> None:
    """argparse's error for an argument out of range, before the checkpoint is read."""
    if args.tokens < 1:
        parser.error(f"argument --tokens: expected an int >= 1, got {args.tokens}")
    temperature = args.temperature
    if temperature is not None and not 0 < temperature < math.inf:
        parser.error(
            f"argument --temperature: expected a finite number > 0, got {temperature}"
        )
    if args.top_k is not None and args.top_k < 0:
        parser.error(
            f"argument --top-k: expected an int >= 0 (0: all), got {args.top_k}"
        )
    if args.seed < 0:
        parser.error(f"argument --seed: expected an int >= 0, got {args.seed}")
    if args.prompt == "":
        parser.error(
            "argument --prompt: empty; the sample continues at least one character"
        )
    if args.dtype == "bfloat16" and not core.ON_GPU:
        parser.error(
            "argument --dtype: bfloat16 is autocast on a GPU; on a CPU choose float32"
        )


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(args, parser)
    what_to_do = "name a checkpoint that python -m stepkernels.train wrote"
    try:
        state = train.read_checkpoint(args.checkpoint, what_to_do)
    except train.CheckpointError as error:
        parser.error(f"argument --checkpoint: {error}")
    saved = {**vars(Config()), **state["config"], "use_triton": args.use_triton}
    cfg = Config(**{name: saved[name] for name in vars(Config())})
    chars = state["chars"]
    prompt = cfg.prompt if args.prompt is None else args.prompt
    unknown = "".join(sorted(set(prompt) - set(chars)))
    if unknown:
        parser.error(
            f"argument --prompt: {prompt!r} has characters outside the model's "
            f"vocabulary: {unknown!r}; its {len(chars)} characters are {chars!r}"
        )
    model = GPT(cfg.model_config(len(chars))).to(core.DEVICE)
    model.load_state_dict(state["model"])
    model.eval()
    autocast = contextlib.nullcontext()
    if args.dtype != "float32":
        autocast = torch.autocast(core.DEVICE.type, getattr(torch, args.dtype))
    temperature = cfg.temperature if args.temperature is None else args.temperature
    top_k = cfg.top_k if args.top_k is None else args.top_k
    text = train.generate_text(
        model, chars, prompt, args.tokens, temperature, top_k, args.seed, autocast
    )
    print(text)


if __name__ == "__main__":
    main()
