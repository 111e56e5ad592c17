"""Which line of Python makes each glue kernel of the training step (no GPU needed).

One training step of chapter 12's GPT on our layers, as ``lab/step_profile.py`` profiles it on
a GPU (``train.Trainer``: bf16 autocast, gradient clipping, ``FusedAdamW``), at a tiny width on
the CPU. Our kernels run under Triton's interpreter; every other PyTorch operator the step
calls (the copies, casts, sums, joins, fills and sorts that are the glue kernels of
``step_profile.py``'s GPU table) is caught at the dispatcher (a ``TorchDispatchMode``, below
autograd and autocast, so the casts autocast inserts and the backward's operators are seen).
Each is charged to the line of the package that calls it; an operator of the backward pass to
its autograd node and the forward line that recorded the node (anomaly mode keeps that
line). Views and empty allocations launch no kernel and are left out.

    python lab/step_glue.py               # 6 blocks, as the Shakespeare model: its counts
    python lab/step_glue.py --layers 1    # one block: quicker (about 2 minutes)

The counts a step are those of the GPU's step with as many blocks (the same Python runs, and
one operator is one kernel or a few), except the token checks (``classes_in_range``), which
only CPU tensors get (a GPU asserts in the loss's kernel instead); CPU times are not results
and none are printed. The output of a run is in step_glue.log.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
import sys
import warnings

from stepkernels.models import train
from stepkernels.models.config import preset
from stepkernels.models.data import load_shakespeare
from stepkernels.ops.adamw import FusedAdamW
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that launch no kernel: views, metadata, allocations.
NO_KERNEL = set(
    """view _unsafe_view reshape t transpose permute expand unbind select slice as_strided
    detach alias unsqueeze squeeze split empty empty_strided empty_like new_empty
    new_empty_strided lift_fresh _local_scalar_dense is_pinned _pin_memory set_ split_with_sizes
    promote_types _record_function_enter_new _record_function_exit""".split()
)
OURS = ("/stepkernels/",)
NONE = "(no line of the package)"
INTERPRETER = ("triton/runtime/interpreter", "triton/language/")


def trainer_of(layers: int, width: int, data_dir: Path | None):
    """A Trainer of the Shakespeare preset's layout (dropout, biases, clipping) made small,
    with what it runs on a GPU: FusedAdamW, bf16 products under autocast."""
    cfg = preset(
        "shakespeare",
        n_layer=layers,
        n_head=2,
        n_embd=width,
        block_size=16,
        batch_size=2,
        out_dir="",
        checkpoint=False,
        eval_interval=0,
        sample_tokens=0,
        use_triton=True,
        step="eager",
        dtype="float32",  # the CPU's config refuses bf16; autocast is set below
    )
    trainer = train.Trainer(cfg, load_shakespeare(data_dir))
    groups = [dict(params=g["params"], weight_decay=g["weight_decay"]) for g in trainer.optimizer.param_groups]
    trainer.optimizer = FusedAdamW(groups, lr=cfg.learning_rate, betas=(0.9, cfg.beta2))
    trainer.autocast_dtype = torch.bfloat16  # as on a GPU (make_optimizer's CPU has none)
    return trainer


def short(line: str) -> str:
    """'src/stepkernels/models/gpt.py:142 (linear)' from a traceback line."""
    line = line.strip().splitlines()[0]  # '  File "...", line N, in name'
    path, number, name = line.split('"')[1], line.split(", line ")[1].split(",")[0], line.split(" in ")[-1]
    return f"{path.split('/src/')[-1].split('site-packages/')[-1]}:{number} ({name})"


def innermost_of_ours(lines) -> str:
    for line in reversed(lines):
        if any(piece in line for piece in OURS):
            return short(line)
    return NONE


class Glue(TorchDispatchMode):
    """Counts every operator that launches a kernel, by (operator, where, node)."""

    def __init__(self):
        super().__init__()
        self.found = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.record(name, args)
        return func(*args, **(kwargs or {}))

    def record(self, name, args):
        frame, frames = sys._getframe(2), []
        while frame is not None:
            file = frame.f_code.co_filename
            if any(piece in file for piece in INTERPRETER):
                return  # inside an interpreted kernel: no GPU operator
            frames.append(f'  File "{file}", line {frame.f_lineno}, in {frame.f_code.co_name}')
            frame = frame.f_back
        frames.reverse()  # outermost first, as a traceback
        node = torch._C._current_autograd_node()
        if node is not None:  # the backward: the node, and the forward line that made it
            forward = innermost_of_ours(node.metadata.get("traceback_", []))
            # a line of ours below the engine's frames: inside a backward of ours
            # (on a GPU the engine runs the backward on its device thread: no such frames)
            engine = [i for i, f in enumerate(frames) if "torch/autograd/" in f]
            inside = innermost_of_ours(frames[engine[-1] + 1 :] if engine else frames)
            inside = "" if inside == NONE else f", in {inside}"
            where = f"{forward} [backward: {node.name()}{inside}]"
        else:
            where = innermost_of_ours(frames)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        shape = "" if first is None else f"{str(first.dtype)[6:]}{list(first.shape)}"
        self.found[(name, where, shape)] += 1


def glue_of_a_step(trainer) -> Counter:
    trainer.run_step()  # the first step makes the optimizer's tables and pinned rows
    glue = Glue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode's warning that it is on
        with torch.autograd.detect_anomaly(check_nan=False), glue:
            trainer.run_step()
    return glue.found


def print_map(found: Counter):
    by_op = Counter()
    for (name, _, _), count in found.items():
        by_op[name] += count
    print(f"{sum(by_op.values())} operators that launch kernels, one step:\n")
    for name, total in by_op.most_common():
        print(f"aten::{name}: {total}")
        rows = [(c, where, shape) for (n, where, shape), c in found.items() if n == name]
        for count, where, shape in sorted(rows, key=lambda r: (-r[0], r[1])):
            print(f"  {count:4d}  {where}  {shape}")
        print()


def main(argv=None) -> Counter:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--data", type=Path, help="a prepared data folder")
    args = parser.parse_args(argv)
    found = glue_of_a_step(trainer_of(args.layers, args.width, args.data))
    print_map(found)
    return found


if __name__ == "__main__":
    main(sys.argv[1:])
